"""The main job: AR-SGD, Local SGD, Local SGD + SlowMo, SGP and SGP + SlowMo (arXiv 1910.00643)
on MNIST-1D, several seeds each, every method at its own tuned learning rate; then the paper's
tables as mean ± std over seeds, and a figure.

    ./run.sh                          # the same as: python examples/compare.py (3 seeds, 30 epochs)
    python examples/compare.py --quick         # one seed, 12 epochs: a first look
    python examples/compare.py --full          # 5 seeds, OSGP too: the paper-like table
    python examples/compare.py --task digits   # 8x8 digits: fast, saturated, not tuned
    python examples/compare.py --algos localsgd,localsgd-slowmo --seeds 0,1 --epochs 10

Every run of one worker count trains inside a single ``horovodrun -np NP --gloo`` launch (the
training script's ``--plan``), one run after the other, so the launcher's start-up is paid once
and the cores are never shared by more than NP processes. A progress bar per run follows the
epochs; each run's wall time and the total are printed.

Fair comparison, as the paper makes it (its Appendix B): each base algorithm runs at the
learning rate tuned for it; SlowMo keeps its base's learning rate, alpha = 1 and tau = 12, with
its own tuned beta (the values and grids: ``TUNED``, ``LR_GRID`` and ``BETA_GRID`` in
examples/mnist1d_cnn.py; how they were chosen: docs/mnist1d_tuning.md). The plain baselines
keep their local momentum at each average (``buffers="maintain"``); SlowMo resets it
(``"reset"``), as in the paper. The metrics are those of the workers' averaged model at the end
of each epoch, an outer-step boundary: its loss on the whole training set and its test
accuracy (for plain SGP, which never averages exactly, the average of a copy of the workers'
models). TensorBoard event files: LOGDIR/TASK/<method>/seed<k>/.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import digits  # noqa: E402
import mnist1d_cnn  # noqa: E402
from common import ALGOS, PROGRESS_MARK  # noqa: E402  (also puts the package on the path)

import hvd_slowmo  # noqa: E402
from hvd_slowmo.tools import report  # noqa: E402
from hvd_slowmo.tools.sweep import horovodrun_command  # noqa: E402

DEFAULT_ALGOS = "allreduce,localsgd,localsgd-slowmo,sgp,sgp-slowmo"
FULL_ALGOS = DEFAULT_ALGOS + ",osgp,osgp-slowmo"
#: tau for every method: the paper's CIFAR-10 setting (Table 1: tau = 12 for every base). AR-SGD
#: has no outer step to speak of, but the optimizer still checks every tau steps that all
#: workers are finite (one small collective).
TAU = 12
#: task -> (training script, settings per method, epochs of the default / --quick / --full modes).
TASKS: dict[str, tuple[str, dict[str, dict[str, Any]], dict[str, int]]] = {
    "mnist1d": ("mnist1d_cnn.py", mnist1d_cnn.TUNED, {"default": 30, "quick": 12, "full": 30}),
    "digits": ("digits.py", digits.SETTINGS, {"default": 10, "quick": 4, "full": 10}),
}
SEEDS = {"default": "0,1,2", "quick": "0", "full": "0,1,2,3,4"}


def parse_algo(spec: str) -> tuple[str, bool]:
    """``"sgp-slowmo"`` -> ``("sgp", True)``; ``"localsgd"`` -> ``("localsgd", False)``.

    Args:
        spec: a base name, optionally followed by ``-slowmo``.
    """
    base, slowmo = (spec[: -len("-slowmo")], True) if spec.endswith("-slowmo") else (spec, False)
    if base not in ALGOS:
        raise ValueError(
            f"--algos: unknown algorithm {spec!r}; use {', '.join(ALGOS)}, each "
            "optionally with -slowmo (e.g. localsgd-slowmo)"
        )
    if base == "allreduce" and slowmo:
        raise ValueError(
            "--algos: allreduce-slowmo is not one of the paper's settings (the paper "
            "saw no gain from SlowMo over AR-SGD); run it with "
            "examples/mnist1d_cnn.py --algo allreduce --slowmo"
        )
    return base, slowmo


def run_args(
    method: str, settings: dict[str, Any], seed: int, args: argparse.Namespace
) -> list[str]:
    """The training script's flags for one run of ``method`` (e.g. ``"sgp-slowmo"``) and seed.

    Args:
        method: a base name, optionally with ``-slowmo``.
        settings: the method's ``lr``, ``slow_momentum`` and ``buffers``.
        seed: the run's seed.
        args: compare.py's flags.
    """
    base, slowmo = parse_algo(method)
    flags = [
        "--algo",
        base,
        "--slowmo" if slowmo else "--no-slowmo",
        "--tau",
        str(TAU),
        "--lr",
        str(settings["lr"]),
        "--buffers",
        settings.get("buffers", "maintain"),
        "--seed",
        str(seed),
        "--run-name",
        f"{method}/seed{seed}",
    ]
    if slowmo:
        flags += ["--slow-lr", "1", "--slow-momentum", str(settings["slow_momentum"])]
        flags += ["--overlap", str(args.overlap)] if args.overlap else []
        flags += ["--fragments", str(args.fragments)] if args.fragments > 1 else []
        flags += ["--eager"] if args.eager else []
    return flags


def launch(
    np_: int, script: str, plan: list[list[str]], common_flags: list[str], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], int, str]:
    """Train every run of ``plan`` in one horovodrun launch, with a progress bar per run.

    Args:
        np_: workers.
        script: the training script.
        plan: one argument list per run.
        common_flags: flags for every run.
        args: compare.py's flags.

    Returns:
        (run name -> rank 0's summary, the launch's exit code, the tail of its output).
    """
    from tqdm import tqdm

    summaries: dict[str, dict[str, Any]] = {}
    tail: deque[str] = deque(maxlen=60)
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        with open(plan_path, "w", encoding="utf-8") as f:
            json.dump(plan, f)
        cmd = (
            horovodrun_command(np_, args.launcher)
            + [sys.executable, os.path.join(HERE, script)]
            + common_flags
            + ["--plan", plan_path]
        )
        # A session of its own, so a timeout or Ctrl-C can stop horovodrun and every worker it
        # started.
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        timed_out = threading.Event()

        def stop() -> None:
            timed_out.set()
            os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(args.timeout, stop)
        timer.start()
        bar: Any | None = None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if PROGRESS_MARK not in line:
                    tail.append(line.rstrip("\n"))
                    if args.verbose:
                        tqdm.write(line.rstrip("\n"))
                    continue
                event = json.loads(line.split(PROGRESS_MARK, 1)[1])
                if event["event"] == "start":
                    bar = tqdm(
                        total=event["epochs"],
                        initial=event["start_epoch"],
                        desc=f"{event['run']:<22}",
                        unit="epoch",
                        dynamic_ncols=True,
                        leave=False,
                        disable=args.no_progress,
                    )
                elif event["event"] == "epoch" and bar is not None:
                    bar.update(1)
                    acc = event.get("val_accuracy")
                    if acc is not None:
                        loss = event.get("train_full_loss", float("nan"))
                        bar.set_postfix(acc=f"{acc:.1f}%", loss=f"{loss:.4f}")
                elif event["event"] == "end":
                    s = event["summary"]
                    summaries[s["run"]] = s
                    if bar is not None:
                        bar.close()
                        bar = None
                    loss = s.get("train_full_loss", s["train_loss"])
                    tqdm.write(
                        f"{s['run']:<22} {s['wall_s']:6.1f} s   test acc "
                        f"{s.get('val_accuracy', 0):.2f}%   train loss {loss:.4f}   "
                        f"{s['ms_per_iter']:.1f} ms/iter"
                        + ("   DIVERGED" if s.get("diverged") else "")
                    )
            proc.wait()
        except BaseException:  # Ctrl-C or SIGTERM: the workers are in another session: stop them
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            timer.cancel()
            if bar is not None:
                bar.close()
    if timed_out.is_set():
        tail.append(f"(stopped after --timeout {args.timeout:g} s)")
    return summaries, proc.returncode, "\n".join(tail)


def results_table(
    methods: Sequence[str],
    settings: dict[str, dict[str, Any]],
    summaries: dict[str, dict[str, Any]],
) -> str:
    """compare.py's own table: per method, mean ± std over its seeds of the final metrics.

    Args:
        methods: the methods in order.
        settings: per method, its lr / beta / buffers.
        summaries: run name -> summary.
    """
    rows = []
    for method in methods:
        runs = [s for name, s in sorted(summaries.items()) if name.rsplit("/", 1)[0] == method]
        if not runs:
            rows.append([method, "-", "-", "-", "0", "-", "-", "-", "-", "-"])
            continue
        cfg = settings[method]
        rows.append(
            [
                method,
                f"{cfg['lr']:g}",
                f"{cfg['slow_momentum']:g}" if method.endswith("-slowmo") else "-",
                cfg.get("buffers", "maintain"),
                str(len(runs)),
                report.fmt_mean_std(
                    [s.get("train_full_loss", s["train_loss"]) for s in runs], ".4f"
                ),
                report.fmt_mean_std([s.get("val_accuracy") for s in runs], ".2f"),
                report.fmt_mean_std([s.get("best_val_accuracy") for s in runs], ".2f"),
                report.fmt_mean_std([s["ms_per_iter"] for s in runs], ".1f"),
                f"{sum(s['wall_s'] for s in runs):.0f}",
            ]
        )
    headers = [
        "Method",
        "lr",
        "beta",
        "buffers",
        "Seeds",
        "Train loss (final)",
        "Test acc % (final)",
        "Test acc % (best)",
        "ms/iter",
        "Wall (s)",
    ]
    return report.text_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    """Run every requested method and seed, print the rows and the report.

    Args:
        argv: arguments (default: sys.argv[1:]); unknown ones go to the training script.
    """
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=sorted(TASKS), default="mnist1d")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one seed, fewer epochs: a first look")
    mode.add_argument(
        "--full", action="store_true", help="5 seeds and OSGP too: the paper-like table"
    )
    parser.add_argument("--np", type=int, default=4, help="workers per run")
    parser.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="SlowMo runs: base steps the exact average stays in flight",
    )
    parser.add_argument(
        "--fragments", type=int, default=1, help="SlowMo runs: streaming fragments (1: none)"
    )
    parser.add_argument(
        "--eager", action="store_true", help="SlowMo runs: eager updates (needs --overlap)"
    )
    parser.add_argument("--algos", default=None, help=f"comma-separated (default: {DEFAULT_ALGOS})")
    parser.add_argument(
        "--seeds", default=None, help="comma-separated (default 0,1,2; --quick 0; --full 0..4)"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="default: the task's (mnist1d: 30; --quick 12)"
    )
    parser.add_argument(
        "--logdir", default="runs", help="TensorBoard runs go to LOGDIR/TASK/<method>/seed<k>/"
    )
    parser.add_argument("--launcher", choices=("gloo", "mpi"), default="gloo")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole launch")
    parser.add_argument(
        "--png", default=None, help="figure path (default: LOGDIR/TASK/compare.png)"
    )
    parser.add_argument("--verbose", action="store_true", help="show the training logs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args, extra = parser.parse_known_args(argv)
    if args.np < 1:
        raise ValueError(f"--np must be >= 1, got {args.np}")
    mode_name = "quick" if args.quick else "full" if args.full else "default"
    script, settings, epochs_by_mode = TASKS[args.task]
    epochs = args.epochs if args.epochs is not None else epochs_by_mode[mode_name]
    algos = args.algos or (FULL_ALGOS if args.full else DEFAULT_ALGOS)
    methods = [m.strip() for m in algos.split(",") if m.strip()]
    if not methods:
        raise ValueError("--algos is empty; e.g. --algos allreduce,localsgd")
    for m in methods:
        parse_algo(m)
        if m not in settings:
            raise ValueError(
                f"--algos: no tuned settings for {m!r} on {args.task} (have: {', '.join(settings)})"
            )
    seeds = [int(s) for s in (args.seeds or SEEDS[mode_name]).split(",") if s.strip()]
    runnable = [m for m in methods if parse_algo(m)[0] in hvd_slowmo.BASES]
    for m in sorted(set(methods) - set(runnable)):
        print(
            f"skipping {m}: base {parse_algo(m)[0]!r} is not registered in hvd_slowmo.BASES",
            flush=True,
        )

    # SIGTERM becomes SystemExit, so launch() stops the workers before exiting.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    t_all = time.perf_counter()
    logdir = os.path.join(args.logdir, args.task)
    plan = [run_args(m, settings[m], seed, args) for m in runnable for seed in seeds]
    common_flags = [
        "--epochs",
        str(epochs),
        "--logdir",
        logdir,
        "--no-progress",
        "--progress-lines",
    ] + extra
    print(
        f"{args.task}: {len(plan)} runs ({len(runnable)} methods x {len(seeds)} seeds), "
        f"{args.np} workers, {epochs} epochs, one horovodrun launch",
        flush=True,
    )
    summaries, rc, tail = launch(args.np, script, plan, common_flags, args) if plan else ({}, 0, "")
    failed = len(plan) - len(summaries)
    if rc != 0 or failed:
        print(
            f"\nthe launch exited with {rc}; {failed} of {len(plan)} runs did not finish. Its "
            f"last lines:\n{tail}",
            flush=True,
        )

    print(
        f"\n{args.task}, {args.np} workers, {epochs} epochs, seeds {','.join(map(str, seeds))}: "
        "the averaged model at the last epoch's end (mean ± std over seeds; sample std)"
    )
    print(results_table(runnable, settings, summaries))
    names = [name for name in summaries if os.path.isdir(os.path.join(logdir, name))]
    if names:
        runs = report.load_runs([os.path.join(logdir, n) for n in names], relative_to=logdir)
        print()
        print(report.table1(runs))
        print()
        print(report.table2(runs))
        png = report.plot(runs, args.png or os.path.join(logdir, "compare.png"))
        print(f"\nFigure: {png}   (per-run details: python -m hvd_slowmo.tools.report {logdir})")
    print(f"Total wall time: {time.perf_counter() - t_all:.1f} s")
    return 1 if rc != 0 or failed or not summaries else 0


if __name__ == "__main__":
    sys.exit(main())
