"""The main job: AR-SGD, Local SGD, Local SGD + SlowMo, SGP and SGP + SlowMo (arXiv 1910.00643)
on scikit-learn's 8x8 digits, one ``horovodrun`` launch per algorithm, then the paper's tables.

    ./run.sh                                   # the same as: python examples/compare.py
    python examples/compare.py --np 2 --epochs 1 --algos allreduce,localsgd
    python examples/compare.py --slow-momentum 0.6 --batch-size 32   # unknown flags go to digits.py

Each algorithm trains examples/digits.py (a small CNN) under ``horovodrun -np NP --gloo``; the
script prints one row per algorithm (final training loss, validation accuracy, ms/iteration),
then the report's Table 1 and Table 2 for these runs and the path of the PNG. TensorBoard event
files are in runs/<name>/ (``tensorboard --logdir runs``). The paper's settings: alpha = 1,
beta = 0.7, tau = 12 for Local SGD and tau = 48 for the gossip bases (SGP, OSGP, D-PSGD).
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import ALGOS, run_name  # noqa: E402  (also puts the package on the path)

import hvd_slowmo  # noqa: E402
from hvd_slowmo.tools import report  # noqa: E402
from hvd_slowmo.tools.sweep import horovodrun_command  # noqa: E402

DEFAULT_ALGOS = "allreduce,localsgd,localsgd-slowmo,sgp,sgp-slowmo"
#: The paper's inner-loop length per base (Section 5: tau = 12 for Local SGD, 48 for SGP/OSGP).
#: AR-SGD alone has no outer step to speak of, but the optimizer still checks every tau steps
#: that all workers are finite (one small collective): tau = 12 keeps that off the per-step time.
PAPER_TAU = {"allreduce": 12, "localsgd": 12, "sgp": 48, "osgp": 48, "dpsgd": 48}


def parse_algo(spec: str) -> Tuple[str, bool]:
    """``"sgp-slowmo"`` -> ``("sgp", True)``; ``"localsgd"`` -> ``("localsgd", False)``.

    Args:
        spec: a base name, optionally followed by ``-slowmo``.
    """
    base, slowmo = (spec[: -len("-slowmo")], True) if spec.endswith("-slowmo") else (spec, False)
    if base not in ALGOS:
        raise ValueError(f"--algos: unknown algorithm {spec!r}; use {', '.join(ALGOS)}, each optionally "
                         "with -slowmo (e.g. localsgd-slowmo)")
    if base == "allreduce" and slowmo:
        raise ValueError("--algos: allreduce-slowmo is not one of the paper's settings (the paper saw no gain "
                         "from SlowMo over AR-SGD); run it with examples/digits.py --algo allreduce --slowmo")
    return base, slowmo


def run_one(base: str, slowmo: bool, args: argparse.Namespace, extra: List[str]) -> Tuple[str, Optional[Dict], float]:
    """Train one algorithm under horovodrun; returns (run name, rank 0's summary or None, wall s).

    Args:
        base: the base algorithm.
        slowmo: SlowMo on top of it.
        args: compare.py's flags.
        extra: flags passed through to digits.py.
    """
    tau = args.tau if args.tau is not None else PAPER_TAU[base]
    naming = argparse.Namespace(run_name=None, algo=base, slowmo=slowmo, tau=tau, slow_lr=args.slow_lr,
                                slow_momentum=args.slow_momentum, buffers="reset", no_average=False)
    name = run_name(naming)
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = os.path.join(tmp, "summary.json")
        cmd = horovodrun_command(args.np, args.launcher) + [
            sys.executable, os.path.join(HERE, "digits.py"), "--algo", base, "--slowmo" if slowmo else "--no-slowmo",
            "--tau", str(tau), "--slow-lr", str(args.slow_lr), "--slow-momentum", str(args.slow_momentum),
            "--epochs", str(args.epochs), "--logdir", args.logdir, "--run-name", name,
            "--summary-json", summary_path, "--no-progress"] + extra
        t0 = time.perf_counter()
        # A session of its own, so a timeout can stop horovodrun and the workers it started.
        proc = subprocess.Popen(cmd, stdout=None if args.verbose else subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            output = (output or "") + f"\n(timed out after {args.timeout:g} s)"
        except BaseException:  # Ctrl-C or SIGTERM: the workers are in another session, stop them too
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not os.path.exists(summary_path):
            tail = (output or "")[-3000:]
            print(f"{name}: FAILED (exit {proc.returncode}) after {wall:.1f} s\n  command: {' '.join(cmd)}\n{tail}",
                  flush=True)
            return name, None, wall
        with open(summary_path, encoding="utf-8") as f:
            return name, json.load(f), wall


def main(argv: Optional[List[str]] = None) -> int:
    """Run every requested algorithm, print the rows and the report.

    Args:
        argv: arguments (default: sys.argv[1:]); unknown ones go to digits.py.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=4, help="workers per run")
    parser.add_argument("--algos", default=DEFAULT_ALGOS, help="comma-separated, e.g. localsgd,localsgd-slowmo")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--tau", type=int, default=None, help="override the paper's tau for every base")
    parser.add_argument("--slow-lr", type=float, default=1.0, help="alpha")
    parser.add_argument("--slow-momentum", type=float, default=0.7, help="beta")
    parser.add_argument("--logdir", default="runs")
    parser.add_argument("--launcher", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--png", default=None, help="figure path (default: LOGDIR/compare.png)")
    parser.add_argument("--verbose", action="store_true", help="show the training logs")
    args, extra = parser.parse_known_args(argv)
    if args.np < 1:
        raise ValueError(f"--np must be >= 1, got {args.np}")
    specs = [parse_algo(s.strip()) for s in args.algos.split(",") if s.strip()]
    if not specs:
        raise ValueError("--algos is empty; e.g. --algos allreduce,localsgd")

    # SIGTERM becomes SystemExit, so run_one stops the launch in progress before exiting.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    t_all = time.perf_counter()
    rows, names, failed = [], [], 0
    for base, slowmo in specs:
        if base not in hvd_slowmo.BASES:
            print(f"skipping {base}{'-slowmo' if slowmo else ''}: base {base!r} is not registered in "
                  f"hvd_slowmo.BASES (available: {', '.join(sorted(hvd_slowmo.BASES))})", flush=True)
            continue
        name, summary, wall = run_one(base, slowmo, args, extra)
        if summary is None:
            failed += 1
            continue
        names.append(name)
        rows.append([name, f"{summary['train_loss']:.4f}", f"{summary['val_accuracy']:.2f}",
                     f"{summary['best_val_accuracy']:.2f}", f"{summary['ms_per_iter']:.2f}",
                     f"{summary['bytes_sent'] / 1e6:.2f}", f"{wall:.1f}"])
        print(f"{name}: done in {wall:.1f} s", flush=True)

    print()
    print(f"digits CNN, {args.np} workers, {args.epochs} epochs")
    headers = ["Algorithm", "Final train loss", "Val acc (%)", "Best val acc (%)", "ms/iter", "MB sent (rank 0)",
               "Wall (s)"]
    print(report.text_table(headers, rows))
    if names:
        runs = report.load_runs([os.path.join(args.logdir, n) for n in names])
        print()
        print(report.table1(runs))
        print()
        print(report.table2(runs))
        print()
        print(report.runs_table(runs))
        png = report.plot(runs, args.png or os.path.join(args.logdir, "compare.png"))
        print(f"\nFigure: {png}")
    print(f"Total wall time: {time.perf_counter() - t_all:.1f} s")
    return 1 if failed or not names else 0


if __name__ == "__main__":
    sys.exit(main())
