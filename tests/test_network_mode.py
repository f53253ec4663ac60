"""The main job's network mode (examples/compare.py --network) and the emulated hosts it runs
on (slowmo_lab.netns): argument checks and refusals in-process; one short end-to-end run
on two emulated hosts in the horovod tier (root and `ip netns` needed)."""

import os
import re
import subprocess
import sys

import pytest

from slowmo_lab import netns, report
from slowmo_lab.metrics import TAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import compare  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def test_parse_network():
    assert netns.parse_network("100mbit") == ("100mbit", 0.0)
    assert netns.parse_network("100Mbit,20ms") == ("100mbit", 20.0)
    assert netns.parse_network("1gbit, 0.5ms") == ("1gbit", 0.5)
    for bad, match in (
        ("100mbps", "--network: the rate"),
        ("100mbit,20", "milliseconds"),
        ("100mbit,20ms,1", "RATE or RATE,DELAY"),
        ("", "RATE or RATE,DELAY"),
    ):
        with pytest.raises(ValueError, match=match):
            netns.parse_network(bad)


def test_shaping_with_a_delay_puts_tbf_under_netem():
    plan = netns.plan_cluster(2, prefix="t")
    plain = [" ".join(c) for c in netns.shaping_commands(plan, "100mbit")]
    assert len(plain) == 4 and all(" root tbf rate 100mbit " in c for c in plain)
    cmds = [" ".join(c) for c in netns.shaping_commands(plan, "100mbit", delay_ms=20.0)]
    # Both links a packet crosses (sender's eth0, receiver's switch port) hold half the delay.
    assert cmds[:2] == [
        "ip netns exec t-h0 tc qdisc replace dev eth0 root handle 1: netem delay 10ms",
        "ip netns exec t-h0 tc qdisc replace dev eth0 parent 1:1 handle 10: tbf rate 100mbit "
        "burst 131072 latency 50ms",
    ]
    assert cmds[2].startswith("ip netns exec t-sw tc qdisc replace dev tp0 root handle 1: netem")
    assert len(cmds) == 8
    with pytest.raises(ValueError, match="delay_ms"):
        netns.shaping_commands(plan, "100mbit", delay_ms=-1.0)


def test_method_names_with_overlap():
    assert compare.parse_method("localsgd-slowmo-overlap1") == ("localsgd", True, 1)
    assert compare.parse_method("sgp-slowmo") == ("sgp", True, None)
    assert compare.settings_key("localsgd-slowmo-overlap2") == "localsgd-slowmo"
    with pytest.raises(ValueError, match="-overlapD is an option of SlowMo"):
        compare.parse_method("localsgd-overlap1")
    args = compare.argparse.Namespace(overlap=0, fragments=1, eager=None)
    flags = compare.run_args("localsgd-slowmo-overlap1", {"lr": 0.1, "slow_momentum": 0.5}, 3, args)
    assert flags[flags.index("--overlap") + 1] == "1"
    assert flags[flags.index("--run-name") + 1] == "localsgd-slowmo-overlap1/seed3"
    for method in compare.NETWORK_ALGOS.split(","):
        assert compare.settings_key(method) in compare.mnist1d_cnn.TUNED


def test_network_mode_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert compare.main(["--network", "100mbit"]) == 2
    err = capsys.readouterr().err
    assert "network namespaces" in err and "needs root" in err


def test_network_mode_refuses_a_delay_without_netem(monkeypatch, capsys):
    monkeypatch.setattr(compare, "missing_requirements", lambda: None)
    monkeypatch.setattr(
        compare, "netem_available", lambda prefix: (False, "Specified qdisc kind is unknown.")
    )
    assert compare.main(["--network", "100mbit,20ms"]) == 2
    err = capsys.readouterr().err
    assert "netem" in err and "use --network 100mbit" in err
    assert compare.main(["--network", "100mbit", "--np", "1"]) == 2
    assert "--np >= 2" in capsys.readouterr().err


def _skip_reason():
    reason = netns.missing_requirements()
    if reason:
        return reason
    try:
        import horovod.torch  # noqa: F401
        import mnist1d  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not importable"
    return None


