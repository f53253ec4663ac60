"""The planner (hvd_slowmo.plan): its byte formulas, times, memory, recommendation and
calibration against numbers computed by hand, and its refusals of bad input."""

import io
import os
import re
import sys

import pytest

from hvd_slowmo.plan import (
    ALLTOALL_LOAD_LIMIT,
    Cluster,
    Measured,
    Setting,
    exchange_traffic,
    main,
    memory_parts,
    outer_traffic,
    parse_count,
    parse_duration,
    parse_rate,
    predict,
    print_calibration,
    recommend,
)

COSTS = {"fp32": 0.0, "int8": 1.0, "sparse": 2.0}


def test_bytes_of_each_exchange_by_hand():
    four = Cluster(4)
    # fp32: a ring allreduce, 2 (P-1)/P * 4n.
    assert exchange_traffic(Setting("fp32"), 1000, four).sent == 6000
    # int8, 1024 values over 4: chunks of 256, each 256 codes + one 4-byte scale = 260; the
    # all-to-all sends 3 of them, the all-gather 3/4 of the 4 reduced chunks.
    t = exchange_traffic(Setting("int8"), 1024, four)
    assert (t.sent, t.received) == (780 + 780, 3 * 260 + 780)
    # sparse, 4096 values: one chunk, k = 82: 8 bytes of lo/step, 82 positions of 12 bits
    # (123 bytes), 82 codes of 2 bits (21 bytes): 152 bytes; the all-gather sends 3 packets.
    assert exchange_traffic(Setting("sparse"), 4096, four).sent == 3 * 152
    # hierarchical int8, 8 workers in 2 nodes of 4, 1000 values: a reduce-scatter and an
    # all-gather of fp32 inside the node (3/4 of 4000 bytes each), and int8 across the two
    # nodes on a 250-value shard (chunks of 125: 129 bytes; one to the other node, half of 258
    # gathered).
    t = exchange_traffic(Setting("int8", hierarchical=True), 1000, Cluster(8, 4))
    assert t.sent == 2 * 3000 + 129 + 129
    cross = [p for p in t.phases if p.link == "cross"]
    assert [p.link_bytes for p in cross] == [4 * 129, 4 * 129]  # 4 shards share the node's link
    # One worker: nothing on the wire.
    assert exchange_traffic(Setting("int8"), 1000, Cluster(1)).sent == 0


def test_fragments_add_their_exchanges():
    t = outer_traffic(Setting("fp32", fragments=4), 1002, Cluster(2))
    # fragments of 251, 251, 250, 250 values: 4 * 251 and 4 * 250 bytes each (2 (P-1)/P = 1)
    assert t.sent == 2 * 1004 + 2 * 1000
    assert len(t.phases) == 4


def test_time_and_utilization_by_hand():
    cluster = Cluster(4, 1, 1e9, 1e-3)
    # fp32 of 1e6 values: 6e6 bytes at 1 Gbit/s = 48 ms, plus 2 (P-1) = 6 rounds of 1 ms.
    p = predict(Setting("fp32"), 1_000_000, 0.1, 10, cluster, COSTS)
    assert p.exchange_s == pytest.approx(0.054)
    assert p.iteration_s == pytest.approx(0.1 + 0.054 / 10)
    assert p.utilization == pytest.approx(0.1 / 0.1054)
    # overlap=1 hides it behind one step of 100 ms.
    assert predict(Setting("fp32", overlap=1), 1_000_000, 0.1, 10, cluster, COSTS).iteration_s == (
        pytest.approx(0.1)
    )
    # int8 of 2^18 values (1 MiB of float32) costs 1 ms of codec; 4 fragments, overlap 1 of
    # 10 ms steps: each fragment's W/4 exposed beyond 10 ms.
    p = predict(Setting("int8", False, 4, 1), 1 << 18, 0.01, 8, cluster, COSTS)
    wire = 8 * p.traffic.sent / 1e9 + 4 * 6 * 1e-3  # four fragments of two 3-round phases
    assert p.exchange_s == pytest.approx(wire + 1e-3)
    assert p.iteration_s == pytest.approx(0.01 + 4 * max(0, p.exchange_s / 4 - 0.01) / 8)


def test_a_saturated_link_bounds_the_iteration_by_its_bytes():
    """However it is split and overlapped, a period cannot be shorter than its bytes on the
    link: the iteration is at least ``egress / rate / tau``, and on a saturated link with
    ``fragments * overlap = tau`` exactly that."""
    link = Cluster(4, 1, 10e6)  # 10 Mbit/s, 10M parameters, 1 s steps: the 10 Mbit/s rows
    for codec in ("fp32", "int8", "sparse"):
        for f, d in ((1, 0), (1, 1), (2, 3), (4, 3), (4, 2)):
            p = predict(Setting(codec, False, f, d), 10_000_000, 1.0, 12, link, COSTS)
            bytes_s = sum(8 * ph.link_bytes for ph in p.traffic.phases) / 10e6
            assert p.link_load == pytest.approx(bytes_s / 12)
            assert p.iteration_s >= max(1.0, bytes_s / 12)
    p = predict(Setting("fp32", False, 4, 3), 10_000_000, 1.0, 12, link, COSTS)
    assert p.iteration_s == pytest.approx(60e6 * 8 / 10e6 / 12)  # 4 s: the link's pace


