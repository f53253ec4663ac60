"""Tests of the emulated-cluster benchmark (benchmarks/cluster.py).

The pure logic (plans, commands, statistics, ratios, the table) is tested everywhere, fast;
one end-to-end run on 2 emulated hosts needs root, ``ip netns`` and Horovod.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "cluster", os.path.join(ROOT, "benchmarks", "cluster.py")
)
cluster = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cluster)  # puts benchmarks/ on sys.path for its cluster_* modules
import cluster_algorithms as calg  # noqa: E402
import cluster_report as creport  # noqa: E402
import cluster_stats as cstats  # noqa: E402


@pytest.mark.parametrize(
    "rate,bits",
    [
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("2.5gbit", 25 * 10**8),
        ("500kbit", 5 * 10**5),
        ("10GBIT", 10**10),
    ],
    ids=["1gbit", "100mbit", "fraction", "kbit", "uppercase"],
)
def test_parse_rate(rate, bits):
    assert cluster.parse_rate(rate) == bits


@pytest.mark.parametrize(
    "rate", ["1gbps", "fast", "0mbit", "-1gbit", ""], ids=["bytes", "word", "zero", "neg", "empty"]
)
def test_parse_rate_rejects(rate):
    with pytest.raises(ValueError, match="--rate"):
        cluster.parse_rate(rate)


def test_parse_count():
    assert [cluster.parse_count(s) for s in ("1M", "10M", "50m", "500k", "1.5M", "123")] == [
        10**6,
        10**7,
        5 * 10**7,
        5 * 10**5,
        1_500_000,
        123,
    ]
    with pytest.raises(ValueError, match="--params"):
        cluster.parse_count("ten")
    with pytest.raises(ValueError, match="--params"):
        cluster.parse_count("0")


def test_plan_names_and_addresses():
    plan = cluster.plan_cluster(3, prefix="abc", subnet="10.9.8")
    assert [h.netns for h in plan.hosts] == ["abc-h0", "abc-h1", "abc-h2"]
    assert [h.address for h in plan.hosts] == ["10.9.8.1", "10.9.8.2", "10.9.8.3"]
    assert [h.rank for h in plan.hosts] == [0, 1, 2]
    assert plan.switch == "abc-sw" and plan.control_address == "10.9.8.254"
    # Link names must fit the kernel's 15-character limit, even for the longest prefix and rank.
    longest = cluster.plan_cluster(250, prefix="abcdefgh")
    names = [n for h in longest.hosts for n in (h.port, h.peer)] + [
        longest.control,
        longest.control_peer,
    ]
    assert max(len(n) for n in names) <= 15
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_hosts": 1}, "--hosts"),
        ({"num_hosts": 251}, "--hosts"),
        ({"num_hosts": True}, "--hosts"),
        ({"num_hosts": 2, "prefix": "Bad-Prefix"}, "--prefix"),
        ({"num_hosts": 2, "prefix": "toolongpfx"}, "--prefix"),
        ({"num_hosts": 2, "subnet": "10.0.300"}, "--subnet"),
        ({"num_hosts": 2, "subnet": "10.0.0.0/24"}, "--subnet"),
    ],
    ids=["one-host", "too-many", "bool", "prefix-chars", "prefix-long", "octet", "cidr"],
)
def test_plan_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cluster.plan_cluster(**kwargs)


def test_setup_commands_build_every_link():
    plan = cluster.plan_cluster(2, prefix="t")
    cmds = [" ".join(c) for c in cluster.setup_commands(plan)]
    assert cmds[0] == "ip netns add t-sw"
    assert "ip netns add t-h0" in cmds and "ip netns add t-h1" in cmds
    assert "ip link add tv1 type veth peer name tp1" in cmds
    assert "ip -n t-sw link set tp1 master br0" in cmds
    assert "ip -n t-h1 link set tv1 name eth0" in cmds
    assert "ip -n t-h1 addr add 10.77.0.2/24 dev eth0" in cmds
    assert "ip addr add 10.77.0.254/24 dev tc0" in cmds
    # A veth is renamed only after it moved into its namespace (the name eth0 exists in the root
    # one).
    assert cmds.index("ip link set tv0 netns t-h0") < cmds.index(
        "ip -n t-h0 link set tv0 name eth0"
    )


def test_tbf_args_and_shaping_both_directions():
    assert cluster.tbf_args("1gbit") == [
        "tbf",
        "rate",
        "1gbit",
        "burst",
        "500000",
        "latency",
        "50ms",
    ]
    # Low rates still get a bucket larger than one 64 KiB GSO packet.
    assert cluster.tbf_args("10mbit")[4] == str(128 * 1024)
    plan = cluster.plan_cluster(2, prefix="t")
    cmds = [" ".join(c) for c in cluster.shaping_commands(plan, "100mbit")]
    assert len(cmds) == 4
    tbf = "tbf rate 100mbit burst 131072 latency 50ms"
    assert f"ip netns exec t-h0 tc qdisc replace dev eth0 root {tbf}" in cmds
    assert f"ip netns exec t-sw tc qdisc replace dev tp0 root {tbf}" in cmds
    assert f"ip netns exec t-sw tc qdisc replace dev tp1 root {tbf}" in cmds
    with pytest.raises(ValueError, match="--rate"):
        cluster.shaping_commands(plan, "1GB")


def test_teardown_commands_cover_everything_built():
    plan = cluster.plan_cluster(3, prefix="t")
    built = {c[3] for c in cluster.setup_commands(plan) if c[:3] == ["ip", "netns", "add"]}
    torn = [c for c in cluster.teardown_commands(plan)]
    assert {c[3] for c in torn if c[:3] == ["ip", "netns", "del"]} == built
    assert ["ip", "link", "del", "tc0"] in torn  # the only link left in the root namespace


def test_stale_namespaces_matches_only_this_prefix():
    listing = "hsmc-h0 (id: 3)\nhsmc-sw (id: 2)\nhsmc-h12\nhsmcx-h0\nother-h0\nhsmc-hx\n\n"
    assert cluster.stale_namespaces(listing, "hsmc") == ["hsmc-h0", "hsmc-sw", "hsmc-h12"]
    assert cluster.stale_namespaces("", "hsmc") == []


def test_hosts_file_maps_machine_name_to_own_address():
    plan = cluster.plan_cluster(3, prefix="t")
    text = cluster.hosts_file(plan, plan.hosts[1], "vm")
    lines = text.splitlines()
    assert lines[0] == "127.0.0.1 localhost"
    assert lines[1] == "10.77.0.2 vm th1"
    assert "10.77.0.1 th0" in lines and "10.77.0.3 th2" in lines
    assert not any("127.0.0.1 vm" in line for line in lines)


def test_worker_env_matches_horovod_gloo_launcher():
    plan = cluster.plan_cluster(4, prefix="t")
    env = cluster.worker_env(plan, plan.hosts[2], 4321)
    assert env["HOROVOD_RANK"] == "2" and env["HOROVOD_SIZE"] == "4"
    assert env["HOROVOD_CROSS_RANK"] == "2" and env["HOROVOD_CROSS_SIZE"] == "4"
    assert env["HOROVOD_LOCAL_RANK"] == "0" and env["HOROVOD_LOCAL_SIZE"] == "1"
    assert (
        env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.77.0.254"
        and env["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "4321"
    )
    assert env["HOROVOD_HOSTNAME"] == "th2" and env["HOROVOD_GLOO_IFACE"] == "eth0"
    # torch.distributed (the PyTorch peers) uses the same shaped link and finds rank 0's host.
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["MASTER_ADDR"] == "10.77.0.1"


def test_algorithm_plan():
    keys = [a.key for a in calg.ALGORITHMS]
    assert len(set(keys)) == len(keys)
    assert {a.kind for a in calg.ALGORITHMS} <= set(calg.KINDS)
    listed = [k for _, o, s in calg.TABLE2_ROWS for k in (o, s)] + list(calg.PEER_KEYS)
    listed += [k for _, ks in calg.PEER_ROWS for k in ks]
    listed += [k for pair in calg.OVERLAP_ROWS for k in pair]
    assert set(listed) <= set(keys)
    by = calg.ALGORITHM_BY_KEY
    # The peers come from PyTorch or Horovod, and compare like with like.
    assert {by[k].kind for k in calg.PEER_KEYS} == {"horovod", "ddp", "postlocal"}
    assert by["torch_postlocal"].tau == by["localsgd"].tau == 12 and by["torch_postlocal"].periodic
    assert by["torch_ddp"].tau == by["horovod_ar"].tau == 1
    # hvd_slowmo's AR-SGD at the library's default tau (plain AR-SGD for any tau: the slow
    # update is off and the buffers are kept), and SlowMo over it.
    assert by["allreduce"].tau == by["allreduce_slowmo"].tau == 12
    assert by["allreduce"].options["buffers"] == "maintain"
    for overlapped, exposed in calg.OVERLAP_ROWS:
        a, b = by[overlapped], by[exposed]
        # Same configuration but the overlap, which the option allows (0 <= d < tau), and which
        # the warm-up keeps inside one timed window with the outer step that started it.
        same = ("kind", "base", "tau", "periodic", "payload")
        assert [getattr(a, f) for f in same] == [getattr(b, f) for f in same]
        assert {k: v for k, v in a.options.items() if k != "overlap"} == b.options
        assert b.overlap == 0 and 0 < a.overlap < a.tau and a.overlap <= calg.WARMUP_ITERS
    assert [by[o].overlap for o, _ in calg.OVERLAP_ROWS] == [1, 2]
    # Peers are measured next to the rows they are compared with.
    assert keys.index("torch_ddp") == keys.index("horovod_ar") + 1
    assert keys.index("torch_postlocal") + 1 == keys.index("localsgd")


_PEERS = [
    "compute",
    "horovod_ar",
    "torch_ddp",
    "allreduce",
    "allreduce_slowmo",
    "allreduce_td",
    "torch_postlocal",
    "localsgd",
    "localsgd_slowmo",
    "localsgd_slowmo_td",
    "localsgd_slowmo_overlap1",
    "localsgd_slowmo_overlap1_td",
    "localsgd_slowmo_overlap2",
    "localsgd_slowmo_int8",
    "localsgd_slowmo_sparse",
    "localsgd_slowmo_stream4",
    "localsgd_slowmo_stream4_o2_local",
    "localsgd_slowmo_stream4_o2_local_mix",
    "localsgd_slowmo_stream4_int8",
    "localsgd_slowmo_int8_overlap2",
    "localsgd_slowmo_stream4_sparse",
    "localsgd_slowmo_sparse_overlap2",
]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("localsgd,compute", ["compute", "localsgd"]),  # measured in the plan's order
        ("compute,compute", ["compute"]),
        ("peers", _PEERS),
        ("sgp,peers,localsgd", _PEERS + ["sgp"]),
        ("all", [a.key for a in calg.ALGORITHMS]),
    ],
    ids=["order", "duplicate", "peers", "set-and-keys", "all"],
)
def test_select_algorithms(text, expected):
    assert calg.select_algorithms(text) == expected


@pytest.mark.parametrize(
    "text", ["localsgd,nope", " , ", "Peers"], ids=["unknown", "empty", "case"]
)
def test_select_algorithms_rejects(text):
    with pytest.raises(ValueError, match="--algorithms"):
        calg.select_algorithms(text)


def test_hidden_fraction():
    # No overlap 1328 ms, compute 1252 ms: the exact average costs 76 ms per iteration.
    assert cstats.hidden_fraction(1328.0, 1252.0, 1252.0) == 1.0
    assert cstats.hidden_fraction(1328.0, 1290.0, 1252.0) == pytest.approx(0.5)
    assert cstats.hidden_fraction(1328.0, 1328.0, 1252.0) == 0.0
    # Noise can make the overlapped run slower (< 0) or faster than compute only (> 1): shown as is.
    assert cstats.hidden_fraction(1328.0, 1366.0, 1252.0) == pytest.approx(-0.5)
    assert cstats.hidden_fraction(1328.0, 1214.0, 1252.0) == pytest.approx(1.5)
    # Nothing to hide, or a time missing: no figure.
    assert cstats.hidden_fraction(1250.0, 1240.0, 1252.0) is None
    assert cstats.hidden_fraction(None, 1240.0, 1252.0) is None
    assert cstats.hidden_fraction(1328.0, None, 1252.0) is None
    assert cstats.hidden_fraction(1328.0, 1300.0, None) is None


def test_window_stats():
    # 6 iterations, windows of 3: [1, 1, 4] s then [1, 1, 1] s.
    stamps = [0.0, 1.0, 2.0, 6.0, 7.0, 8.0, 9.0]
    s = cstats.window_stats(stamps, 3)
    assert s["per_window_ms"] == [2000.0, 1000.0]
    assert s["median_ms"] == 1500.0 and s["min_ms"] == 1000.0 and s["max_ms"] == 2000.0
    assert s["windows"] == 2
    # A trailing partial window is ignored rather than mixed in.
    assert cstats.window_stats(stamps + [100.0], 3)["per_window_ms"] == [2000.0, 1000.0]
    with pytest.raises(ValueError, match="at least 3"):
        cstats.window_stats([0.0, 1.0, 2.0], 3)


def test_cluster_stamps_follow_the_slowest_worker():
    # Rank 1 started later on its own clock and is slower in the second iteration.
    stamps = cstats.cluster_stamps([[10.0, 11.0, 12.0], [50.0, 51.0, 53.5]])
    assert stamps == [0.0, 1.0, 3.5]
    with pytest.raises(ValueError, match="same number of stamps"):
        cstats.cluster_stamps([[0.0, 1.0], [0.0]])


def test_pool_repeats():
    def rep(windows, iters, sent, phase):
        return {
            "per_window_ms": windows,
            "window": 12,
            "median_ms": sorted(windows)[len(windows) // 2],
            "iteration_ms": [1.0] * iters,
            "iterations": iters,
            "rank_median_ms": [1.0, 2.0],
            "bytes_per_iter": sent,
            "bytes_per_outer_step": 12 * sent,
            "peak_bytes_per_step": sent,
            "bytes_computed": False,
            "phase_ms_per_iter": {"average": phase},
            "max_rss_mb": 10.0 * phase,
        }

    pooled = cstats.pool_repeats(
        [rep([10.0, 30.0], 24, 100.0, 2.0), rep([20.0, 40.0, 50.0], 36, 300.0, 4.0)]
    )
    assert pooled["per_window_ms"] == [10.0, 30.0, 20.0, 40.0, 50.0]
    assert pooled["median_ms"] == 30.0 and pooled["min_ms"] == 10.0 and pooled["max_ms"] == 50.0
    assert (
        pooled["windows"] == 5 and pooled["iterations"] == 60 and len(pooled["iteration_ms"]) == 60
    )
    assert pooled["repeat_median_ms"] == [30.0, 40.0]
    assert pooled["bytes_per_iter"] == 200.0 and pooled["phase_ms_per_iter"] == {"average": 3.0}
    assert pooled["peak_bytes_per_step"] == 300.0  # the most of any repeat
    assert pooled["bytes_per_outer_step"] == 2400.0
    assert pooled["max_rss_mb"] == 40.0  # the high-water mark of any repeat
    with pytest.raises(ValueError, match="at least one"):
        cstats.pool_repeats([])


def test_ring_bytes():
    assert cstats.ring_bytes(4_000_000, 4) == 6_000_000  # 2 * 3/4 * 4 MB
    assert cstats.ring_bytes(1000, 2) == 1000
    assert cstats.ring_bytes(1000, 1) == 0


def _results(**ms):
    return {
        k: {"median_ms": v, "min_ms": v, "max_ms": v, "bytes_per_iter": 0} for k, v in ms.items()
    }


def test_summarize_ratios():
    # compute 100, AR-SGD 150 -> AR_comm 50 (a third of AR's time).
    res = _results(
        compute=100.0,
        horovod_ar=150.0,
        localsgd=105.0,
        localsgd_slowmo=106.0,
        double_avg=110.0,
        localsgd_slowmo_nocheck=100 + 50 / 12,
        sgp=140.0,
        sgp_slowmo=140.0,
        osgp=110.0,
        osgp_slowmo=120.0,
    )
    s = cstats.summarize(res)
    rows, tg = s["rows"], s["targets"]
    assert rows["horovod_ar"]["speedup_vs_ar"] == 1.0
    assert rows["localsgd_slowmo"]["speedup_vs_ar"] == pytest.approx(150 / 106)
    assert rows["localsgd"]["over_compute"] == pytest.approx(1.05)
    assert rows["localsgd"]["ideal_ms"] == pytest.approx(100 + 50 / 12)
    assert rows["double_avg"]["ideal_ms"] == pytest.approx(
        100 + 2 * 50 / 12
    )  # buffers doubled the payload
    assert rows["sgp"]["ideal_ms"] is None and rows["horovod_ar"]["over_ideal"] is None
    assert tg["ar_comm_ms"] == 50.0 and tg["ar_comm_fraction"] == pytest.approx(1 / 3)
    assert tg["localsgd_slowmo_over_localsgd"] == pytest.approx(106 / 105)
    assert tg["localsgd_slowmo_over_ideal"] == pytest.approx(106 / (100 + 50 / 12))
    assert tg["localsgd_slowmo_nocheck_over_ideal"] == pytest.approx(1.0)
    assert tg["localsgd_slowmo_slow_update_fraction"] is None  # no phase timings given
    assert tg["osgp_hidden_fraction"] == pytest.approx((140 - 110) / 40)
    assert tg["osgp_slowmo_hidden_fraction"] == pytest.approx((140 - 120) / 40)


def test_summarize_peers_and_overlap():
    res = _results(
        compute=1000.0,
        horovod_ar=1600.0,
        torch_ddp=1500.0,
        allreduce=1650.0,
        torch_postlocal=1060.0,
        localsgd=1050.0,
        localsgd_slowmo=1080.0,
        localsgd_slowmo_overlap1=1020.0,
    )
    tg = cstats.summarize(res)["targets"]
    assert tg["localsgd_slowmo_overlap1_hidden_fraction"] == pytest.approx(60 / 80)
    assert tg["localsgd_slowmo_overlap2_hidden_fraction"] is None  # not measured
    assert tg["localsgd_over_torch_postlocal"] == pytest.approx(1050 / 1060)
    assert tg["allreduce_over_torch_ddp"] == pytest.approx(1650 / 1500)
    assert tg["fastest_peer"] == "torch_postlocal"
    assert tg["localsgd_slowmo_overlap1_over_fastest_peer"] == pytest.approx(1020 / 1060)
    assert tg["localsgd_slowmo_overlap2_over_fastest_peer"] is None
    # Without any peer row there is no fastest peer.
    tg = cstats.summarize(_results(compute=1000.0, localsgd_slowmo_overlap1=1020.0))["targets"]
    assert tg["fastest_peer"] is None and tg["localsgd_slowmo_overlap1_over_fastest_peer"] is None


def test_summarize_slow_update_fraction():
    res = _results(localsgd=100.0, localsgd_slowmo=104.0)
    res["localsgd_slowmo"]["phase_ms_per_iter"] = {
        "base_comm": 0.0,
        "average": 3.0,
        "slow_update": 1.04,
    }
    assert cstats.summarize(res)["targets"][
        "localsgd_slowmo_slow_update_fraction"
    ] == pytest.approx(0.01)


def test_summarize_missing_entries():
    s = cstats.summarize(_results(compute=100.0, localsgd=105.0))
    assert (
        s["rows"]["localsgd"]["speedup_vs_ar"] is None and s["rows"]["localsgd"]["ideal_ms"] is None
    )
    assert s["targets"]["osgp_hidden_fraction"] is None and s["targets"]["ar_comm_ms"] is None


def test_render_markdown_table():
    res = _results(compute=100.0, horovod_ar=150.0, localsgd=105.0, localsgd_slowmo=106.0)
    res["horovod_ar"].update(bytes_per_iter=6e6, bytes_computed=True)
    res["sgp"] = {"available": False, "reason": "base 'sgp' not in hvd_slowmo.BASES"}
    header = {
        "workload": "synthetic",
        "params_human": "1M",
        "param_bytes": 4_000_000,
        "hosts": 4,
        "rate": "1gbit",
        "compute_ms": 100.0,
        "cpu_cores": 2,
        "horovod": "0.28.1",
        "load_avg_1min": [1.5, 2.25],
    }
    md = creport.render_markdown({"header": header, "results": res})
    assert "4 hosts, 1gbit links" in md and "1M parameters" in md
    assert "| Local SGD | 12 | 105 ms (1.43x) | 106 ms (1.42x) | +1.0% |" in md
    assert "| SGP | 48 | not available | not run | n/a |" in md
    assert "6.00 MB (computed)" in md
    assert "33.3% of its time" in md
    assert "load average 1.5 before, 2.2 after" in md
    assert "**WARNING: 1-minute load average 1.50 before, 2.25 after (above 1.5)" in md
    header["load_avg_1min"] = [0.4, 1.5]
    assert "WARNING" not in creport.render_markdown({"header": header, "results": res})


def test_load_warning():
    assert creport.load_warning(0.2, 1.5) is None and creport.load_warning(None, None) is None
    assert "load average 0.20 before, 1.60 after" in creport.load_warning(0.2, 1.6)
    assert "n/a after" in creport.load_warning(3.0, None)


def test_tensorboard_scalars_carry_their_descriptions(tmp_path):
    """Every scalar the report writes has its family's description in the event file (read with
    TensorBoard's own loader), and the values are the run's."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    res = _results(compute=100.0, horovod_ar=150.0, localsgd_slowmo=106.0)
    for r in res.values():
        r["per_window_ms"] = [r["median_ms"] - 1, r["median_ms"] + 1]
    res["sgp"] = {"available": False, "reason": "not built"}
    header = {"workload": "synthetic", "params_human": "1M", "rate": "1gbit"}
    creport.write_tensorboard(str(tmp_path), [{"header": header, "results": res}])
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["tensors"]
    scalars = [t for t in tags if not t.endswith("/header/text_summary")]
    families = {t.split("/")[2] for t in scalars}
    # speedup_vs_ar, over_compute (every row), ideal_ms, over_ideal (periodic rows only).
    assert families == set(creport.DESCRIPTIONS)
    assert all(len(text) > 40 for text in creport.DESCRIPTIONS.values())
    assert not any("/sgp" in t for t in tags)  # an unavailable row writes nothing
    for tag in scalars:
        family = tag.split("/")[2]
        assert acc.SummaryMetadata(tag).summary_description == creport.DESCRIPTIONS[family], tag
    window = acc.Tensors("synthetic_1M/1gbit/ms_per_iter_window/localsgd_slowmo")
    assert [(e.step, float(make_ndarray(e.tensor_proto))) for e in window] == [
        (0, 105.0),
        (1, 107.0),
    ]
    (speedup,) = acc.Tensors("synthetic_1M/1gbit/speedup_vs_ar/localsgd_slowmo")
    assert float(make_ndarray(speedup.tensor_proto)) == pytest.approx(150 / 106)