def _network_run(flags: list[str], prefix: str, subnet: str) -> str:
    """Run compare.py --network 100mbit --quick on two emulated hosts with ``flags``; check that
    it exits with 0 and leaves no namespace behind; return its output."""
    reason = _skip_reason()
    if reason:
        pytest.skip(f"no emulated cluster here: {reason}")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "compare.py"), *flags]
    cmd += ["--network", "100mbit", "--quick", "--np", "2", "--epochs", "2"]
    cmd += ["--netns-prefix", prefix, "--netns-subnet", subnet, "--no-progress"]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=360
        )
    finally:
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert netns.stale_namespaces(left, prefix) == [], f"namespaces left behind: {left}"
        assert not os.path.exists(f"/etc/netns/{prefix}-h0")
    assert proc.returncode == 0, proc.stdout[-5000:]
    return proc.stdout


@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_network_quick_run_on_two_hosts(tmp_path):
    """--network --quick, tiny: two methods on two emulated hosts run end to end, print the
    time-to-accuracy table, log the training clock, and leave no namespace behind."""
    flags = ["--max-steps", "12", "--algos", "allreduce,localsgd-slowmo-overlap1"]
    out = _network_run(flags + ["--logdir", str(tmp_path)], "hsmq", "10.78.2")
    assert "2 runs (2 methods x 1 seeds), 2 workers, 2 epochs, tau 12, 2 emulated hosts" in out
    table = out[out.index("Time to accuracy") : out.index("Table 1")]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[3:] if line.strip()}
    assert set(rows) == {"allreduce", "localsgd-slowmo-overlap1"}
    for cells in rows.values():
        assert cells[1] == "1" and 0 <= float(cells[2]) <= 100
    assert re.search(r"s to 85%\s+s to 90%", table)
    logdir = tmp_path / "mnist1d-network-100mbit"
    runs = report.load_runs([str(logdir)])
    assert sorted(r.name for r in runs) == [
        os.path.join("allreduce", "seed0"),
        os.path.join("localsgd-slowmo-overlap1", "seed0"),
    ]
    for run in runs:
        clock = run.scalars[TAGS["train_s"]]
        assert [s for s, _ in clock] == [0, 12, 24] and 0 == clock[0][1] < clock[1][1] < clock[2][1]
        # The table's total is the logged clock at the last evaluation. On a fast machine twelve
        # steps take under 0.05 s, so the one-decimal cell may read 0.0: compare, don't require > 0.
        # (TensorBoard keeps float32: within the cell's rounding, not its exact digits.)
        assert float(rows[os.path.dirname(run.name)][3]) == pytest.approx(clock[-1][1], abs=0.051)
    assert os.path.getsize(logdir / "compare.png") > 0


@pytest.mark.horovod
@pytest.mark.timeout(400)
def test_network_language_model_at_equal_seconds(tmp_path):
    """--task char_lm --network, tiny: the three language-model methods on two emulated hosts,
    the validation loss at equal training seconds and the seconds to each final loss."""
    flags = ["--task", "char_lm", "--tau", "4", "--max-steps", "8", "--logdir", str(tmp_path)]
    out = _network_run(flags, "hsml", "10.78.3")
    assert "3 runs (3 methods x 1 seeds), 2 workers, 2 epochs, tau 4, 2 emulated hosts" in out
    table = out[out.index("Equal training seconds") : out.index("Table 1")].splitlines()
    head = table[1]
    budget = float(re.search(r"loss at ([\d.]+) s", head).group(1))
    rows = {line.split()[0]: line.split() for line in table[3:] if line.strip()}
    assert set(rows) == {"allreduce", "localsgd", "localsgd-slowmo"}
    for cells in rows.values():
        # seeds, a final loss below a uniform byte's ln(256) = 5.55, and at least the budget
        assert cells[1] == "1" and 0 < float(cells[2]) < 5.55 and float(cells[3]) >= budget
    # The budget is the shortest run's training time: that run is read at its last evaluation.
    # Two runs can print the same rounded seconds, so the shortest is one of those at the budget.
    at_budget = [c for c in rows.values() if float(c[3]) == pytest.approx(budget, abs=0.05)]
    assert at_budget and any(c[4] == c[2] for c in at_budget)
    assert os.path.getsize(tmp_path / "char_lm-network-100mbit" / "compare.png") > 0
