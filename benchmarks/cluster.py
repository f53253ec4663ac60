"""Time per iteration of SlowMo and its bases on an emulated multi-host cluster (arXiv 1910.00643).

Builds N emulated hosts on this machine (one network namespace each, a veth to a Linux bridge in a
switch namespace, every link limited with ``tc tbf`` in both directions), runs one Horovod (Gloo)
worker per host, and measures in the same processes: compute only (the limit), Horovod's own
``hvd.DistributedOptimizer`` (AR-SGD), the peers PyTorch ships (DDP's AR-SGD and post-local SGD,
over ``torch.distributed`` with Gloo), and hvd_slowmo's algorithms. Prints a table shaped like the
paper's Table 2 (original vs with SlowMo), one of the peers beside hvd_slowmo's rows, writes the
raw numbers as JSON and TensorBoard scalars.

Needs root and ``ip netns``. Example (4 hosts, 1 Gbit/s links, synthetic 1M-parameter model)::

    sudo .venv/bin/python benchmarks/cluster.py --hosts 4 --rate 1gbit --workload synthetic \\
        --params 1M --compute-ms 190 --iters 24 --windows 2 --repeats 2 --nice -10 \\
        --out runs/cluster

(``--compute-ms`` sets the regime: there AR-SGD spends about a third of its time communicating.)
The peers against hvd_slowmo, 10M parameters and 1 s of compute, at 1 Gbit/s and 100 Mbit/s::

    sudo .venv/bin/python benchmarks/cluster.py --hosts 4 --rate 1gbit --rate 100mbit \\
        --params 10M --compute-ms 1000 --iters 12 --windows 2 --algorithms peers

``--slow-factor 2`` makes the last host's synthetic compute twice as long (an unequal host: every
count-based row then runs at its pace; time-based periods are measured by
``benchmarks/goodput.py``). ``--pause-ms 3600 --pause-at 12`` stops the last host once for 3.6 s
before the 13th timed iteration of every row (3 outer periods of 12 steps at 100 ms: a stalled
host); the row's median hides a pause, its mean and max windows show it.

The namespaces, links and ``/etc/netns`` files are removed afterwards, also on Ctrl-C / SIGTERM,
and stale ones from a crashed run with the same ``--prefix`` are removed before starting.
Only ratios measured within one run mean anything: all hosts share this machine's CPU cores.
"""

import argparse
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the cluster_* modules beside it
# The repository's package, also when run as a script from a fresh clone.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster_algorithms import ALGORITHM_SETS, ALGORITHMS, select_algorithms
from cluster_report import (
    human,
    load_warning,
    plot_sweep,
    render_markdown,
    sweep_markdown,
    write_tensorboard,
)
from cluster_stats import summarize

# The emulated hosts (namespaces, links, shaping, the workers' launch) live in the library.
from slowmo_lab.netns import (
    Cluster,
    ClusterPlan,
    Host,
    hosts_file,
    parse_rate,
    plan_cluster,
    setup_commands,
    shaping_commands,
    stale_namespaces,
    tbf_args,
    teardown_commands,
    worker_env,
)

__all__ = [
    "Host",
    "ClusterPlan",
    "parse_rate",
    "parse_count",
    "tbf_args",
    "plan_cluster",
    "setup_commands",
    "shaping_commands",
    "teardown_commands",
    "stale_namespaces",
    "hosts_file",
    "worker_env",
    "main",
]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_worker.py")