def _sweep_runs():
    runs = []
    for hosts, scale in ((2, 1.0), (4, 1.5), (8, 2.0)):
        header = {"workload": "synthetic", "params_human": "1M", "rate": "1gbit", "hosts": hosts}
        res = _results(compute=100.0, horovod_ar=120.0 * scale, allreduce=119.0 * scale)
        if hosts == 8:
            res["allreduce"] = {"available": False, "reason": "x"}
        runs.append({"header": dict(header, backward_fraction=0.5), "results": res})
    return runs


def test_sweep_table_and_plot(tmp_path):
    table = creport.sweep_table(_sweep_runs())
    assert list(table) == [("synthetic", "1M", "1gbit", 0.5)]
    per_algo = table[("synthetic", "1M", "1gbit", 0.5)]
    assert per_algo["horovod_ar"] == {2: 120.0, 4: 180.0, 8: 240.0}
    assert per_algo["allreduce"] == {2: 119.0, 4: 178.5}  # unavailable at 8 hosts: left out
    md = creport.sweep_markdown(_sweep_runs())
    assert "| algorithm | 2 hosts | 4 hosts | 8 hosts |" in md
    assert "| AR-SGD (hvd_slowmo base=allreduce) | 119 | 178 | n/a |" in md
    assert "50% of the compute in backward" in md
    (png,) = creport.plot_sweep(_sweep_runs(), str(tmp_path))
    assert png.endswith("sweep_synthetic_1M_1gbit_bw50.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_slow_factor_slows_the_last_host_only():
    spec = importlib.util.spec_from_file_location(
        "cluster_worker", os.path.join(ROOT, "benchmarks", "cluster_worker.py")
    )
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    workload = {"workload": "synthetic", "compute_ms": 100.0, "slow_factor": 2.0}
    assert [worker.host_compute_ms(workload, r, 4) for r in range(4)] == [100.0] * 3 + [200.0]
    assert worker.host_compute_ms({"compute_ms": 50}, 3, 4) == 50.0  # no factor: alike
    p = cluster._parser()
    _, workloads, _, _ = cluster._checked(p, p.parse_args(["--slow-factor", "2", "--hosts", "4"]))
    assert workloads[0]["slow_factor"] == 2.0
    _, workloads, _, _ = cluster._checked(p, p.parse_args([]))
    assert "slow_factor" not in workloads[0]  # specs of alike hosts unchanged
    with pytest.raises(SystemExit):
        cluster._checked(p, p.parse_args(["--slow-factor", "0.5"]))


def test_synthetic_backward_sleeps_between_layers(monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "cluster_worker", os.path.join(ROOT, "benchmarks", "cluster_worker.py")
    )
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    events = []
    monkeypatch.setattr(worker.time, "sleep", lambda s: events.append(("sleep", round(s, 6))))
    model = worker.Synthetic(800)
    assert [n for n, _ in model.named_parameters()] == [f"layers.{i}.weight" for i in range(8)]
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: events.append(("grad", i)))
    worker.synthetic_step(80.0, 0.5)(model)
    # 40 ms before backward, then 5 ms before each layer's gradient, last layer first.
    want = [("sleep", 0.04)]
    for i in reversed(range(8)):
        want += [("sleep", 0.005), ("grad", i)]
    assert events == want
    events.clear()
    worker.synthetic_step(80.0)(model)  # the default: all of it before a cheap backward
    assert events == [("sleep", 0.08)] + [("grad", i) for i in reversed(range(8))]


