"""The paper's tuning and ablations as a sweep (arXiv 1910.00643, Sec. 6 and Appendices B-C):
runs one after another under ``horovodrun``, then prints the report's tables for them and the
best setting per algorithm: the best mean over seeds among the settings where no seed fails
(:func:`slowmo_lab.report.seed_failures`: a seed that diverges, falls back from its best,
or ends far below its siblings rejects its setting).

    python -m slowmo_lab.sweep examples/digits.py --ablation tau \\
        --np 4    # tau in {12, 24, 48, 96}
    python -m slowmo_lab.sweep examples/digits.py --ablation alpha-beta \\
        --dry-run    # commands only
    python -m slowmo_lab.sweep examples/mnist1d_cnn.py --ablation lr --algo sgp \\
        --seeds 100,101 --one-launch -- --validation  # the base lr from the paper's grid, SGP alone
    python -m slowmo_lab.sweep examples/mnist1d_cnn.py --ablation beta --algo sgp --lrs 0.1 \\
        --seeds 100,101 --one-launch -- --validation   # then beta in {0.4, ..., 0.8} at that lr
    python -m slowmo_lab.sweep examples/cifar10_resnet18.py --algo sgp --taus 12,48 \\
        --slow-momentums 0.5,0.7 --baseline -- --data data --epochs 50   # after "--": every run

The paper's protocol for a fair comparison (its Appendix B): tune the base learning rate per
base algorithm from a grid (``--ablation lr``: the base alone, buffers kept); SlowMo then keeps
that learning rate, fixes alpha = 1 and tau, and tunes beta (``--ablation beta``).

The training script must accept the examples' flags (--algo, --slowmo/--no-slowmo, --tau,
--slow-lr, --slow-momentum, --buffers, --lr, --seed, --run-name, --logdir, --no-progress, and
--plan for ``--one-launch``). Each run logs to LOGDIR/<setting>/seed<k>/, named by its
settings, so TensorBoard overlays them and the report averages the seeds of a setting.
"""

import argparse
import itertools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from hvd_slowmo import BASES

__all__ = [
    "ABLATIONS",
    "LAUNCHERS",
    "horovodrun_command",
    "launch_command",
    "resolve_launcher",
    "require_resolvable_hostname",
    "sweep_points",
    "point_args",
    "sweep_commands",
    "main",
]

#: The paper's grids: the base lr (its CIFAR-10 grid, Appendix B; the base alone), beta at
#: alpha = 1 (Sec. 5: "typically ranges from 0.4 to 0.8"), tau (Fig. 3), alpha x beta
#: (Appendix C.2), base-buffer strategy (Tables C.3/C.4). ``lrs`` empty: the script's own --lr.
ABLATIONS: dict[str, dict[str, Any]] = {
    "lr": {
        "slowmo": False,
        "lrs": ["0.01", "0.025", "0.05", "0.1", "0.15"],
        "taus": ["12"],
        "slow_lrs": ["1"],
        "slow_momentums": ["0"],
        "buffers": ["maintain"],
    },
    "beta": {
        "slowmo": True,
        "lrs": [],
        "taus": ["12"],
        "slow_lrs": ["1"],
        "slow_momentums": ["0.4", "0.5", "0.6", "0.7", "0.8"],
        "buffers": ["reset"],
    },
    "tau": {
        "slowmo": True,
        "lrs": [],
        "taus": ["12", "24", "48", "96"],
        "slow_lrs": ["1"],
        "slow_momentums": ["0.7"],
        "buffers": ["reset"],
    },
    "alpha-beta": {
        "slowmo": True,
        "lrs": [],
        "taus": ["12"],
        "slow_lrs": ["0.5", "1"],
        "slow_momentums": ["0.4", "0.5", "0.6", "0.7", "0.8"],
        "buffers": ["reset"],
    },
    "buffers": {
        "slowmo": True,
        "lrs": [],
        "taus": ["12"],
        "slow_lrs": ["1"],
        "slow_momentums": ["0.7"],
        "buffers": ["reset", "maintain", "average"],
    },
}