# --- parsing --------------------------------------------------------------------------------------
def parse_count(text: str) -> int:
    """Parameter count from ``"10M"``, ``"1.5M"``, ``"500k"`` or ``"123456"``.

    Args:
        text: the count, with an optional ``k``/``M``/``G`` suffix.
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", str(text).strip())
    if not m:
        raise ValueError(f"--params entries must look like 1M, 10M, 500k or 123456, got {text!r}")
    value = int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()])
    if value < 1:
        raise ValueError(f"--params entries must be at least 1 parameter, got {text!r}")
    return value


# --- running it (root only) -----------------------------------------------------------------------
def _terminate(signum: int, frame: Any) -> None:
    # Turn SIGTERM/SIGHUP into an exception so the finally-block teardown runs.
    print(f"signal {signum}: tearing the cluster down", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _launch(cluster: Cluster, worker_args: list[str], timeout_s: float, nice: int) -> None:
    cluster.run([sys.executable, WORKER, *worker_args], timeout_s, nice)


def _measure(
    cluster: Cluster,
    args: argparse.Namespace,
    rates: list[str],
    workloads: list[dict[str, Any]],
    algos: list[str],
    command: list[str],
) -> list[dict[str, Any]]:
    """Build ``cluster`` and measure every workload at every rate on it (the caller tears it
    down).

    Args:
        cluster: the emulated cluster (not built yet).
        args: the parsed command line.
        rates: the link rates.
        workloads: the workload specs.
        algos: the algorithm keys.
        command: the command line, for the report.
    """
    hosts = len(cluster.plan.hosts)
    stale = cluster.clean_stale()
    if stale:
        print(f"removed leftovers of an earlier run: {stale}", flush=True)
    cluster.build(rates[0])
    runs = []
    for rate in rates:
        cluster.shape(rate)
        for wl in workloads:
            back = f"_bw{100 * wl.get('backward_fraction', 0):.0f}"
            raw = os.path.join(
                args.out, f"raw_{wl['workload']}_{wl.get('params', 0)}_{rate}{back}_h{hosts}.json"
            )
            spec = {
                **wl,
                "algorithms": algos,
                "iters": args.iters,
                "windows": args.windows,
                "repeats": args.repeats,
                "batch_size": args.batch_size,
                "output": os.path.abspath(raw),
            }
            size = f" {human(wl['params'])}" if "params" in wl else ""
            # Other work on the machine stretches and scatters the times: say how much there was.
            load_before = os.getloadavg()[0]
            print(
                f"== {wl['workload']}{size} at {rate}: {len(algos)} algorithms on {hosts} hosts "
                f"(1-minute load average {load_before:.2f})",
                flush=True,
            )
            if warning := load_warning(load_before, None):
                print(f"!!! {warning}", flush=True)
            _launch(cluster, ["--spec", json.dumps(spec)], args.timeout, args.nice)
            load_after = os.getloadavg()[0]
            print(f"   1-minute load average after: {load_after:.2f}", flush=True)
            if warning := load_warning(load_before, load_after):
                print(f"!!! {warning}", flush=True)
            with open(raw) as f:
                measured = json.load(f)
            header = {
                **measured["header"],
                "hosts": hosts,
                "rate": rate,
                "rate_bits_per_s": parse_rate(rate),
                "tbf": " ".join(tbf_args(rate)),
                "cpu_cores": os.cpu_count(),
                "nice": args.nice,
                "load_avg_1min": [load_before, load_after],
                "command": " ".join(command),
            }
            header["params_human"] = human(header["params"])
            run = {"header": header, "results": measured["results"]}
            run["summary"] = summarize(
                {k: v for k, v in run["results"].items() if v.get("available", True)}
            )
            runs.append(run)
            print(render_markdown(run), flush=True)
    return runs


def _parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--hosts",
        default="4",
        help="emulated hosts, one Horovod worker each; several (2,4,8) sweep them: the same rows "
        "at each count, plotted as ms/iteration vs workers (sweep_*.png, sweep.md)",
    )
    p.add_argument(
        "--rate", action="append", help="link rate, tc syntax (repeatable): 1gbit, 100mbit"
    )
    p.add_argument(
        "--workload", choices=["synthetic", "resnet18", "transformer"], default="synthetic"
    )
    p.add_argument(
        "--params", default="10M", help="synthetic model sizes, comma separated: 1M,10M,50M"
    )
    p.add_argument(
        "--compute-ms",
        default="100",
        help="synthetic compute per iteration (sleep), one value or one per --params entry",
    )
    p.add_argument(
        "--backward-fraction",
        type=float,
        default=0.0,
        help="share of the synthetic compute slept inside the backward pass, between layers, so "
        "gradient-ready hooks fire while it goes on (0: all before a cheap backward)",
    )
    p.add_argument(
        "--slow-factor",
        type=float,
        default=1.0,
        help="the last host's synthetic compute is this many times longer (an unequal host: a "
        "slower GPU, a throttled node); 1: every host alike",
    )
    p.add_argument(
        "--pause-ms",
        type=float,
        default=0.0,
        help="the last host stops this long once (a stalled host), before the timed iteration "
        "--pause-at of every row; 0: no pause",
    )
    p.add_argument(
        "--pause-at",
        type=int,
        default=12,
        help="with --pause-ms: the timed iteration (from 0) before which the last host pauses",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=48,
        help="timed iterations per algorithm (raised to at least --windows outer periods)",
    )
    p.add_argument(
        "--windows", type=int, default=3, help="minimum timed outer periods per algorithm"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the whole list this often, in alternating order (cancels slow drift)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="batch size of the resnet18/transformer workloads"
    )
    p.add_argument(
        "--algorithms",
        default="all",
        help="comma-separated keys or sets, measured in the order listed here; sets: "
        + ", ".join(ALGORITHM_SETS)
        + "; keys: "
        + ", ".join(a.key for a in ALGORITHMS),
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling priority of the workers (-20..19); negative keeps other load on a shared "
        "machine from queueing their short CPU bursts",
    )
    p.add_argument("--prefix", default="hsmc", help="prefix of every namespace and link created")
    p.add_argument("--subnet", default="10.77.0", help="a free /24 for the emulated hosts")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds before the workers are killed"
    )
    p.add_argument(
        "--out", default="runs/cluster", help="output folder: results.json, table.md, tensorboard/"
    )
    return p


def _check_unequal_host(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The slowed and paused host's flags (``p.error`` names the bad one)."""
    if not args.slow_factor >= 1.0:
        p.error(f"--slow-factor must be >= 1, got {args.slow_factor}")
    if not 0.0 <= args.pause_ms < float("inf"):
        p.error(f"--pause-ms must be a finite number >= 0, got {args.pause_ms}")
    if args.pause_ms and not 0 <= args.pause_at < args.iters:
        p.error(f"--pause-at must be a timed iteration in [0, --iters), got {args.pause_at}")