def test_render_markdown_peers():
    res = _results(
        compute=1000.0,
        horovod_ar=1600.0,
        torch_ddp=1500.0,
        torch_postlocal=1060.0,
        localsgd=1050.0,
        localsgd_slowmo=1080.0,
        localsgd_slowmo_overlap1=1020.0,
    )
    res["localsgd_slowmo_overlap2"] = {
        "available": False,
        "reason": "this hvd_slowmo has no overlap option: x",
    }
    header = {
        "workload": "synthetic",
        "params_human": "10M",
        "param_bytes": 40_000_000,
        "hosts": 4,
        "rate": "100mbit",
        "compute_ms": 1000.0,
        "cpu_cores": 2,
        "horovod": "0.28.1",
    }
    md = creport.render_markdown({"header": header, "results": res})
    lines = md.splitlines()
    peer = [line for line in lines if line.startswith(("| AR-SGD |", "| Local SGD (tau=12) |"))]
    # PyTorch's row first in each family, hvd_slowmo's beside it, in PEER_ROWS order.
    assert peer == [
        "| AR-SGD | AR-SGD (torch DistributedDataParallel, Gloo) | 1500 (1.07x) | 1.500x |  |",
        "| AR-SGD | AR-SGD (hvd.DistributedOptimizer) | 1600 (1.00x) | 1.600x |  |",
        "| Local SGD (tau=12) | Local SGD (torch PostLocalSGDOptimizer, Gloo) | 1060 (1.51x) | "
        "1.060x |  |",
        "| Local SGD (tau=12) | Local SGD | 1050 (1.52x) | 1.050x |  |",
        "| Local SGD (tau=12) | Local SGD + SlowMo | 1080 (1.48x) | 1.080x |  |",
        "| Local SGD (tau=12) | Local SGD + SlowMo, overlap=1 | 1020 (1.57x) | 1.020x | 75% |",
        "| Local SGD (tau=12) | Local SGD + SlowMo, overlap=2 | not available | | |",
    ]
    assert (
        "- hvd_slowmo Local SGD vs torch's post-local SGD (tau=12): -0.9% (target: <= 0%)."
    ) in lines
    overlap1 = [line for line in lines if line.startswith("- Local SGD + SlowMo, overlap=1: ")]
    assert len(overlap1) == 1
    assert "+2.0% over compute only" in overlap1[0] and "hides 75%" in overlap1[0]
    assert "-3.8% vs the fastest peer row (Local SGD (torch PostLocalSGDOptimizer" in overlap1[0]
    assert (
        "- Local SGD + SlowMo, overlap=2: not available (the reason is in its row above)." in lines
    )
    assert (
        "| Local SGD + SlowMo, overlap=2 | 12 | not available (this hvd_slowmo has no overlap "
        "option: x) | | | | | |" in lines
    )
    # No peer row measured: no peers table, no peer bullets.
    md = creport.render_markdown(
        {"header": header, "results": _results(compute=1000.0, sgp=1100.0)}
    )
    assert "Beside the peers" not in md and "post-local" not in md


