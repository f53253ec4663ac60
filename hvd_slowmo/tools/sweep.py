"""The paper's ablations as a sweep (arXiv 1910.00643, Sec. 6 and Appendix C): runs one after
another under ``horovodrun``, then prints the report's tables for them.

    python -m hvd_slowmo.tools.sweep examples/digits.py --ablation tau --np 4            # tau in {12, 24, 48, 96}
    python -m hvd_slowmo.tools.sweep examples/digits.py --ablation alpha-beta --dry-run  # print the commands only
    python -m hvd_slowmo.tools.sweep examples/cifar10_resnet18.py --algo sgp --taus 12,48 --slow-momentums 0.5,0.7 \\
        --baseline -- --data data --epochs 50       # arguments after "--" go to every run

The training script must accept the examples' flags (--algo, --slowmo/--no-slowmo, --tau,
--slow-lr, --slow-momentum, --buffers, --logdir, --no-progress). Each run logs to
LOGDIR/<run name>/, named by its settings, so TensorBoard overlays them.
"""
import argparse
import itertools
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

from ..bases import BASES

__all__ = ["ABLATIONS", "horovodrun_command", "sweep_commands", "main"]

#: The paper's grids: tau (Fig. 3), alpha x beta (Appendix C.2), base-buffer strategy (Tables C.3/C.4).
ABLATIONS: Dict[str, Dict[str, List[str]]] = {
    "tau": {"taus": ["12", "24", "48", "96"], "slow_lrs": ["1"], "slow_momentums": ["0.7"], "buffers": ["reset"]},
    "alpha-beta": {"taus": ["12"], "slow_lrs": ["0.5", "1"], "slow_momentums": ["0.4", "0.5", "0.6", "0.7", "0.8"],
                   "buffers": ["reset"]},
    "buffers": {"taus": ["12"], "slow_lrs": ["1"], "slow_momentums": ["0.7"],
                "buffers": ["reset", "maintain", "average"]},
}


def horovodrun_command(np_: int, launcher: str = "gloo", required: bool = True) -> List[str]:
    """The ``horovodrun`` prefix for ``np_`` local processes.

    Args:
        np_: number of processes (>= 1).
        launcher: ``"gloo"`` or ``"mpi"`` (OpenMPI as root needs --allow-run-as-root).
        required: raise if horovodrun is not installed (False: name it anyway, for printing).
    """
    if isinstance(np_, bool) or not isinstance(np_, int) or np_ < 1:
        raise ValueError(f"np must be an integer >= 1, got {np_!r}")
    if launcher not in ("gloo", "mpi"):
        raise ValueError(f"launcher must be 'gloo' or 'mpi', got {launcher!r}")
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        exe = shutil.which("horovodrun") or ""
    if not exe:
        if required:
            raise RuntimeError("horovodrun not found: build Horovod with scripts/install_horovod.sh")
        exe = "horovodrun"
    cmd = [exe, "-np", str(np_), "-H", f"localhost:{np_}"]
    if launcher == "gloo":
        return cmd + ["--gloo"]
    return cmd + ["--mpi", "--mpi-args=--oversubscribe --allow-run-as-root"]


def sweep_commands(script: str, launch: Sequence[str], algo: str, taus: Sequence[str], slow_lrs: Sequence[str],
                   slow_momentums: Sequence[str], buffers: Sequence[str], logdir: str, baseline: bool,
                   extra: Sequence[str]) -> List[List[str]]:
    """One command per grid point (and the base algorithm alone first, with ``baseline``).

    Args:
        script: the training script.
        launch: the launcher prefix (from :func:`horovodrun_command`).
        algo: the base algorithm.
        taus: tau values.
        slow_lrs: alpha values.
        slow_momentums: beta values.
        buffers: buffer strategies.
        logdir: the TensorBoard folder of the sweep.
        baseline: also run the base without SlowMo (at the first tau).
        extra: arguments added to every run.
    """
    head = list(launch) + [sys.executable, script, "--algo", algo, "--logdir", logdir, "--no-progress"]
    cmds = []
    if baseline:
        cmds.append(head + ["--no-slowmo", "--tau", str(taus[0])] + list(extra))
    for tau, alpha, beta, buf in itertools.product(taus, slow_lrs, slow_momentums, buffers):
        cmds.append(head + ["--slowmo", "--tau", tau, "--slow-lr", alpha, "--slow-momentum", beta,
                            "--buffers", buf] + list(extra))
    return cmds


def _csv(value: str, name: str, kind: type) -> List[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{name} is empty; give comma-separated values, e.g. {name} 12,48")
    for v in items:
        try:
            kind(v)
        except ValueError:
            raise ValueError(f"{name}: {v!r} is not a {kind.__name__}") from None
    return items


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line (see the module docstring).

    Args:
        argv: arguments (default: sys.argv[1:]).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="python -m hvd_slowmo.tools.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("script", help="training script accepting the examples' flags, e.g. examples/digits.py")
    parser.add_argument("--ablation", choices=sorted(ABLATIONS), default="tau", help="the paper's grid to start from")
    parser.add_argument("--algo", default="localsgd", choices=list(BASES), help="base algorithm")
    parser.add_argument("--taus", default=None, help="comma-separated, overrides the ablation's")
    parser.add_argument("--slow-lrs", default=None, help="alpha values, comma-separated")
    parser.add_argument("--slow-momentums", default=None, help="beta values, comma-separated")
    parser.add_argument("--buffers", default=None, help="reset,maintain,average (any of them)")
    parser.add_argument("--baseline", action="store_true", help="also run the base algorithm without SlowMo")
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--launcher", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--logdir", default=None, help="default: runs/sweep-<ablation>")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run (default: none)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    grid = dict(ABLATIONS[args.ablation])
    for key, kind in (("taus", int), ("slow_lrs", float), ("slow_momentums", float), ("buffers", str)):
        if getattr(args, key) is not None:
            grid[key] = _csv(getattr(args, key), "--" + key.replace("_", "-"), kind)
    bad = sorted(set(grid["buffers"]) - {"reset", "maintain", "average"})
    if bad:
        raise ValueError(f"--buffers: unknown strategy {bad}; use reset, maintain or average")
    logdir = args.logdir or os.path.join("runs", f"sweep-{args.ablation}")
    cmds = sweep_commands(args.script, horovodrun_command(args.np, args.launcher, required=not args.dry_run),
                          args.algo, grid["taus"], grid["slow_lrs"], grid["slow_momentums"], grid["buffers"],
                          logdir, args.baseline, extra)
    if args.dry_run:
        for cmd in cmds:
            print(shlex.join(cmd))
        return 0
    failed = 0
    for i, cmd in enumerate(cmds):
        print(f"[{i + 1}/{len(cmds)}] {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"[{i + 1}/{len(cmds)}] exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
        failed += rc != 0
    from .report import main as report_main

    report_main([logdir])
    if failed:
        print(f"{failed} of {len(cmds)} runs failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