def _checked(
    p: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], list[dict[str, Any]], list[Any], list[Any]]:
    """Check the arguments (``p.error`` on a bad one); returns the rates, the workloads, the
    algorithms and one cluster plan per host count."""
    rates = args.rate or ["1gbit"]
    for r in rates:
        parse_rate(r)
    sizes = [parse_count(s) for s in args.params.split(",")]
    compute = [float(c) for c in args.compute_ms.split(",")]
    if len(compute) not in (1, len(sizes)):
        p.error(
            f"--compute-ms needs one value or one per --params entry ({len(sizes)}), "
            f"got {len(compute)}"
        )
    if any(c < 0 for c in compute):
        p.error("--compute-ms must be >= 0")
    compute = compute * len(sizes) if len(compute) == 1 else compute
    try:
        algos = select_algorithms(args.algorithms)
    except ValueError as e:
        p.error(str(e))
    if not -20 <= args.nice <= 19:
        p.error(f"--nice must be in [-20, 19], got {args.nice}")
    if args.iters < 1 or args.windows < 1 or args.repeats < 1:
        p.error("--iters, --windows and --repeats must be >= 1")
    _check_unequal_host(p, args)
    if not 0.0 <= args.backward_fraction < 1.0:
        p.error(f"--backward-fraction must be in [0, 1), got {args.backward_fraction}")
    try:
        host_counts = [int(n) for n in args.hosts.split(",")]
        plans = [plan_cluster(n, args.prefix, args.subnet) for n in host_counts]
    except ValueError as e:
        p.error(f"--hosts: {e}")
    workloads = (
        [
            {"workload": "synthetic", "params": n, "compute_ms": c}
            | {"backward_fraction": args.backward_fraction}
            | ({"slow_factor": args.slow_factor} if args.slow_factor != 1.0 else {})
            | ({"pause_at": args.pause_at, "pause_ms": args.pause_ms} if args.pause_ms else {})
            for n, c in zip(sizes, compute)
        ]
        if args.workload == "synthetic"
        else [{"workload": args.workload, "compute_ms": None}]
    )
    return rates, workloads, algos, plans


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, build the cluster, measure, report, tear down.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
    """
    p = _parser()
    args = p.parse_args(argv)
    command = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)]
    rates, workloads, algos, plans = _checked(p, args)
    if os.geteuid() != 0:
        print(
            "cluster.py needs root (network namespaces and tc); rerun with sudo.", file=sys.stderr
        )
        return 2
    if shutil.which("ip") is None or shutil.which("tc") is None:
        print("cluster.py needs the `ip` and `tc` tools (iproute2).", file=sys.stderr)
        return 2

    os.makedirs(args.out, exist_ok=True)
    old_handlers = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    runs: list[dict[str, Any]] = []
    try:
        for plan in plans:
            cluster = Cluster(plan)
            try:
                runs += _measure(cluster, args, rates, workloads, algos, command)
            finally:
                cluster.teardown()
    except KeyboardInterrupt:
        print("interrupted: tearing the cluster down", file=sys.stderr)
        return 130
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(runs, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(render_markdown(r) for r in runs))
    write_tensorboard(os.path.join(args.out, "tensorboard"), runs)
    wrote = "results.json, table.md, tensorboard/"
    if len(plans) > 1:
        with open(os.path.join(args.out, "sweep.md"), "w") as f:
            f.write(sweep_markdown(runs))
        print(sweep_markdown(runs), flush=True)
        pngs = plot_sweep(runs, args.out)
        wrote += ", sweep.md, " + ", ".join(os.path.basename(p) for p in pngs)
    print(f"wrote {args.out}/: {wrote}", flush=True)
    warnings = [w for r in runs if (w := load_warning(*r["header"]["load_avg_1min"]))]
    if warnings:
        print(
            f"\n!!! {len(warnings)} of {len(runs)} runs on a busy machine: {warnings[0]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