def _cluster_skip_reason():
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()}"
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        return f"horovod.torch not importable ({e})"
    return None


def test_needs_root_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert cluster.main(["--hosts", "2", "--out", str(tmp_path)]) != 0
    assert "needs root" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.horovod
@pytest.mark.timeout(240)
def test_end_to_end_two_hosts(tmp_path):
    reason = _cluster_skip_reason()
    if reason:
        print(f"skipping the emulated-cluster run: {reason}")
        pytest.skip(reason)
    prefix = "hsmt"
    # A namespace left by a "crashed" earlier run with this prefix: the harness must remove it.
    subprocess.run(["ip", "netns", "add", f"{prefix}-h7"], check=True)
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "cluster.py"),
        "--hosts",
        "2",
        "--rate",
        "100mbit",
        "--workload",
        "synthetic",
        "--params",
        "100k",
        "--compute-ms",
        "5",
        "--iters",
        "4",
        "--windows",
        "2",
        "--algorithms",
        "compute,horovod_ar,torch_ddp,allreduce,torch_postlocal,localsgd_slowmo,"
        "localsgd_slowmo_overlap1,localsgd_slowmo_stream4,localsgd_slowmo_td",
        "--prefix",
        prefix,
        "--subnet",
        "10.78.0",
        "--repeats",
        "2",
        "--timeout",
        "150",
        "--out",
        str(tmp_path),
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT)
    finally:
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert cluster.stale_namespaces(left, prefix) == [], f"namespaces left behind: {left}"
        assert not os.path.exists(f"/etc/netns/{prefix}-h0")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())
    assert len(runs) == 1
    res = runs[0]["results"]
    assert set(res) == {
        "compute",
        "horovod_ar",
        "torch_ddp",
        "allreduce",
        "torch_postlocal",
        "localsgd_slowmo",
        "localsgd_slowmo_overlap1",
        "localsgd_slowmo_stream4",
        "localsgd_slowmo_td",
    }
    # The overlapped row runs exactly when the library has the option; otherwise it says why not.
    import inspect

    import hvd_slowmo

    has_overlap = "overlap" in inspect.signature(hvd_slowmo.DistributedOptimizer).parameters
    overlap = res.pop("localsgd_slowmo_overlap1")
    assert overlap.get("available", True) == has_overlap, overlap
    if not has_overlap:
        assert "overlap" in overlap["reason"]
    # Two repeats of: 2 windows of one outer period (tau=12), and 4 single-iteration windows at
    # tau=1.
    assert res["localsgd_slowmo"]["iterations"] == 48 and res["localsgd_slowmo"]["windows"] == 4
    assert res["torch_postlocal"]["iterations"] == 48 and res["torch_postlocal"]["windows"] == 4
    assert res["horovod_ar"]["iterations"] == 8 and len(res["horovod_ar"]["repeat_median_ms"]) == 2
    assert res["torch_ddp"]["iterations"] == 8
    assert all(r_["median_ms"] > 0 for r_ in res.values())
    # The sleep is a floor for every algorithm's iteration time.
    assert res["compute"]["median_ms"] >= 5.0
    # hvd_slowmo counted its allreduce bytes: ring volume of 100k fp32 over 2 workers, every step.
    assert res["allreduce"]["bytes_per_iter"] == pytest.approx(400_000, rel=0.01)
    assert res["localsgd_slowmo"]["bytes_per_iter"] == pytest.approx(400_000 / 12, rel=0.01)
    assert res["horovod_ar"]["bytes_computed"] is True
    # The PyTorch peers' Gloo volume is computed: every step (DDP), every 12 steps (post-local SGD).
    assert res["torch_ddp"]["bytes_per_iter"] == 400_000
    assert res["torch_ddp"]["bytes_computed"] is True
    assert res["torch_postlocal"]["bytes_per_iter"] == pytest.approx(400_000 / 12)
    # The most bytes started in one step: the whole model at once, except streaming (a quarter:
    # 8 equal layers in 4 fragments).
    for key in ("allreduce", "localsgd_slowmo", "torch_postlocal", "torch_ddp"):
        assert res[key]["peak_bytes_per_step"] == pytest.approx(400_000, rel=0.01), key
    stream = res["localsgd_slowmo_stream4"]
    assert stream["peak_bytes_per_step"] == pytest.approx(100_000, rel=0.01), stream
    assert stream["bytes_per_iter"] == pytest.approx(400_000 / 12, rel=0.01)
    # Per outer step, the flushed averages of whole periods: the same with and without streaming.
    for key in ("localsgd_slowmo", "localsgd_slowmo_stream4"):
        assert res[key]["bytes_per_outer_step"] == pytest.approx(400_000, rel=0.01), key
    # hvd_slowmo over torch.distributed counts its own bytes, as over Horovod.
    assert res["localsgd_slowmo_td"]["bytes_per_iter"] == pytest.approx(400_000 / 12, rel=0.01)
    table = (tmp_path / "table.md").read_text()
    assert "| Local SGD |" in table
    assert "| Local SGD (tau=12) | Local SGD (torch PostLocalSGDOptimizer, Gloo) |" in table
    assert os.listdir(tmp_path / "tensorboard")


