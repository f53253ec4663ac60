"""The main job: AR-SGD, Local SGD, Local SGD + SlowMo, SGP and SGP + SlowMo (arXiv 1910.00643)
on MNIST-1D, several seeds each, every method at its own tuned learning rate; then the paper's
tables as mean ± std over seeds, and a figure.

    ./run.sh                          # the same as: python examples/compare.py (3 seeds, 30 epochs)
    python examples/compare.py --quick         # one seed, 12 epochs: a first look
    python examples/compare.py --full          # 5 seeds, OSGP too: the paper-like table
    python examples/compare.py --task digits   # 8x8 digits: fast, saturated, not tuned
    python examples/compare.py --task char_lm  # the byte-level language model, AdamW inside
    python examples/compare.py --algos localsgd,localsgd-slowmo --seeds 0,1 --epochs 10
    python examples/compare.py --network 100mbit   # as root: 4 emulated hosts, time to accuracy
    python examples/compare.py --slow-factor 2     # the last worker 2x slower (examples/unequal.py)
    python examples/compare.py --pause-at 4 --pause-periods 3  # it stops 3 periods after outer 4

``--network RATE[,DELAY]`` runs every worker in its own emulated host (slowmo_lab.netns:
a network namespace with a veth to a bridge, the link limited to RATE both ways with ``tc tbf``,
DELAY added with ``netem`` where the kernel has it) and adds Local SGD + SlowMo with
``overlap=1`` (``localsgd-slowmo-overlap1``); it prints the time to accuracy: the training
seconds each method's averaged model needs to first reach 85%, 90% and the best method's final
accuracy minus one point (slowmo_lab.time_to_accuracy), and the figure plots accuracy
against those seconds. For ``--task char_lm`` (its three methods, no overlapped row) it
prints the validation loss instead: each method's at equal training seconds (the shortest
run's) and the seconds to each method's final loss (slowmo_lab.time_to_accuracy.loss_table).

Every run of one worker count trains inside a single launch (the training script's ``--plan``:
``horovodrun -np NP --gloo``, or ``torchrun --nproc-per-node NP`` with ``--launcher torchrun`` or
where Horovod is not installed), one run after the other, so the launcher's start-up is paid once
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
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import char_lm  # noqa: E402
import digits  # noqa: E402
import mnist1d_cnn  # noqa: E402
import regime_map  # noqa: E402
from common import ALGOS, parse_event  # noqa: E402  (also puts the package on the path)
from unequal import add_straggler_args, straggler_flags  # noqa: E402

import hvd_slowmo  # noqa: E402
from slowmo_lab import report  # noqa: E402
from slowmo_lab import time_to_accuracy as tta  # noqa: E402
from slowmo_lab.metrics import TAGS  # noqa: E402
from slowmo_lab.netns import (  # noqa: E402
    Cluster,
    missing_requirements,
    netem_available,
    parse_network,
    plan_cluster,
)
from slowmo_lab.sweep import LAUNCHERS, launch_command, resolve_launcher  # noqa: E402

DEFAULT_ALGOS = "allreduce,localsgd,localsgd-slowmo,sgp,sgp-slowmo"
FULL_ALGOS = DEFAULT_ALGOS + ",osgp,osgp-slowmo"
#: --network: the default methods, and Local SGD + SlowMo with its exact average in flight for
#: one base step (overlap=1: the smallest delay, 0.9 points of accuracy on this task in the
#: README's table of d; on the emulated cluster it hid part of the average's time).
NETWORK_ALGOS = "allreduce,localsgd,localsgd-slowmo,localsgd-slowmo-overlap1,sgp,sgp-slowmo"
#: The image tasks' methods per mode (:class:`TaskSpec`).
IMAGE_ALGOS = {"default": DEFAULT_ALGOS, "full": FULL_ALGOS, "network": NETWORK_ALGOS}
#: The language model's methods (AdamW inside): AR-AdamW, Local AdamW, Local AdamW + SlowMo.
LM_ALGOS = "allreduce,localsgd,localsgd-slowmo"


@dataclass(frozen=True)
class TaskSpec:
    """A task the main job runs.

    Attributes:
        script: the training script in examples/.
        settings: per method (``"localsgd-slowmo"``...), its ``lr``, ``buffers`` and, for
            SlowMo, ``slow_momentum``, optionally ``slow_lr`` (default 1, the paper's alpha)
            and ``flags`` (more of the script's flags).
        epochs: the default / ``quick`` / ``full`` modes' epochs.
        tau: every method's tau (``--tau`` overrides it).
        target: the metric the tables rank by: ``val_accuracy`` (higher is better) or
            ``val_loss`` (lower is better).
        algos: the methods each mode runs by default: ``default`` (and ``--quick``), ``full``
            (``--full``) and ``network`` (``--network``).
        flags: the script's flags for every run (before the user's extra flags, which win).
    """

    script: str
    settings: dict[str, dict[str, Any]]
    epochs: dict[str, int]
    tau: int
    target: str
    algos: dict[str, str]
    flags: tuple[str, ...] = ()


#: tau 12 on the image tasks: the paper's CIFAR-10 setting (Table 1: tau = 12 for every base).
#: AR-SGD has no outer step to speak of, but the optimizer still checks every tau steps that
#: all workers are finite (one small collective). The language model (docs/results/regimes.md) takes
#: tau 64, DiLoCo's regime, at the CPU size the regime map ran.
TASKS: dict[str, TaskSpec] = {
    "mnist1d": TaskSpec(
        "mnist1d_cnn.py",
        mnist1d_cnn.TUNED,
        {"default": 30, "quick": 12, "full": 30},
        12,
        "val_accuracy",
        IMAGE_ALGOS,
    ),
    "digits": TaskSpec(
        "digits.py",
        digits.SETTINGS,
        {"default": 10, "quick": 4, "full": 10},
        12,
        "val_accuracy",
        IMAGE_ALGOS,
    ),
    "char_lm": TaskSpec(
        "char_lm.py",
        char_lm.COMPARE_SETTINGS,
        {"default": 16, "quick": 4, "full": 16},
        64,
        "val_loss",
        {"default": LM_ALGOS, "full": LM_ALGOS, "network": LM_ALGOS},
        tuple(char_lm.CPU_SIZE),
    ),
}
SEEDS = {"default": "0,1,2", "quick": "0", "full": "0,1,2,3,4"}


def parse_method(spec: str) -> tuple[str, bool, int | None]:
    """``"localsgd-slowmo-overlap1"`` -> ``("localsgd", True, 1)``; ``"sgp-slowmo"`` ->
    ``("sgp", True, None)``; ``"localsgd"`` -> ``("localsgd", False, None)``.

    Args:
        spec: a base name, optionally followed by ``-slowmo``, then optionally by ``-overlapD``
            (SlowMo's exact average stays in flight for D base steps; None: --overlap decides).
    """
    m = re.fullmatch(r"(.*?)(-slowmo)?(?:-overlap(\d+))?", spec)
    assert m is not None  # the pattern matches every string
    base, slowmo = m.group(1), m.group(2) is not None
    overlap = int(m.group(3)) if m.group(3) is not None else None
    if base not in ALGOS:
        raise ValueError(
            f"--algos: unknown algorithm {spec!r}; use {', '.join(ALGOS)}, each "
            "optionally with -slowmo (e.g. localsgd-slowmo) and then -overlapD "
            "(e.g. localsgd-slowmo-overlap1)"
        )
    if base == "allreduce" and slowmo:
        raise ValueError(
            "--algos: allreduce-slowmo is not one of the paper's settings (the paper "
            "saw no gain from SlowMo over AR-SGD); run it with "
            "examples/mnist1d_cnn.py --algo allreduce --slowmo"
        )
    if overlap is not None and not slowmo:
        raise ValueError(
            f"--algos: {spec!r}: -overlapD is an option of SlowMo's outer step; "
            f"use {base}-slowmo-overlap{overlap}"
        )
    return base, slowmo, overlap


def parse_algo(spec: str) -> tuple[str, bool]:
    """``"sgp-slowmo"`` -> ``("sgp", True)``; ``"localsgd"`` -> ``("localsgd", False)``
    (see :func:`parse_method`).

    Args:
        spec: a method name.
    """
    base, slowmo, _ = parse_method(spec)
    return base, slowmo


def settings_key(method: str) -> str:
    """The tuned settings a method takes: an overlapped SlowMo run takes the non-overlapped
    method's (``"localsgd-slowmo-overlap1"`` -> ``"localsgd-slowmo"``).

    Args:
        method: a method name (:func:`parse_method`).
    """
    base, slowmo, _ = parse_method(method)
    return base + ("-slowmo" if slowmo else "")


def run_args(
    method: str, settings: dict[str, Any], seed: int, args: argparse.Namespace, tau: int = 12
) -> list[str]:
    """The training script's flags for one run of ``method`` (e.g. ``"sgp-slowmo"``) and seed.

    Args:
        method: a base name, optionally with ``-slowmo``.
        settings: the method's ``lr``, ``buffers`` and, for SlowMo, ``slow_momentum``, optionally
            ``slow_lr`` and ``flags`` (:class:`TaskSpec`).
        seed: the run's seed.
        args: compare.py's flags.
        tau: the task's tau.
    """
    base, slowmo, overlap = parse_method(method)
    overlap = args.overlap if overlap is None else overlap
    flags = [
        "--algo",
        base,
        "--slowmo" if slowmo else "--no-slowmo",
        "--tau",
        str(tau),
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
        flags += ["--slow-lr", f"{settings.get('slow_lr', 1):g}"]
        flags += ["--slow-momentum", str(settings["slow_momentum"])]
        flags += list(settings.get("flags", ()))
        flags += ["--overlap", str(overlap)] if overlap else []
        flags += ["--fragments", str(args.fragments)] if args.fragments > 1 else []
        flags += ["--eager", args.eager] if args.eager else []
    return flags


class _ProgressBars:
    """A tqdm bar per run of a launch, driven by the runs' event lines (--progress-lines); each
    run's summary goes into ``summaries``, and one line is printed when it ends.

    The bars are drawn only on a terminal (stderr): in a log a bar's carriage returns make one
    endless line, so there the end-of-run lines are all that is written.

    Args:
        disable: no bars (the end-of-run lines are still printed).
        summaries: run name -> rank 0's summary, filled as runs end.
    """

    def __init__(self, disable: bool, summaries: dict[str, dict[str, Any]]) -> None:
        self.disable, self.summaries = disable or not sys.stderr.isatty(), summaries
        self.bar: Any | None = None

    def on_event(self, event: dict[str, Any]) -> None:
        from tqdm import tqdm

        if event["event"] == "start":
            self.bar = tqdm(
                total=event["epochs"],
                initial=event["start_epoch"],
                desc=f"{event['run']:<22}",
                unit="epoch",
                dynamic_ncols=True,
                leave=False,
                disable=self.disable,
            )
        elif event["event"] == "epoch" and self.bar is not None:
            self.bar.update(1)
            acc = event.get("val_accuracy")
            if acc is not None:
                loss = event.get("train_full_loss", float("nan"))
                self.bar.set_postfix(acc=f"{acc:.1f}%", loss=f"{loss:.4f}")
            elif event.get("val_loss") is not None:
                self.bar.set_postfix(val_loss=f"{event['val_loss']:.4f}")
        elif event["event"] == "end":
            s = event["summary"]
            self.summaries[s["run"]] = s
            self.close()
            loss = s.get("train_full_loss", s["train_loss"])
            metric = (
                f"val loss {s['val_loss']:.4f}"
                if s.get("val_accuracy") is None and s.get("val_loss") is not None
                else f"test acc {s.get('val_accuracy') or 0:.2f}%"
            )
            tqdm.write(
                f"{s['run']:<26} {s['wall_s']:6.1f} s   {metric}   train loss {loss:.4f}   "
                f"{s['ms_per_iter']:.1f} ms/iter" + ("   DIVERGED" if s.get("diverged") else "")
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def follow_progress(
    lines: Iterable[str], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], deque[str]]:
    """Read a launch's output (rank 0's): a progress bar per run from its progress lines, and a
    line per finished run.

    Args:
        lines: the output, line by line.
        args: compare.py's flags.

    Returns:
        (run name -> rank 0's summary, the last 60 other lines).
    """
    from tqdm import tqdm

    summaries: dict[str, dict[str, Any]] = {}
    tail: deque[str] = deque(maxlen=60)
    bars = _ProgressBars(args.no_progress, summaries)
    try:
        for line in lines:
            event = parse_event(line)  # launcher tags and what follows the JSON ignored
            if event is not None:
                bars.on_event(event)
                continue
            tail.append(line.rstrip("\n"))
            if args.verbose:
                tqdm.write(line.rstrip("\n"))
    finally:
        bars.close()
    return summaries, tail


def write_plan(folder: str, plan: list[list[str]]) -> str:
    """Save the runs' argument lists for the training script's ``--plan``; returns the path.

    Args:
        folder: where.
        plan: one argument list per run.
    """
    path = os.path.join(folder, "plan.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plan, f)
    return path


def launch(
    np_: int, script: str, plan: list[list[str]], common_flags: list[str], args: argparse.Namespace
) -> tuple[dict[str, dict[str, Any]], int, str]:
    """Train every run of ``plan`` in one launch (horovodrun or torchrun), a progress bar per run.

    Args:
        np_: workers.
        script: the training script.
        plan: one argument list per run.
        common_flags: flags for every run.
        args: compare.py's flags.

    Returns:
        (run name -> rank 0's summary, the launch's exit code, the tail of its output).
    """
    with tempfile.TemporaryDirectory() as tmp:
        cmd = (
            launch_command(np_, args.launcher)
            + [sys.executable, os.path.join(HERE, script)]
            + common_flags
            + ["--plan", write_plan(tmp, plan)]
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
        try:
            assert proc.stdout is not None
            summaries, tail = follow_progress(proc.stdout, args)
            proc.wait()
        except BaseException:  # Ctrl-C or SIGTERM: the workers are in another session: stop them
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            timer.cancel()
    if timed_out.is_set():
        tail.append(f"(stopped after --timeout {args.timeout:g} s)")
    return summaries, proc.returncode, "\n".join(tail)


def launch_network(
    cluster: Any,
    script: str,
    plan: list[list[str]],
    common_flags: list[str],
    args: argparse.Namespace,
) -> tuple[dict[str, dict[str, Any]], int, str]:
    """Train every run of ``plan`` in one launch on the emulated hosts: one worker per host
    (its own network namespace and shaped link), Horovod over Gloo.

    Args:
        cluster: a built :class:`slowmo_lab.netns.Cluster`.
        script: the training script.
        plan: one argument list per run.
        common_flags: flags for every run.
        args: compare.py's flags.

    Returns:
        (run name -> rank 0's summary, 0 or 1, the tail of rank 0's output and of the first
        failing worker's).
    """
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, os.path.join(HERE, script), *common_flags]
        argv += ["--plan", write_plan(tmp, plan)]
        logs = {h.rank: os.path.join(tmp, f"rank{h.rank}.log") for h in cluster.plan.hosts[1:]}
        files = {rank: open(path, "w", encoding="utf-8") for rank, path in logs.items()}

        def outputs(host: Any) -> dict[str, Any]:
            # Rank 0's output is followed; the others' is kept for an error message.
            if host.rank == 0:
                return {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
            return {"stdout": files[host.rank], "stderr": subprocess.STDOUT}

        errors: list[BaseException] = []

        def watch() -> None:
            try:
                cluster.wait_workers(args.timeout)
            except RuntimeError as e:  # a worker failed or the time ran out: all were stopped
                errors.append(e)

        try:
            with cluster.rendezvous() as port:
                workers = cluster.start_workers(argv, port, args.nice, outputs)
                watcher = threading.Thread(target=watch, daemon=True)
                watcher.start()
                summaries, tail = follow_progress(workers[0].stdout, args)
                watcher.join()
        finally:
            for f in files.values():
                f.close()
        if errors:
            tail.append(f"({errors[0]})")
            for rank, path in logs.items():
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = f.read().splitlines()
                if lines:
                    tail.append(f"-- rank {rank}, last lines:")
                    tail.extend(lines[-15:])
    return summaries, 1 if errors else 0, "\n".join(tail)


def results_table(
    methods: Sequence[str],
    settings: dict[str, dict[str, Any]],
    summaries: dict[str, dict[str, Any]],
    target: str = "val_accuracy",
) -> str:
    """compare.py's own table: per method, mean ± std over its seeds of the final metrics.

    Args:
        methods: the methods in order.
        settings: per method, its lr / beta / buffers.
        summaries: run name -> summary.
        target: the task's metric (:class:`TaskSpec`): test accuracy or validation loss.
    """
    metric, fmt = ("Test acc %", ".2f") if target == "val_accuracy" else ("Val loss", ".3f")
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
                f"{cfg['slow_momentum']:g}" if parse_algo(method)[1] else "-",
                cfg.get("buffers", "maintain"),
                str(len(runs)),
                report.fmt_mean_std(
                    [s.get("train_full_loss", s["train_loss"]) for s in runs], ".4f"
                ),
                report.fmt_mean_std([s.get(target) for s in runs], fmt),
                report.fmt_mean_std([s.get(f"best_{target}") for s in runs], fmt),
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
        f"{metric} (final)",
        f"{metric} (best)",
        "ms/iter",
        "Wall (s)",
    ]
    return report.text_table(headers, rows)


def network_setup(args: argparse.Namespace) -> tuple[str, float] | str:
    """The ``--network`` mode's link (rate, one-way delay in ms), or why it cannot run here.

    Args:
        args: compare.py's flags.
    """
    try:
        rate, delay_ms = parse_network(args.network)
    except ValueError as e:
        return str(e)
    if args.np < 2:
        return f"--network needs --np >= 2 (one emulated host per worker), got {args.np}"
    reason = missing_requirements()
    if reason:
        return f"--network emulates one host per worker with network namespaces: {reason}"
    if delay_ms > 0:
        ok, err = netem_available(args.netns_prefix)
        if not ok:
            return (
                f"--network {args.network}: a delay needs the kernel's netem queueing discipline "
                f"(sch_netem), and this kernel has none (tc: {err or 'netem refused'}). Here "
                f"only the rate can be emulated: use --network {rate}"
            )
    try:
        plan_cluster(args.np, args.netns_prefix, args.netns_subnet)
    except ValueError as e:
        return str(e)
    return rate, delay_ms


def print_time_to_target(
    methods: Sequence[str], runs: Sequence[report.Run], logdir: str, target: str = "val_accuracy"
) -> None:
    """The network mode's table of the runs, per method in ``methods``' order: the time to
    accuracy (``target="val_accuracy"``), or for a loss (``"val_loss"``, the language model)
    the loss at equal training seconds and the seconds to each method's final loss.

    Args:
        methods: the methods in order.
        runs: the runs' event files (named ``<method>/seed<k>``).
        logdir: where they are (for the message).
        target: the task's metric (:class:`TaskSpec`).
    """
    curves: dict[str, list[tta.Curve]] = {}
    for method in methods:
        mine = sorted(
            (r for r in runs if r.name.rsplit(os.sep, 1)[0] == method), key=lambda r: r.name
        )
        if mine:
            curves[method] = [tta.run_curve(r, TAGS[target]) for r in mine]
    finals = {m: [c[-1][1] if c else None for c in cs] for m, cs in curves.items()}
    clock = f"TensorBoard: {logdir}, time/train_s; its Relative axis is that clock"
    if target == "val_loss":
        print(
            "\nEqual training seconds: validation loss (nats per byte) of the averaged model at "
            "the shortest run's training time (each run's last evaluation by then), and the "
            "training seconds to first reach each method's mean final loss; mean ± std over the "
            f"seeds that reached it ({clock})"
        )
        print(tta.loss_table(curves, tta.loss_targets(finals), reference="allreduce"))
        return
    print(
        "\nTime to accuracy: training seconds (rank 0's iterations; evaluation excluded) at the "
        "first epoch end whose test accuracy reaches each target; mean ± std over the seeds "
        f"that reached it ({clock})"
    )
    targets = tta.default_targets(finals)
    print(tta.time_to_accuracy_table(curves, targets, reference="allreduce", speedup_at=90.0))


#: The regime map's recorded runs (docs/results/regimes.md), newest protocol first: compare.py
#: prints the clearest cell of the first that has a complete one.
REGIME_JSONLS = tuple(
    os.path.join(HERE, os.pardir, "docs", name)
    for name in ("regime_runs.jsonl", "regime_runs_untuned.jsonl")
)


def recorded_regime_cell(paths: Sequence[str] = REGIME_JSONLS) -> str | None:
    """The regime map's clearest cell (:func:`regime_map.clearest_cell`), read from the first
    of ``paths`` that holds a complete cell and labelled as recorded (with how its beta was
    chosen and the commands that reproduce it); None where none does.

    Args:
        paths: the driver's JSON-lines files, in order of preference.
    """
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        cell = regime_map.clearest_cell(rows)
        if cell is not None:
            break
    else:
        return None
    st = regime_map.cell_stats(rows)[cell]
    w, t = cell
    tuned = any(r["split"] == "validation" and (r["workers"], r["tau"]) == cell for r in rows)
    how = (
        "beta tuned on the validation split"
        if tuned
        else f"beta fixed at {st['beta']}, NOT tuned per cell"
    )
    if "peak_lr" not in rows[0]:  # the first round's rows: another lr rule, other flags
        again = "the first round's protocol: its commands are in docs/results/regimes.md"
    else:
        grid = "--betas 0.4,0.6,0.8" if tuned else f"--beta {st['beta']}"
        again = (
            f"python examples/regime_map.py run --out runs/regime.jsonl --cells {w}x{t} {grid} "
            f"--peak-lr {rows[0]['peak_lr']:g} --jobs 4 && "
            "python examples/regime_map.py report runs/regime.jsonl"
        )
    return (
        f"Recorded, not run now ({os.path.relpath(path)}; docs/results/regimes.md): the regime "
        "map's "
        f"cell where SlowMo's change is clearest, {w} workers x tau {t}, MNIST-1D test split, "
        f"{rows[0]['steps']} steps per worker, {len(st['seeds'])} paired seeds, {how} "
        "(accuracy %, mean ± std; paired t-tests over seeds):\n"
        + regime_map.TABLE_HEAD
        + "\n"
        + regime_map.table_row(cell, st)
        + f"\nReproduce (about 24 training runs): {again}"
    )


#: The language model's recorded runs (docs/results/regimes.md): compare.py prints their table too.
LM_JSONL = os.path.join(HERE, os.pardir, "docs", "regime_lm_runs.jsonl")


def recorded_lm_table(path: str = LM_JSONL) -> str | None:
    """The language model's recorded table (:func:`regime_map.lm_table`) at the outer setting
    its tuning chose (:func:`regime_map.lm_tuning`; DiLoCo's where none was tuned), labelled as
    recorded, with the command that shows every row; None where ``path`` does not exist.

    Args:
        path: ``regime_map.py lm``'s JSON lines.
    """
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    chosen = regime_map.lm_tuning(rows)[1]
    outer = next(iter(chosen.values()), regime_map.DILOCO_OUTER)
    how = "tuned on seeds 100-102" if chosen else "DiLoCo's, not tuned"
    return (
        f"Recorded, not run now ({os.path.relpath(path)}; docs/results/regimes.md): the byte-level "
        "language model (AdamW inside, 4 workers, 512 steps), validation loss in nats per byte, "
        f"SlowMo's outer Nesterov {outer[0]:g}/{outer[1]:g} ({how}); paired t-tests over "
        "seeds:\n"
        + regime_map.lm_table(rows, outer)
        + "\nEvery row and the tuning: python examples/regime_map.py lm-report "
        + os.path.relpath(path)
    )


def _parser() -> argparse.ArgumentParser:
    """compare.py's command line."""
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
        "--tau",
        type=int,
        default=None,
        help="every method's tau (default: the task's, 12; char_lm 64)",
    )
    parser.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="SlowMo runs: base steps the exact average stays in flight (a method named "
        "...-slowmo-overlapD sets its own)",
    )
    parser.add_argument(
        "--algos",
        default=None,
        help=f"comma-separated (default: {DEFAULT_ALGOS}; with --network: {NETWORK_ALGOS})",
    )
    parser.add_argument(
        "--fragments", type=int, default=1, help="SlowMo runs: streaming fragments (1: none)"
    )
    parser.add_argument(
        "--eager",
        nargs="?",
        const="shares",
        default=None,
        choices=("shares", "local"),
        help="SlowMo runs: eager updates (needs --overlap); 'shares' (no value: the paper's "
        "estimate) or 'local' (the own outer gradient)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="every method's lr instead of its tuned one (e.g. a table's earlier settings)",
    )
    parser.add_argument(
        "--slow-momentum",
        type=float,
        default=None,
        help="every SlowMo method's beta instead of its tuned one",
    )
    parser.add_argument(
        "--seeds", default=None, help="comma-separated (default 0,1,2; --quick 0; --full 0..4)"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="default: the task's (mnist1d: 30; --quick 12)"
    )
    parser.add_argument(
        "--logdir",
        default="runs",
        help="TensorBoard runs go to LOGDIR/TASK/<method>/seed<k>/ (with --network: "
        "LOGDIR/TASK-network-RATE[-DELAY]/...)",
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="auto",
        help="horovodrun --gloo/--mpi or torchrun (auto: horovodrun where Horovod is installed)",
    )
    parser.add_argument(
        "--network",
        default=None,
        metavar="RATE[,DELAY]",
        help="run every worker in its own emulated host (network namespace, veth, bridge) whose "
        "link is limited to RATE (e.g. 100mbit) in both directions, DELAY (e.g. 20ms: one way, "
        "host to host; needs the kernel's netem) added; prints the time to accuracy. Needs "
        "root and `ip netns`",
    )
    parser.add_argument(
        "--netns-prefix", default="hsmn", help="--network: prefix of its namespaces and links"
    )
    parser.add_argument(
        "--netns-subnet", default="10.77.2", help="--network: a free /24 for its hosts"
    )
    parser.add_argument(
        "--nice", type=int, default=0, help="--network: the workers' scheduling priority"
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole launch")
    parser.add_argument(
        "--png", default=None, help="figure path (default: LOGDIR/TASK/compare.png)"
    )
    parser.add_argument("--verbose", action="store_true", help="show the training logs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_straggler_args(parser)
    return parser


def unequal_flags(args: argparse.Namespace) -> list[str]:
    """The training script's flags of an emulated straggler, checked (a ``ValueError`` naming
    the flag): ``[]`` when none is set.

    Args:
        args: compare.py's flags.
    """
    flags = straggler_flags(args)
    if flags and not -args.np <= args.straggler_rank < args.np:
        raise ValueError(
            f"--straggler-rank must be in [-{args.np}, {args.np - 1}] for --np {args.np}, got "
            f"{args.straggler_rank}"
        )
    return flags


def unequal_suffix(args: argparse.Namespace) -> str:
    """The log folder's suffix of an emulated straggler (``-slow2x``, ``-pause3at4``, ``-r1``).

    Args:
        args: compare.py's flags.
    """
    suffix = f"-slow{args.slow_factor:g}x" if args.slow_factor != 1.0 else ""
    suffix += f"-pause{args.pause_periods:g}at{args.pause_at}" if args.pause_at else ""
    return suffix + (f"-r{args.straggler_rank}" if args.straggler_rank != -1 else "")


def _runnable_methods(algos: str, settings: dict[str, Any], task: str) -> list[str]:
    """The requested methods whose base is registered (the others are named and skipped).

    Args:
        algos: the comma-separated methods.
        settings: the task's tuned settings.
        task: the task's name, for messages.
    """
    methods = [m.strip() for m in algos.split(",") if m.strip()]
    if not methods:
        raise ValueError("--algos is empty; e.g. --algos allreduce,localsgd")
    for m in methods:
        parse_method(m)
        if settings_key(m) not in settings:
            raise ValueError(
                f"--algos: no tuned settings for {settings_key(m)!r} on {task} (have: "
                f"{', '.join(settings)})"
            )
    runnable = [m for m in methods if parse_algo(m)[0] in hvd_slowmo.BASES]
    for m in sorted(set(methods) - set(runnable)):
        print(
            f"skipping {m}: base {parse_algo(m)[0]!r} is not registered in hvd_slowmo.BASES",
            flush=True,
        )
    return runnable


def _train_all(
    args: argparse.Namespace,
    network: tuple[str, float] | None,
    script: str,
    plan: list[list[str]],
    common_flags: list[str],
) -> tuple[dict[str, dict[str, Any]], int, str]:
    """Train every run of ``plan``: in one horovodrun launch, or on emulated hosts.

    Returns:
        (run name -> rank 0's summary, the exit code, the tail of the output).
    """
    if not plan:
        return {}, 0, ""
    elif network:
        cluster = Cluster(plan_cluster(args.np, args.netns_prefix, args.netns_subnet))
        try:
            stale = cluster.clean_stale()
            if stale:
                print(f"removed leftovers of an earlier run: {stale}", flush=True)
            cluster.build(*network)
            return launch_network(cluster, script, plan, common_flags, args)
        finally:
            cluster.teardown()
    else:
        return launch(args.np, script, plan, common_flags, args)


def _print_reports(
    summaries: dict[str, dict[str, Any]],
    runnable: list[str],
    logdir: str,
    seconds: bool,
    png: str | None,
    target: str = "val_accuracy",
) -> None:
    """The paper's tables, the time to the target (network mode) and the figure."""
    names = [name for name in summaries if os.path.isdir(os.path.join(logdir, name))]
    if names:
        runs = report.load_runs([os.path.join(logdir, n) for n in names], relative_to=logdir)
        if seconds:
            print_time_to_target(runnable, runs, logdir, target)
        print()
        print(report.table1(runs))
        print()
        print(report.table2(runs))
        png = report.plot(
            runs,
            png or os.path.join(logdir, "compare.png"),
            extra_panel=partial(tta.seconds_panel, tag=TAGS[target]) if seconds else None,
        )
        print(f"\nFigure: {png}   (per-run details: python -m slowmo_lab.report {logdir})")


def main(argv: list[str] | None = None) -> int:
    """Run every requested method and seed, print the rows and the report.

    Args:
        argv: arguments (default: sys.argv[1:]); unknown ones go to the training script.
    """
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.np < 1:
        raise ValueError(f"--np must be >= 1, got {args.np}")
    unequal = unequal_flags(args)  # checked here, before any launch
    network: tuple[str, float] | None = None
    if args.network is not None:
        setup = network_setup(args)
        if isinstance(setup, str):
            print(f"compare.py: {setup}", file=sys.stderr)
            return 2
        network = setup
    mode_name = "quick" if args.quick else "full" if args.full else "default"
    spec = TASKS[args.task]
    settings = spec.settings
    epochs = args.epochs if args.epochs is not None else spec.epochs[mode_name]
    tau = args.tau if args.tau is not None else spec.tau
    if tau < 1:
        raise ValueError(f"--tau must be >= 1, got {tau}")
    algos = args.algos or spec.algos["full" if args.full else "network" if network else "default"]
    seeds = [int(s) for s in (args.seeds or SEEDS[mode_name]).split(",") if s.strip()]
    runnable = _runnable_methods(algos, settings, args.task)
    chosen = {"lr": args.lr, "slow_momentum": args.slow_momentum}
    method_settings = {
        m: {**settings[settings_key(m)], **{k: v for k, v in chosen.items() if v is not None}}
        for m in runnable
    }

    # SIGTERM becomes SystemExit, so launch() stops the workers (and --network removes its
    # hosts) before exiting.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    t_all = time.perf_counter()
    folder = args.task
    if network:
        folder += f"-network-{network[0]}" + (f"-{network[1]:g}ms" if network[1] else "")
    folder += unequal_suffix(args) if unequal else ""  # slowed runs never overlay plain ones
    logdir = os.path.join(args.logdir, folder)
    plan = [run_args(m, method_settings[m], seed, args, tau) for m in runnable for seed in seeds]
    common_flags = [
        *spec.flags,
        "--epochs",
        str(epochs),
        "--logdir",
        logdir,
        "--no-progress",
        "--progress-lines",
        *unequal,
    ] + extra
    launcher_name = "torchrun" if resolve_launcher(args.launcher) == "torchrun" else "horovodrun"
    where = (
        f"{args.np} emulated hosts, links {args.network} each way"
        if network
        else f"one {launcher_name} launch"
    )
    print(
        f"{args.task}: {len(plan)} runs ({len(runnable)} methods x {len(seeds)} seeds), "
        f"{args.np} workers, {epochs} epochs, tau {tau}, {where}",
        flush=True,
    )
    summaries, rc, tail = _train_all(args, network, spec.script, plan, common_flags)
    failed = len(plan) - len(summaries)
    if rc != 0 or failed:
        print(
            f"\nthe launch exited with {rc}; {failed} of {len(plan)} runs did not finish. Its "
            f"last lines:\n{tail}",
            flush=True,
        )

    print(
        f"\n{args.task}, {args.np} workers, {epochs} epochs, seeds {','.join(map(str, seeds))}"
        + (f", links {args.network}" if network else "")
        + ": the averaged model at the last epoch's end (mean ± std over seeds; sample std)"
    )
    print(results_table(runnable, method_settings, summaries, spec.target))
    _print_reports(summaries, runnable, logdir, network is not None, args.png, spec.target)
    if args.task == "mnist1d" and not network:
        for recorded in (recorded_regime_cell(), recorded_lm_table()):
            if recorded:
                print("\n" + recorded)
    print(f"Total wall time: {time.perf_counter() - t_all:.1f} s")
    return 1 if rc != 0 or failed or not summaries else 0


if __name__ == "__main__":
    sys.exit(main())