def test_an_all_to_all_on_a_loaded_link_is_outside_the_calibrated_regime():
    """The emulated cluster's int8 row at 10 Mbit/s (load 0.97, an all-to-all) was 34% under
    the measured time: the prediction says so, and the recommendation avoids it; a ring on the
    same link (calibrated up to load 3.8) and an all-to-all on a lightly loaded link do not."""
    slow, fast = Cluster(4, 1, 10e6), Cluster(4, 1, 100e6)
    int8 = Setting("int8", False, 4, 3)
    flagged = predict(int8, 10_000_000, 1.049, 12, slow, COSTS)
    assert flagged.link_load == pytest.approx(8 * 15_234_432 / 10e6 / (12 * 1.049))
    assert flagged.link_load > ALLTOALL_LOAD_LIMIT
    assert "outside the calibrated regime" in flagged.warning
    assert predict(int8, 10_000_000, 1.049, 12, fast, COSTS).warning == ""
    assert predict(Setting("fp32", False, 4, 3), 10_000_000, 1.049, 12, slow, COSTS).warning == ""
    # At the limit: just above it warns, just below it does not.
    step = 8 * 15_234_432 / 10e6 / 12 / ALLTOALL_LOAD_LIMIT
    assert predict(int8, 10_000_000, step * 0.99, 12, slow, COSTS).warning
    assert not predict(int8, 10_000_000, step * 1.01, 12, slow, COSTS).warning
    # Of int8 (flagged, as fast as sparse here) and sparse, the flagged one is not recommended.
    choices = [predict(Setting(c, False, 4, 3), 10_000_000, 1.049, 12, slow, COSTS)
               for c in ("int8", "sparse")]  # fmt: skip
    assert choices[0].utilization == choices[1].utilization == 1.0
    assert recommend(choices).setting.codec == "sparse"
    assert recommend(choices[:1]).setting.codec == "int8"  # nothing else runs: still an answer


def test_all_to_all_egress_counts_every_worker_of_a_node():
    # 8 workers, 4 per node, int8 of 8 * 256 values: chunks of 256 (260 bytes); each node's
    # 4 workers send their 4 chunks for the other node's workers: 4 * 4 * 260 bytes.
    t = exchange_traffic(Setting("int8"), 8 * 256, Cluster(8, 4))
    assert t.phases[0].link_bytes == 4 * 4 * 260
    assert t.phases[1].link_bytes == int(7 / 8 * 8 * 260)  # the ring's edge out of the node


def test_memory_parts():
    parts = memory_parts(Setting("int8", True, 4, 2), 1000, Cluster(8, 4), "adam")
    assert parts == {
        "parameters": 4000,
        "gradients": 4000,
        "optimizer state": 8000,
        "anchor": 4000,
        "slow buffer": 4000,
        "residual": 1000,  # the node's shard: 1/4
        "in flight": 2 * 1000,  # sent and snapshot of one fragment of 250
        "codec scratch": 1000 // 4,  # one fragment's buffer (its pseudo-gradient, its mean)
    }
    plain = memory_parts(Setting("fp32"), 1000, Cluster(2), "sgd")
    assert plain["residual"] == plain["in flight"] == plain["optimizer state"] == 0


def test_recommend_prefers_the_least_lossy_among_the_fastest():
    cluster = Cluster(4, 1, 100e9)  # a fast link: everything runs at compute speed
    predictions = [
        predict(Setting(c, False, f, d), 10_000, 1.0, 12, cluster, COSTS)
        for c in ("sparse", "int8", "fp32")
        for f, d in ((4, 3), (1, 1), (1, 0))
    ]
    assert recommend(predictions).setting == Setting("fp32")
    slow = Cluster(4, 1, 1e6)  # 1 Mbit/s: fp32 cannot keep up, the sparse codec can
    predictions = [predict(Setting(c), 1_000_000, 1.0, 12, slow, COSTS) for c in COSTS]
    assert recommend(predictions).setting.codec == "sparse"


def test_calibration_prints_predicted_against_measured():
    row = Measured(4, "1gbit", "fp32", 1, 0, 10, 1_000_000, 100.0, 110.0)
    out = io.StringIO()
    worst = print_calibration([row], COSTS, file=out)
    # 6e6 bytes at 1 Gbit/s over 10 steps: 4.8 ms per iteration, no latency: 104.8 ms.
    assert worst == pytest.approx(abs(104.8 / 110 - 1))
    # Link load: 48 ms of bytes per 1 s of compute.
    assert "| 4 | 1gbit | fp32, no overlap | 1 M | 100 | 5% | 105 | 110 | -4.7% |" in out.getvalue()