@pytest.mark.horovod
@pytest.mark.timeout(180)
def test_sigterm_tears_down(tmp_path):
    reason = _cluster_skip_reason()
    if reason:
        print(f"skipping the emulated-cluster run: {reason}")
        pytest.skip(reason)
    prefix = "hsms"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "cluster.py"),
        "--hosts",
        "2",
        "--params",
        "10k",
        "--compute-ms",
        "50",
        "--iters",
        "100000",
        "--algorithms",
        "compute",
        "--prefix",
        prefix,
        "--subnet",
        "10.78.1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    try:
        # Wait until the workers run inside the namespaces, then interrupt.
        deadline = time.monotonic() + 90
        while True:
            listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            workers = subprocess.run(
                ["pgrep", "-f", f"cluster_worker.py.*{tmp_path}"], capture_output=True, text=True
            )
            if (
                len(cluster.stale_namespaces(listing, prefix)) == 3
                and len(workers.stdout.split()) == 2
            ):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the emulated cluster did not come up within 90 s")
            time.sleep(0.5)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "tearing the cluster down" in out
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cluster.stale_namespaces(listing, prefix) == [], listing
    assert not os.path.exists(f"/etc/netns/{prefix}-h0")
    workers = subprocess.run(
        ["pgrep", "-f", f"cluster_worker.py.*{tmp_path}"], capture_output=True, text=True
    )
    assert workers.stdout.split() == [], "worker processes survived the teardown"