def require_resolvable_hostname(name: str | None = None) -> None:
    """Raise unless the host name ``name`` resolves to an address.

    Horovod's Gloo looks up this machine's name and, when it does not resolve, crashes (a
    segfault in Gloo's device.cc) instead of saying so: check before a Gloo launch.

    Args:
        name: the host name to look up (default: this machine's, as ``hostname`` prints it).
    """
    name = socket.gethostname() if name is None else name
    try:
        socket.getaddrinfo(name, None)
    except OSError as err:
        raise RuntimeError(
            f"the host name {name!r} does not resolve ({err.strerror}), so horovodrun --gloo "
            f"would crash: name it in /etc/hosts, as root: echo '127.0.1.1 {name}' >> /etc/hosts"
        ) from None


def horovodrun_command(np_: int, launcher: str = "gloo", required: bool = True) -> list[str]:
    """The ``horovodrun`` prefix for ``np_`` local processes.

    Args:
        np_: number of processes (>= 1).
        launcher: ``"gloo"`` or ``"mpi"`` (OpenMPI as root needs --allow-run-as-root).
        required: raise if horovodrun is not installed or, for Gloo, the host name does not
            resolve (False: name it anyway, for printing).
    """
    if isinstance(np_, bool) or not isinstance(np_, int) or np_ < 1:
        raise ValueError(f"np must be an integer >= 1, got {np_!r}")
    if launcher not in ("gloo", "mpi"):
        raise ValueError(f"launcher must be 'gloo' or 'mpi', got {launcher!r}")
    if launcher == "gloo" and required:
        require_resolvable_hostname()
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        exe = shutil.which("horovodrun") or ""
    if not exe:
        if required:
            raise RuntimeError(
                "horovodrun not found: build Horovod with scripts/install_horovod.sh"
            )
        exe = "horovodrun"
    cmd = [exe, "-np", str(np_), "-H", f"localhost:{np_}"]
    if launcher == "gloo":
        return cmd + ["--gloo"]
    return cmd + ["--mpi", "--mpi-args=--oversubscribe --allow-run-as-root"]


#: Values of ``--launcher``: horovodrun over Gloo or MPI, torchrun (torch.distributed), or
#: ``"auto"``: horovodrun --gloo where Horovod is installed, else torchrun.
LAUNCHERS = ("auto", "gloo", "mpi", "torchrun")


