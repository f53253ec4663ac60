"""The utilization report (benchmarks/utilization.py): the analytic formula by hand, and the
table from a fabricated results.json."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import utilization  # noqa: E402

from hvd_slowmo.compression import SparseCodec, encoded_nbytes, packet_nbytes  # noqa: E402


def test_no_overlap_exposes_the_whole_wire():
    # 60 MB at 100 Mbit/s is 4.8 s on the wire against 12 x 1 s of compute.
    got = utilization.analytic_utilization(1000.0, 60e6, 100e6, tau=12)
    assert got == pytest.approx(12 / (12 + 4.8))


def test_streaming_hides_up_to_overlap_steps_per_fragment():
    # 4 fragments of 15 MB: 1.2 s each at 100 Mbit/s, 3 s of compute behind each: all hidden.
    assert utilization.analytic_utilization(1000.0, 60e6, 100e6, 12, 4, 3) == 1.0
    # At 10 Mbit/s each takes 12 s: 9 s of each exposed, 36 s per period.
    got = utilization.analytic_utilization(1000.0, 60e6, 10e6, 12, 4, 3)
    assert got == pytest.approx(12 / (12 + 4 * 9))
    # overlap=2 on one average: 4.8 - 2 s exposed.
    got = utilization.analytic_utilization(1000.0, 60e6, 100e6, 12, 1, 2)
    assert got == pytest.approx(12 / (12 + 2.8))
    assert utilization.analytic_utilization(1000.0, 0, 10e6, 12) == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [dict(rate_bits_per_s=0), dict(tau=0), dict(fragments=0), dict(overlap=-1)],
    ids=["rate", "tau", "fragments", "overlap"],
)
def test_analytic_utilization_rejects(kwargs):
    args = dict(compute_ms=1.0, outer_bytes=1.0, rate_bits_per_s=1e6, tau=12) | kwargs
    with pytest.raises(ValueError, match="analytic_utilization"):
        utilization.analytic_utilization(**args)


def test_outer_step_bytes_follow_the_exchanges():
    n, m = 10_000_000, 4
    assert utilization.outer_step_bytes("localsgd_slowmo", n, m) == 2 * 0.75 * 4 * n
    assert utilization.outer_step_bytes("localsgd_slowmo_int8", n, m) == 1.5 * encoded_nbytes(
        n, "int8"
    )
    sparse = utilization.outer_step_bytes("localsgd_slowmo_stream4_sparse", n, m)
    assert sparse == 3 * 4 * packet_nbytes(n // 4, SparseCodec())
    assert utilization.outer_step_bytes("localsgd_slowmo", n, m) / sparse > 50


def _run(rate: str, bits: float, rows: dict[str, tuple[float, float]], params=10_000_000):
    """A run as cluster.py writes it: rows of (ms/iteration, bytes per iteration)."""
    return {
        "header": {"params": params, "rate": rate, "rate_bits_per_s": bits},
        "results": {
            key: {"median_ms": ms, "bytes_per_iter": b, "available": True}
            for key, (ms, b) in rows.items()
        },
    }


def test_report_from_a_fabricated_results_json(tmp_path, capsys):
    runs_10 = [
        _run(
            "10mbit",
            10e6,
            {
                "compute": (1000.0, 0.0),
                "localsgd_slowmo": (5000.0, 5e6),  # 60 MB per outer step
                "localsgd_slowmo_stream4_sparse": (1050.0, 0.1e6),  # 1.2 MB
                "localsgd_slowmo_int8": (2000.0, 1.25e6),
            },
        )
    ]
    runs_100 = [
        _run(
            "100mbit",
            100e6,
            {
                "compute": (1000.0, 0.0),
                "localsgd_slowmo": (1400.0, 5e6),
            },
        )
    ]
    runs_100[0]["results"]["localsgd_slowmo_sparse"] = {"available": False, "reason": "x"}
    paths = []
    for name, runs in (("a", runs_10), ("b", runs_100)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(runs))
        paths.append(str(path))
    records = utilization.utilization_rows(runs_10 + runs_100)
    by = {(r["rate"], r["key"]): r for r in records}
    assert len(records) == 4  # the unavailable row gives nothing
    fp32 = by[("10mbit", "localsgd_slowmo")]
    assert fp32["outer_bytes"] == 60e6 and fp32["measured"] == pytest.approx(0.2)
    assert fp32["analytic"] == pytest.approx(12 / (12 + 48))
    sparse = by[("10mbit", "localsgd_slowmo_stream4_sparse")]
    assert sparse["analytic"] == 1.0 and sparse["measured"] == pytest.approx(1000 / 1050)
    assert by[("100mbit", "localsgd_slowmo")]["analytic"] == pytest.approx(12 / 16.8)

    assert utilization.main(paths) == 0
    table = capsys.readouterr().out
    assert "| codec | streamed | bytes / worker / outer step | 10mbit | 100mbit |" in table
    assert "| fp32 | no overlap | 60MB | 20.0% / 20.0% | 71.4% / 71.4% |" in table
    assert "| sparse | fragments=4, overlap=3 | 1.2MB | 95.2% / 100.0% | - |" in table
    assert "| sparse | no overlap |" not in table


def test_estimate_prints_one_line_per_rate(capsys):
    assert utilization.main(["--estimate", "--params", "10M", "--rate", "10mbit,1gbit"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("10M at 10mbit: about")
    slow, fast = (float(line.split("about ")[1].split(" min")[0]) for line in lines)
    assert slow > fast > 0