def test_units():
    assert parse_rate("10gbit") == 10e9
    assert parse_rate("100Mbit/s") == 100e6
    assert parse_rate("1.5gbps") == 1.5e9
    assert parse_duration("20ms") == pytest.approx(0.02)
    assert parse_duration("1.2") == 1.2
    assert parse_count("1.3e9") == 1_300_000_000
    assert parse_count("350M") == 350_000_000


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: parse_count("-1e9", "--params"), "--params='-1e9'"),
        (lambda: parse_rate("10gbyte", "--link"), "--link='10gbyte': unknown unit"),
        (lambda: parse_rate("0gbit", "--link"), "--link='0gbit' must be above zero"),
        (lambda: parse_duration("20 fortnights", "--latency"), "--latency"),
        (lambda: Cluster(4, 8), "per_node=8 is more workers per node than workers=4"),
        (lambda: Cluster(6, 4), "workers=6 is not a whole number of nodes"),
        (lambda: predict(Setting("fp32", False, 4, 4), 10, 1, 12, Cluster(2)), "tau // fragments"),
        (lambda: predict(Setting("zstd"), 10, 1.0, 12, Cluster(2)), "codec 'zstd' has no cost"),
    ],
    ids=["negative-size", "unknown-unit", "zero-rate", "bad-latency", "per-node", "whole-nodes",
         "overlap", "codec"],
)  # fmt: skip
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        call()


def test_command_line_prints_every_setting_and_a_recommendation(capsys):
    args = ["--params", "1.3e9", "--step-time", "1.2", "--workers", "64", "--per-node", "8",
            "--link", "10gbit", "--latency", "20ms"]  # fmt: skip
    text = main(args)
    assert text == capsys.readouterr().out.rstrip("\n")
    labels = ("fp32, no overlap", "int8, fragments=1, overlap=1", "sparse, fragments=4, overlap=3",
              "hier int8, no overlap",
              "hier sparse, fragments=4, overlap=3 (not an optimizer option yet)")  # fmt: skip
    for label in labels:
        assert f"| {label} | 12 |" in text
    assert "Memory per GPU: parameters 5.2 GB" in text
    # The flat int8 rows' all-to-all loads the 10 Gbit/s link to 59%: marked, and explained.
    assert "| int8, no overlap | 12 | 2576 | 46.6% | 59% (!) |" in text
    assert "(!) Outside the calibrated regime: an all-to-all on a link loaded above 50%" in text
    # The hierarchical rows with fragments are predicted (here they are the fastest), never
    # recommended: the optimizer's hierarchical exchange takes the whole model. The one without
    # fragments that wins is recommended, with the arguments that ask for it.
    (line,) = [t for t in text.splitlines() if t.startswith("Recommended: ")]
    assert line.startswith("Recommended: hier int8, fragments=1, overlap=1, tau=12:")
    assert (
        'DistributedOptimizer(..., codec="int8", error_feedback=True, hierarchical=True, '
        "overlap=1, tau=12)" in text
    )
    with pytest.raises(ValueError, match="--per-node=8 is more workers per node than --workers=4"):
        main(args[:4] + ["--workers", "4"] + args[6:])


def test_calibration_reads_the_cluster_benchmark_rows():
    """benchmarks/plan_calibration.py takes the SlowMo rows the model covers (fp32, int8,
    sparse over Local SGD) from a run of benchmarks/cluster.py, with the run's compute-only
    time as the step time, and leaves out those it does not model (eager updates)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    from plan_calibration import measured_rows

    run = {
        "header": {"hosts": 4, "rate": "100mbit", "params": 10_000_000},
        "results": {
            "compute": {"median_ms": 1000.0},
            "localsgd_slowmo_stream4_sparse": {"median_ms": 1050.0},
            "localsgd_slowmo_int8": {"median_ms": 1300.0},
            "localsgd_slowmo_stream4_o2_local": {"median_ms": 1100.0},
        },
    }
    rows = measured_rows([run])
    assert rows == [
        Measured(4, "100mbit", "int8", 1, 0, 12, 10_000_000, 1000.0, 1300.0),
        Measured(4, "100mbit", "sparse", 4, 3, 12, 10_000_000, 1000.0, 1050.0),
    ]


def test_a_codec_on_the_compute_cores_is_not_hidden():
    # int8 of 2^18 values: 1 ms of codec; overlap hides the wire (a few ms) but not the codec.
    cluster = Cluster(4, 1, 1e9)
    hidden = predict(Setting("int8", False, 1, 1), 1 << 18, 0.1, 10, cluster, COSTS)
    shown = predict(
        Setting("int8", False, 1, 1), 1 << 18, 0.1, 10, cluster, COSTS, codec_hidden=False
    )
    assert hidden.iteration_s == pytest.approx(0.1)
    assert shown.iteration_s == pytest.approx(0.1 + 1e-3 / 10)