def test_pause_stops_the_last_host_once_at_the_given_iteration():
    spec = importlib.util.spec_from_file_location(
        "cluster_worker", os.path.join(ROOT, "benchmarks", "cluster_worker.py")
    )
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    workload = {"workload": "synthetic", "compute_ms": 100.0, "pause_at": 12, "pause_ms": 3600.0}
    assert [worker.host_pause(workload, r, 4) for r in range(4)] == [(-1, 0.0)] * 3 + [(12, 3.6)]
    assert worker.host_pause({"compute_ms": 100.0}, 3, 4) == (-1, 0.0)  # no pause: alike
    p = cluster._parser()
    argv = ["--pause-ms", "3600", "--pause-at", "12", "--iters", "48"]
    _, workloads, _, _ = cluster._checked(p, p.parse_args(argv))
    assert (workloads[0]["pause_at"], workloads[0]["pause_ms"]) == (12, 3600.0)
    _, workloads, _, _ = cluster._checked(p, p.parse_args([]))
    assert "pause_ms" not in workloads[0] and "pause_at" not in workloads[0]
    late = ["--pause-ms", "10", "--pause-at", "48"]  # past --iters 48
    for bad in (["--pause-ms", "-1"], ["--pause-ms", "inf"], late):
        with pytest.raises(SystemExit):
            cluster._checked(p, p.parse_args(bad))