def resolve_launcher(launcher: str) -> str:
    """``launcher``, with ``"auto"`` resolved: ``"gloo"`` (horovodrun) where horovodrun is
    installed, else ``"torchrun"``.

    Args:
        launcher: one of :data:`LAUNCHERS`.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if launcher != "auto":
        return launcher
    found = os.path.exists(os.path.join(os.path.dirname(sys.executable), "horovodrun"))
    return "gloo" if found or shutil.which("horovodrun") else "torchrun"


def launch_command(np_: int, launcher: str = "auto", required: bool = True) -> list[str]:
    """The launcher prefix for ``np_`` local processes, followed by the python command to run
    (``horovodrun ... --gloo`` or ``torchrun --standalone --nproc-per-node NP --no-python``).

    Args:
        np_: number of processes (>= 1).
        launcher: one of :data:`LAUNCHERS`.
        required: raise if horovodrun is not installed (False: name it anyway, for printing).
    """
    launcher = resolve_launcher(launcher)
    if launcher != "torchrun":
        return horovodrun_command(np_, launcher, required)
    if isinstance(np_, bool) or not isinstance(np_, int) or np_ < 1:
        raise ValueError(f"np must be an integer >= 1, got {np_!r}")
    # torchrun of this interpreter's torch; --no-python: the caller names the python to run.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone"] + [
        f"--nproc-per-node={np_}",
        "--no-python",
    ]


def sweep_points(
    grid: dict[str, Any], baseline: bool, seeds: Sequence[str], allreduce: bool = False
) -> list[dict[str, Any]]:
    """The runs of a grid (for one worker count): AR-SGD first (with ``allreduce``, per lr: tau
    does not change it), the base alone (with ``baseline``, at every tau, buffers kept, per lr),
    then every SlowMo point (unless the grid is of the base alone), each once per seed.

    Args:
        grid: an :data:`ABLATIONS` entry, possibly with overridden lists.
        baseline: also run the base algorithm without SlowMo, at every tau.
        seeds: the seeds of every point.
        allreduce: also run AR-SGD (``--algo allreduce --no-slowmo``) as the reference.
    """
    lrs: list[str | None] = list(grid["lrs"]) or [None]
    settings: list[dict[str, Any]] = []
    if allreduce:
        for lr in lrs:
            settings.append(
                {
                    "slowmo": False,
                    "lr": lr,
                    "tau": grid["taus"][0],
                    "buffers": "maintain",
                    "algo": "allreduce",
                }
            )
    if baseline or not grid["slowmo"]:
        # The baseline of a SlowMo grid: at every tau (each tau has its own), buffers kept.
        bufs = ["maintain"] if grid["slowmo"] else grid["buffers"]
        for lr, tau, buf in itertools.product(lrs, grid["taus"], bufs):
            settings.append({"slowmo": False, "lr": lr, "tau": tau, "buffers": buf})
    if grid["slowmo"]:
        for lr, tau, alpha, beta, buf in itertools.product(
            lrs, grid["taus"], grid["slow_lrs"], grid["slow_momentums"], grid["buffers"]
        ):
            settings.append(
                {
                    "slowmo": True,
                    "lr": lr,
                    "tau": tau,
                    "slow_lr": alpha,
                    "slow_momentum": beta,
                    "buffers": buf,
                }
            )
    return [dict(s, seed=seed) for s in settings for seed in seeds]


def point_args(algo: str, point: dict[str, Any]) -> list[str]:
    """The training script's flags for one point, its run name included
    (``<algo>[-slowmo]_tau.._[a.._b.._]<buffers>[_lr..]/seed<k>``).

    Args:
        algo: the base algorithm.
        point: from :func:`sweep_points`.
    """
    algo = point.get("algo", algo)
    if point["slowmo"]:
        name = (
            f"{algo}-slowmo_tau{point['tau']}_a{point['slow_lr']}_b{point['slow_momentum']}"
            f"_{point['buffers']}"
        )
        args = [
            "--slowmo",
            "--tau",
            point["tau"],
            "--slow-lr",
            point["slow_lr"],
            "--slow-momentum",
            point["slow_momentum"],
            "--buffers",
            point["buffers"],
        ]
    else:
        name = f"{algo}_tau{point['tau']}_{point['buffers']}"
        args = ["--no-slowmo", "--tau", point["tau"], "--buffers", point["buffers"]]
    if point["lr"] is not None:
        name += f"_lr{point['lr']}"
        args += ["--lr", point["lr"]]
    if "workers" in point:
        name += f"_w{point['workers']}"
    if "algo" in point:
        args = ["--algo", point["algo"]] + args
    return args + ["--seed", point["seed"], "--run-name", f"{name}/seed{point['seed']}"]


def sweep_commands(
    script: str,
    launch: Sequence[str],
    algo: str,
    points: Sequence[dict[str, Any]],
    logdir: str,
    extra: Sequence[str],
) -> list[list[str]]:
    """One command per point.

    Args:
        script: the training script.
        launch: the launcher prefix (from :func:`horovodrun_command`).
        algo: the base algorithm.
        points: from :func:`sweep_points`.
        logdir: the TensorBoard folder of the sweep.
        extra: arguments added to every run (last).
    """
    head = list(launch) + [
        sys.executable,
        script,
        "--algo",
        algo,
        "--logdir",
        logdir,
        "--no-progress",
    ]
    return [head + point_args(algo, p) + list(extra) for p in points]


def _csv(value: str, name: str, kind: type) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{name} is empty; give comma-separated values, e.g. {name} 12,48")
    for v in items:
        try:
            kind(v)
        except ValueError:
            raise ValueError(f"{name}: {v!r} is not a {kind.__name__}") from None
    return items


def _run(cmd: list[str], timeout: float | None) -> Any:
    try:
        return subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return "timeout"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slowmo_lab.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "script", help="training script taking the examples' flags, e.g. examples/digits.py"
    )
    parser.add_argument(
        "--ablation",
        choices=sorted(ABLATIONS),
        default="tau",
        help="the paper's grid to start from",
    )
    parser.add_argument("--algo", default="localsgd", choices=list(BASES), help="base algorithm")
    parser.add_argument(
        "--lrs", default=None, help="base learning rates, comma-separated, overrides the ablation's"
    )
    parser.add_argument("--taus", default=None, help="comma-separated, overrides the ablation's")
    parser.add_argument("--slow-lrs", default=None, help="alpha values, comma-separated")
    parser.add_argument("--slow-momentums", default=None, help="beta values, comma-separated")
    parser.add_argument("--buffers", default=None, help="reset,maintain,average (any of them)")
    parser.add_argument(
        "--seeds", default="0", help="seeds of every point, comma-separated (default 0)"
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also run the base algorithm without SlowMo, at every tau and worker count",
    )
    parser.add_argument(
        "--allreduce",
        action="store_true",
        help="also run AR-SGD (the base allreduce without SlowMo) at every worker count",
    )
    parser.add_argument("--np", type=int, default=4, help="workers (see --workers for several)")
    parser.add_argument(
        "--workers",
        default=None,
        help="worker counts, comma-separated, e.g. 4,8,16: the whole grid at each (overrides --np)",
    )
    parser.add_argument(
        "--epoch-steps",
        type=int,
        default=0,
        help="steps per epoch whatever tau is, passed to every run: equal steps and samples "
        "across taus (0: the script's own epochs, which the in-memory examples round to tau)",
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS + ("threads",),
        default="auto",
        help="threads: every worker a thread of one process (the script's --threads M; no "
        "launcher, much cheaper for small models)",
    )
    parser.add_argument(
        "--one-launch",
        action="store_true",
        help="every run inside one horovodrun launch (the script's --plan): pays "
        "the launcher's start-up once",
    )
    parser.add_argument("--logdir", default=None, help="default: runs/sweep-<ablation>")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per launch (default: none)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return parser


def _grid(args: argparse.Namespace) -> dict[str, list[Any]]:
    """The ablation's grid with the command line's overrides, checked."""
    grid = dict(ABLATIONS[args.ablation])
    for key, kind in (
        ("lrs", float),
        ("taus", int),
        ("slow_lrs", float),
        ("slow_momentums", float),
        ("buffers", str),
    ):
        if getattr(args, key) is not None:
            grid[key] = _csv(getattr(args, key), "--" + key.replace("_", "-"), kind)
    bad = sorted(set(grid["buffers"]) - {"reset", "maintain", "average"})
    if bad:
        raise ValueError(f"--buffers: unknown strategy {bad}; use reset, maintain or average")
    return grid


def _one_launch(
    args: argparse.Namespace,
    launch: list[str],
    points: list,
    logdir: str,
    extra: list[str],
    launch_flags: Sequence[str] = (),
) -> tuple[int, int] | None:
    """Every run inside one launch (the script's --plan); (failed, launches), or None after a
    dry run. ``launch_flags`` (e.g. ``--threads M``) go on the launch's own command line."""
    head = launch + [
        sys.executable,
        args.script,
        "--algo",
        args.algo,
        "--logdir",
        logdir,
        "--no-progress",
        *launch_flags,
    ]
    plan = [point_args(args.algo, p) + list(extra) for p in points]
    if args.dry_run:
        print(shlex.join(head + ["--plan", "PLAN.json"]))
        print(json.dumps(plan))
        return None
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as f:
            json.dump(plan, f)
        print(
            f"{len(plan)} runs in one launch: {shlex.join(head + ['--plan', plan_path])}",
            flush=True,
        )
        t0 = time.perf_counter()
        rc = _run(head + ["--plan", plan_path], args.timeout)
        print(f"exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
    return int(rc != 0), 1


def _launch_each(
    args: argparse.Namespace,
    launch: list[str],
    points: list,
    logdir: str,
    extra: list[str],
    launch_flags: Sequence[str] = (),
) -> tuple[int, int] | None:
    """One launch per run; (failed, launches), or None after a dry run."""
    cmds = sweep_commands(
        args.script, launch, args.algo, points, logdir, list(launch_flags) + list(extra)
    )
    if args.dry_run:
        for cmd in cmds:
            print(shlex.join(cmd))
        return None
    failed = 0
    for i, cmd in enumerate(cmds):
        print(f"[{i + 1}/{len(cmds)}] {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        rc = _run(cmd, args.timeout)
        print(
            f"[{i + 1}/{len(cmds)}] exit {rc} after {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        failed += rc != 0
    return failed, len(cmds)


def _print_chosen(logdir: str) -> None:
    """The report of the sweep and the best setting per task and algorithm."""
    from . import report

    report.main([logdir])
    if not os.path.isdir(logdir):
        return
    runs = report.load_runs([logdir])
    for st in report.group_settings(runs):
        for name, why in st.failures().items():
            print(f"rejected {st.name}: seed {name} fails ({why})")
    print(
        "\nChosen (among the settings where no seed fails, the best mean final validation "
        "metric over seeds, per task and algorithm):"
    )
    for st in report.best_settings(runs):
        c = st.config
        beta = c.get("slow_momentum") if st.runs[0].slowmo else "-"
        final = report.fmt_mean_std(st.values("final_val"), ".4g")
        print(
            f"  {st.task} {st.name}: lr {c.get('lr')}, tau {c.get('tau')}, beta {beta}, "
            f"buffers {c.get('buffers')}; final val {final} over {len(st.runs)} seed(s)"
        )


def _run_counts(
    args: argparse.Namespace,
    grid: dict[str, Any],
    seeds: list[str],
    workers: list[int],
    logdir: str,
    extra: list[str],
) -> tuple[int, int]:
    """The grid at every worker count (one launch, or one per run, for each); (failed,
    launches)."""
    run = _one_launch if args.one_launch else _launch_each
    failed = total = 0
    for m in workers:
        if args.launcher == "threads":
            launch, more = [], ["--threads", str(m)]
        else:
            launch, more = launch_command(m, args.launcher, required=not args.dry_run), []
        if args.epoch_steps:
            more += ["--epoch-steps", str(args.epoch_steps)]
        points = sweep_points(grid, args.baseline, seeds, args.allreduce)
        if len(workers) > 1:  # run names say the worker count
            points = [dict(p, workers=m) for p in points]
        outcome = run(args, launch, points, logdir, extra, more)
        if outcome is not None:
            failed, total = failed + outcome[0], total + outcome[1]
    return failed, total


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring).

    Args:
        argv: arguments (default: sys.argv[1:]).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    args = _parser().parse_args(argv)
    grid = _grid(args)
    seeds = _csv(args.seeds, "--seeds", int)
    workers = [int(w) for w in _csv(args.workers, "--workers", int)] if args.workers else [args.np]
    if args.workers and any(w < 1 for w in workers):
        raise ValueError(f"--workers: every count must be >= 1, got {args.workers!r}")
    if args.epoch_steps < 0:
        raise ValueError(
            f"--epoch-steps must be >= 0 (0: the script's epochs), got {args.epoch_steps}"
        )
    logdir = args.logdir or os.path.join("runs", f"sweep-{args.ablation}")
    failed, total = _run_counts(args, grid, seeds, workers, logdir, extra)
    if args.dry_run:
        return 0
    _print_chosen(logdir)
    if failed:
        print(f"{failed} of {total} launches failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
