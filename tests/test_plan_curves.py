"""The planner's curves to 1024 workers (benchmarks/plan_curves.py): every cell is
hvd_slowmo.plan.predict's utilization for that setting and worker count, the curves are the
settings the docs name, the figure is written, and bad input is refused by name."""

import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import plan_curves  # noqa: E402

from hvd_slowmo.plan import Cluster, Setting, default_settings, predict  # noqa: E402

COSTS = {"fp32": 0.0, "int8": 1.0, "sparse": 2.0, "sparse-owners": 3.0}


def test_curves_are_fp32_plain_flat_streamed_and_hierarchical_with_overlap():
    got = plan_curves.curve_settings(12, 8)
    assert set(got) <= set(default_settings(12, 8))
    assert got == [
        Setting("fp32"),
        Setting("fp32", False, 4, 3),
        Setting("int8", False, 4, 3),
        Setting("sparse", False, 4, 3),
        Setting("sparse-owners", False, 4, 3),
        Setting("int8", True, 1, 1),
        Setting("sparse", True, 1, 1),
    ]
    # One worker per node: no hierarchical curve.
    assert not any(s.hierarchical for s in plan_curves.curve_settings(12, 1))
    with pytest.raises(ValueError, match="tau=3: the streamed curves need tau >= 4"):
        plan_curves.curve_settings(3, 8)


def test_each_cell_is_predict_for_that_setting_and_worker_count():
    workers = [4, 8, 16]
    got = plan_curves.curves(10**6, 0.05, 8, 4, 1e8, 0.002, workers, COSTS)
    assert list(got) == plan_curves.curve_settings(8, 4)
    for setting, row in got.items():
        for p, prediction in zip(workers, row):
            want = predict(setting, 10**6, 0.05, 8, Cluster(p, 4, 1e8, 0.002), COSTS)
            assert prediction == want, f"{setting.label} at {p} workers"
    # The curves differ: at 16 workers on 100 Mbit/s fp32 without overlap is exposed.
    assert got[Setting("fp32")][2].utilization < 0.9
    assert got[Setting("sparse", False, 4, 2)][2].utilization > got[Setting("fp32")][2].utilization


def test_command_line_prints_predict_and_writes_the_figure(tmp_path, capsys):
    png = tmp_path / "curves.png"
    argv = ["--params", "2M", "--step-time", "50ms", "--tau", "8", "--per-node", "2"]
    argv += ["--links", "100mbit", "1gbit", "--latency", "5ms", "--workers", "2", "4", "8"]
    text = plan_curves.main([*argv, "--codec-cost", "0.5", "--png", str(png)])
    assert "not measured" in text and text in capsys.readouterr().out
    costs = {"fp32": 0.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.5, "fp8": 0.5, "sparse": 0.5,
             "sparse-owners": 0.5}  # fmt: skip
    # The 100 Mbit/s table's hierarchical int8 row, cell by cell.
    table = text.split("link 100mbit, latency 5ms:")[1].split("link 1gbit")[0]
    row = next(line for line in table.splitlines() if line.startswith("| hier int8,"))
    want = [
        predict(Setting("int8", True, 1, 1), 2 * 10**6, 0.05, 8, Cluster(p, 2, 1e8, 0.005), costs)
        for p in (2, 4, 8)
    ]
    assert row.split(" | ")[1:] == [f"{100 * w.utilization:.1f}%" for w in want[:-1]] + [
        f"{100 * want[-1].utilization:.1f}% |"
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--links", "10gbyte"], "--links='10gbyte': unknown unit 'gbyte'"),
        (["--workers", "8", "12"], "workers=12 is not a whole number of nodes of per_node=8"),
        (["--params=-1e9"], "--params='-1e9' is not a non-negative number"),
        (["--codec-cost", "-1"], "--codec-cost=-1.0 must be >= 0"),
    ],
    ids=["unit", "workers", "params", "codec-cost"],
)
def test_bad_input_names_the_argument(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_curves.main(argv)
