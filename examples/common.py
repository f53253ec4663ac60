"""Pieces shared by the example training scripts: the algorithm flags, building the SlowMo
optimizer from them, learning-rate schedules, the AMP step, checkpoints, rank-0 logging, the
evaluation of the workers' averaged model, and the one training loop every example runs.

The examples import it as ``from common import ...`` (Python puts the script's folder on the
path). Paper: arXiv 1910.00643.
"""

import argparse
import functools
import glob
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# Run from a checkout without installing: the package sits one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import Job, ThreadJob, init_job, run_in_threads

# The machine-readable event lines (--progress-lines) and the log check built on them.
from run_log import PROGRESS_MARK, event_line, parse_event
from unequal import (
    EmulatedClock,
    Straggler,
    add_straggler_args,
    emulated_seconds,
    outer_driven,
    policy_options,
    policy_summary,
    schedule_step,
    straggler_from_args,
    straggler_summary,
)

import hvd_slowmo
from slowmo_lab.metrics import CONFIG_FILE, TrainingMonitor

__all__ = [
    "ALGOS",
    "PROGRESS_MARK",
    "parse_event",
    "add_common_args",
    "describe",
    "setup",
    "build_optimizer",
    "IslandLayout",
    "shard_islands",
    "run_name",
    "run_config",
    "make_monitor",
    "warmup_multistep",
    "inverse_sqrt",
    "resume_schedule",
    "backward_and_step",
    "autocast",
    "make_scaler",
    "allreduce_sums",
    "save_checkpoint",
    "load_checkpoint",
    "progress",
    "log0",
    "write_summary",
    "OuterStepEpochs",
    "classifier_metrics",
    "Task",
    "train",
    "train_classifier",
    "run_cli",
]

#: Base algorithms selectable with --algo: every registered one (a base registered in
#: hvd_slowmo.BASES appears here, in compare.py and in the sweep tool).
ALGOS = tuple(hvd_slowmo.BASES)


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    tau: int,
    slow_momentum: float,
    buffers: str,
    epochs: int,
    batch_size: int,
    lr: float,
    data_flags: bool = True,
    eval_train_loss: bool = False,
) -> None:
    """Add the flags every example shares (algorithm, SlowMo, logging, checkpoints, AMP).

    Args:
        parser: the example's parser.
        tau: default inner steps per outer step.
        slow_momentum: default beta.
        buffers: default base-buffer strategy (reset for SGD, maintain for Adam, as in the paper).
        epochs: default number of epochs.
        batch_size: default batch size per worker.
        lr: default learning rate (see each example for its scaling).
        data_flags: add --synthetic/--data/--download/--workers (examples with a dataset to fetch).
        eval_train_loss: default of --eval-train-loss (on for the small in-memory datasets; a
            pass over ImageNet's training set every epoch would cost as much as training).
    """
    g = parser.add_argument_group("algorithm (arXiv 1910.00643)")
    g.add_argument("--algo", default="localsgd", choices=ALGOS, help="base algorithm")
    g.add_argument(
        "--slowmo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="SlowMo on top of the base (--no-slowmo: the base alone: allreduce every "
        "step, Local SGD's plain average every tau steps, gossip without exact "
        "average)",
    )
    g.add_argument("--tau", type=int, default=tau, help="base steps per outer step")
    g.add_argument("--slow-lr", type=float, default=1.0, help="alpha")
    g.add_argument("--slow-momentum", type=float, default=slow_momentum, help="beta")
    g.add_argument(
        "--buffers",
        default=buffers,
        choices=("reset", "maintain", "average"),
        help="base optimizer buffers at each outer step",
    )
    g.add_argument(
        "--overlap",
        type=int,
        default=0,
        help="base steps the exact average stays in flight (0: the paper's algorithm)",
    )
    g.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="streaming SlowMo: outer steps of P fragments at P phases of tau (1: whole model)",
    )
    g.add_argument(
        "--eager",
        nargs="?",
        const="shares",
        default=None,
        choices=("shares", "local"),
        help="eager updates while the average is in flight (needs --overlap >= 1): 'shares' "
        "(the default with no value; the paper's estimate) or 'local' (the own outer gradient); "
        "passed as the optimizer's eager=",
    )
    g.add_argument(
        "--mix",
        type=float,
        default=0.0,
        help="Streaming DiLoCo's mixing factor in [0, 1) at each overlapped landing (needs "
        "--overlap >= 1; 0: no mixing); passed as the optimizer's mix=",
    )
    g.add_argument(
        "--no-average",
        action="store_true",
        help="skip the exact average (SGP-SlowMo-noaverage; gossip bases only)",
    )
    g.add_argument(
        "--codec",
        "--compression",  # its old name
        dest="codec",
        default="none",
        choices=("none", "fp16", "bf16", "int8", "fp8", "sparse", "sparse-owners"),
        help="the optimizer's codec=: codes of the exact average's pseudo-gradients (none: the "
        "fp32 allreduce; sparse: SparseCodec()'s all-gather, sparse-owners: the same codec "
        "reduced at owners, SparseCodec(exchange='owners'); both need --error-feedback)",
    )
    g.add_argument(
        "--error-feedback",
        action="store_true",
        help="with --codec: each worker sends what its codes lost at the next average",
    )
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=epochs)
    t.add_argument("--batch-size", type=int, default=batch_size, help="per worker")
    t.add_argument("--lr", type=float, default=lr)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--epoch-steps",
        type=int,
        default=0,
        help="steps per epoch whatever tau is (equal steps and samples across settings; an "
        "epoch, and the run, may then end inside an outer step: evaluated on the workers' "
        "average). 0: the multiple of tau closest to one pass over the data (in-memory "
        "examples)",
    )
    t.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many steps per epoch (0: no limit)",
    )
    t.add_argument(
        "--eval-train-loss",
        action=argparse.BooleanOptionalAction,
        default=eval_train_loss,
        help="each epoch, also score the averaged model on the whole training set",
    )
    t.add_argument(
        "--amp",
        action="store_true",
        help="mixed precision: fp16 autocast + GradScaler on CUDA, bf16 autocast on CPU",
    )
    if data_flags:
        t.add_argument(
            "--synthetic",
            action="store_true",
            help="random tensors and a tiny model (seconds on a CPU)",
        )
        t.add_argument("--data", default="data", help="dataset folder")
        t.add_argument(
            "--download",
            action="store_true",
            help="download the dataset into --data (needs network)",
        )
        t.add_argument("--workers", type=int, default=2, help="data-loader processes per rank")
    o = parser.add_argument_group("logging and checkpoints")
    o.add_argument("--logdir", default="runs", help="TensorBoard runs go to LOGDIR/<run name>/")
    o.add_argument(
        "--run-name", default=None, help="default: encodes algo, slowmo, tau, alpha, beta, buffers"
    )
    o.add_argument(
        "--log-every", type=int, default=20, help="steps between TensorBoard training points"
    )
    o.add_argument("--checkpoint", default=None, help="save here at the end of every epoch")
    o.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    o.add_argument("--summary-json", default=None, help="rank 0 writes the final metrics here")
    o.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    o.add_argument(
        "--progress-lines",
        action="store_true",
        help=f"rank 0 prints a line starting {PROGRESS_MARK.strip()!r} + JSON at the "
        "start of the run, after each epoch and at the end (for a launcher that "
        "draws its own progress bars)",
    )
    o.add_argument(
        "--progress-file",
        default=None,
        help="rank 0 appends the same event lines to this file (a check reads them there, "
        "whatever a launcher does to the interleaved output)",
    )
    add_straggler_args(parser)


def setup(args: argparse.Namespace) -> tuple[Job, torch.device]:
    """Initialize the launcher's engine (``torchrun``: torch.distributed, ``horovodrun``:
    Horovod; :mod:`launch`), pick the device (one GPU per local rank), seed, and keep CPU
    threads from oversubscribing the cores (several ranks share one machine).

    Args:
        args: the parsed flags.

    Returns:
        ``(hvd, device)``: ``hvd`` is the :class:`launch.Job`, which answers the
        ``horovod.torch`` calls the examples make (``rank()``, ``size()``, ``allreduce``, ...)
        under either launcher.
    """
    hvd = init_job()
    if args.tau < 1:
        raise ValueError(f"--tau must be >= 1, got {args.tau}")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        # The local ranks share the cores: a share each. Emulated hosts (slowmo_lab.netns)
        # share them too but each sees local_size 1; their launcher sets OMP_NUM_THREADS (torch
        # read it at import), which is kept: two threads per worker spin against each other.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(hvd.local_size(), 1)))
    if isinstance(hvd, ThreadJob):
        hvd.seed_turn()  # the threads share torch's generator: one at a time until the broadcast
    # Same seed everywhere: identical initial models (broadcast below makes sure anyway).
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    return hvd, device


def build_optimizer(
    base_optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    args: argparse.Namespace,
    communicator: Any = None,
    worker: "hvd_slowmo.Islands | None" = None,
    clock: Callable[[], float] | None = None,
) -> hvd_slowmo.DistributedOptimizer:
    """Wrap ``base_optimizer`` as the algorithm the flags name.

    Without SlowMo the base runs alone: allreduce with its momentum kept; Local SGD with a plain
    average every ``tau`` steps (alpha=1, beta=0); gossip bases without any exact average.

    Args:
        base_optimizer: SGD/Adam over ``model.parameters()``.
        model: the model (its buffers, e.g. BatchNorm statistics, are averaged with the parameters).
        args: the parsed flags.
        communicator: the workers' communicator (None: the launcher's engine, chosen by the
            optimizer; a :class:`launch.ThreadJob` passes its thread communicator).
        worker: the islands (:func:`shard_islands`), or None: one process is one worker.
        clock: the clock of time-based periods (``--emulated-step``: the worker's
            :class:`unequal.EmulatedClock`), or None: real time.
    """
    if args.algo not in hvd_slowmo.BASES:
        raise ValueError(
            f"--algo {args.algo}: this hvd_slowmo has no such base (registered: "
            f"{sorted(hvd_slowmo.BASES)})"
        )
    kwargs: dict[str, Any] = dict(
        base=args.algo,
        tau=args.tau,
        buffers=args.buffers,
        average=not args.no_average,
        slow_lr=args.slow_lr,
        slow_momentum=args.slow_momentum,
        overlap=args.overlap,
        fragments=args.fragments,
        eager=args.eager,
        mix=args.mix,
    )
    if args.codec != "none":
        codec = {
            "sparse": hvd_slowmo.SparseCodec(),
            "sparse-owners": hvd_slowmo.SparseCodec(exchange="owners"),
        }.get(args.codec, args.codec)
        kwargs.update(codec=codec, error_feedback=args.error_feedback)
    if not args.slowmo:
        kwargs.update(slow_lr=1.0, slow_momentum=0.0)
        if args.algo != "localsgd":
            # The base alone never has an outer step: keep the local buffers, no exact average.
            kwargs.update(buffers="maintain", average=args.algo == "allreduce")
    elif args.algo == "allreduce" and args.buffers == "average":
        kwargs.update(buffers="maintain")  # identical on every worker already
    if args.slowmo and getattr(args, "outer_optimizer", "heavyball") != "heavyball":
        kwargs.update(outer_optimizer=args.outer_optimizer)  # e.g. DiLoCo's Nesterov
    kwargs.update(policy_options(args))  # time-based periods, weighted merge, quorum
    if communicator is not None:
        kwargs.update(communicator=communicator)
    if worker is not None:
        kwargs.update(worker=worker)
    if clock is not None:
        kwargs.update(clock=clock)
    return hvd_slowmo.DistributedOptimizer(
        base_optimizer,
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        **kwargs,
    )


@dataclass
class IslandLayout:
    """This rank's place with ``--islands N`` (:func:`shard_islands`): the job is ``N`` islands of
    ``ranks`` ranks; each island trains one model (sharded with FSDP2 or replicated with DDP over
    its ranks) and is one SlowMo worker (docs/islands.md).

    Attributes:
        worker: the optimizer's ``worker=``.
        module: what the forward pass calls: the model itself (FSDP2 shards it in place) or its
            DDP wrapper.
        count: the number of islands.
        index: this rank's island.
        ranks: ranks per island.
        inner_rank: this rank's place inside its island.
        inner: ``"fsdp"`` or ``"ddp"``.
    """

    worker: hvd_slowmo.Islands
    module: torch.nn.Module
    count: int
    index: int
    ranks: int
    inner_rank: int
    inner: str

    def summary(self) -> dict[str, Any]:
        """What the run's summary records of the layout."""
        return {"islands": self.count, "ranks_per_island": self.ranks, "islands_inner": self.inner}

    def describe(self) -> str:
        """The layout, for rank 0's log."""
        return f"{self.count} islands x {self.ranks} ranks ({self.inner})"

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of its island's batch of ``batch_size`` (the island's ranks train on
        different data: data parallelism inside the island).

        Args:
            batch_size: the island's batch (checked by :func:`shard_islands` to divide evenly).
        """
        per_rank = batch_size // self.ranks
        return slice(self.inner_rank * per_rank, (self.inner_rank + 1) * per_rank)


def shard_islands(
    model: torch.nn.Module,
    args: argparse.Namespace,
    hvd: Job,
    device: torch.device,
    blocks: Iterable[torch.nn.Module],
) -> IslandLayout:
    """Split the job into ``args.islands`` islands: a 2-D ``DeviceMesh`` (islands x ranks per
    island, dimensions ``("islands", "shard")``), the model sharded with FSDP2 inside each island
    (``fully_shard`` on the ``"shard"`` dimension: each block, then the root) or, with
    ``args.islands_inner == "ddp"``, replicated with DDP over the island's ranks. Call before
    building the base optimizer (FSDP2 replaces the parameters with DTensors).

    Every rank first takes rank 0's initial model, so all islands start alike.

    Args:
        model: the whole model, on ``device``, the same on every rank.
        args: the parsed flags (``islands``, ``islands_inner``, ``batch_size``, ``checkpoint``,
            ``resume``).
        hvd: the job (:class:`launch.Job`, from :func:`setup`): a torchrun job.
        device: the training device (the mesh's device type).
        blocks: the modules FSDP2 shards (and all-gathers) one at a time, e.g. the transformer
            layers; the root holds the rest.

    Raises:
        ValueError: a launcher other than torchrun, ``--islands`` that does not divide the world
            size, ``--batch-size`` (per island) that does not divide among an island's ranks,
            or ``--checkpoint``/``--resume`` (the examples' checkpoint is one file written by
            rank 0; an island's shards need one file per rank: see docs/islands.md).
    """
    from torch.distributed.device_mesh import init_device_mesh

    size = hvd.size()
    if hvd.engine != "torch":
        raise ValueError(
            f"--islands {args.islands} needs torch.distributed (torchrun --nproc-per-node N ...), "
            f"this job runs on {hvd.engine!r}; under horovodrun use the optimizer's worker='node' "
            "(replicated models only)"
        )
    if args.islands < 1 or size % args.islands:
        raise ValueError(
            f"--islands {args.islands} must divide the world size {size} (islands x ranks per "
            f"island = world size); pick one of "
            f"{[n for n in range(1, size + 1) if size % n == 0]}"
        )
    if args.checkpoint or args.resume:
        raise ValueError(
            "--checkpoint/--resume with --islands: this example writes one checkpoint on rank 0, "
            "while each rank of an island holds its own shard; save one file per rank as "
            "docs/islands.md shows, or drop --checkpoint"
        )
    ranks = size // args.islands
    if args.batch_size % ranks:
        raise ValueError(
            f"--batch-size {args.batch_size} is per island with --islands: it must divide "
            f"among the island's {ranks} ranks"
        )
    mesh = init_device_mesh(device.type, (args.islands, ranks), mesh_dim_names=("islands", "shard"))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # before sharding: whole tensors
    module: torch.nn.Module = model
    if args.islands_inner == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
    else:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(
            model,
            process_group=mesh.get_group("shard"),
            device_ids=[device.index] if device.type == "cuda" else None,
        )
    return IslandLayout(
        worker=hvd_slowmo.Islands(mesh, across="islands"),
        module=module,
        count=args.islands,
        index=mesh.get_local_rank("islands"),
        ranks=ranks,
        inner_rank=mesh.get_local_rank("shard"),
        inner=args.islands_inner,
    )


def describe(opt: hvd_slowmo.DistributedOptimizer) -> str:
    """One line naming the algorithm and its SlowMo settings (for rank 0's log).

    Args:
        opt: the distributed optimizer.
    """
    return (
        f"base={opt.base_name} tau={opt.tau} slow_lr={opt.slow_lr:g} "
        f"slow_momentum={opt.slow_momentum:g} buffers={opt.buffers} average={opt.average} "
        f"optimizer={type(opt.optimizer).__name__}"
    )


def run_name(args: argparse.Namespace) -> str:
    """The TensorBoard run name: algorithm, SlowMo, tau, alpha, beta, buffers, the options and
    the unequal workers' policies (so runs of other settings never overlay)."""
    if args.run_name:
        return args.run_name
    period, quorum = getattr(args, "period_seconds", None), getattr(args, "quorum", 0)
    policies = (
        (f"_period{period}" if period is not None else "")
        + ("_weighted" if getattr(args, "merge", "mean") == "samples" else "")
        + (f"_quorum{quorum}" if quorum else "")
    )
    if not args.slowmo:
        return f"{args.algo}" + (f"_tau{args.tau}" if args.algo == "localsgd" else "") + policies
    tag = "-slowmo-noavg" if args.no_average else "-slowmo"
    return (
        f"{args.algo}{tag}_tau{args.tau}_a{args.slow_lr:g}_b{args.slow_momentum:g}"
        f"_{args.buffers}"
        + (f"_overlap{args.overlap}" if args.overlap else "")
        + ("" if args.codec == "none" else f"_{args.codec}")
        + ("_ef" if args.error_feedback else "")
        + (f"_fragments{args.fragments}" if args.fragments > 1 else "")
        + ({None: "", "shares": "_eager", "local": "_eager-local"}[args.eager])
        + (f"_mix{args.mix:g}" if args.mix else "")
        + policies
    )


def run_config(
    args: argparse.Namespace, task: str, optimizer_name: str, world_size: int
) -> dict[str, Any]:
    """What ``config.json`` records (the report groups runs by ``algo`` and ``slowmo``, and treats
    runs whose configurations differ only in ``seed`` as repeats of one setting).

    Args:
        args: the parsed flags.
        task: e.g. ``"cifar10_resnet18"``.
        optimizer_name: ``"sgd"`` or ``"adam"``.
        world_size: number of workers.
    """
    return {
        "task": task,
        "algo": args.algo,
        "slowmo": bool(args.slowmo),
        "tau": args.tau,
        "slow_lr": args.slow_lr if args.slowmo else 1.0,
        "slow_momentum": args.slow_momentum if args.slowmo else 0.0,
        "buffers": args.buffers,
        "average": not args.no_average,
        "codec": args.codec,
        "error_feedback": args.error_feedback,
        # Streaming settings: runs that differ only in these are different settings, not repeats.
        "overlap": args.overlap,
        "fragments": args.fragments,
        "eager": args.eager,
        "mix": args.mix,
        "optimizer": optimizer_name,
        "workers": world_size,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "epochs": args.epochs,
        "seed": args.seed,
        "amp": args.amp,
        "synthetic": getattr(args, "synthetic", False),
    }


def make_monitor(
    opt: hvd_slowmo.DistributedOptimizer,
    args: argparse.Namespace,
    config: dict[str, Any],
    device: torch.device,
    rank: int | None = None,
) -> TrainingMonitor:
    """The TensorBoard monitor for ``LOGDIR/<run name>``; a fresh run (not --resume) first
    removes that run's old event files so TensorBoard does not mix two runs.

    Args:
        opt: the distributed optimizer.
        args: the parsed flags.
        config: from :func:`run_config`.
        device: the training device.
        rank: this process's rank in the job (default: the optimizer's among its workers); only
            rank 0 writes. With islands every rank of the first island is rank 0 of its shard's
            workers, so the job's rank is passed.
    """
    logdir = os.path.join(args.logdir, run_name(args))
    rank = opt.comm.rank if rank is None else rank
    if rank == 0 and not args.resume:
        old_files = glob.glob(os.path.join(logdir, "events.out.tfevents.*"))
        for old in old_files + [os.path.join(logdir, CONFIG_FILE)]:
            if os.path.exists(old):
                os.remove(old)
    # The consensus distance is a collective before each outer step: with unequal step counts
    # (time-based periods, a quorum) the workers do not reach it together.
    return TrainingMonitor(
        opt,
        logdir if rank == 0 else None,
        config,
        device=device,
        measure_consensus=not outer_driven(args),
    )


def warmup_multistep(
    step: int,
    steps_per_epoch: int,
    warmup_epochs: float,
    milestones: Sequence[int],
    gamma: float = 0.1,
) -> float:
    """Goyal et al.'s schedule as a factor of the peak lr: linear warm-up, then decay by
    ``gamma`` at each milestone epoch.

    Args:
        step: the global step (0-based).
        steps_per_epoch: steps in one epoch.
        warmup_epochs: epochs of linear warm-up (from 1/warmup_steps of the peak).
        milestones: epochs where the lr is multiplied by ``gamma``.
        gamma: the decay factor.
    """
    epoch = step / steps_per_epoch
    warmup_steps = warmup_epochs * steps_per_epoch
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return gamma ** sum(1 for m in milestones if epoch >= m)


def inverse_sqrt(step: int, warmup_steps: int) -> float:
    """Vaswani et al./Ott et al.'s schedule as a factor of the peak lr: linear warm-up for
    ``warmup_steps``, then proportional to ``1/sqrt(step)``.

    Args:
        step: the global step (0-based).
        warmup_steps: warm-up length (4000 in the paper).
    """
    s = step + 1
    return s / warmup_steps if s < warmup_steps else math.sqrt(warmup_steps / s)


def resume_schedule(sched: torch.optim.lr_scheduler.LambdaLR, step: float) -> None:
    """Put a per-step LambdaLR at ``step`` after a resume (without stepping it, which would warn
    that the scheduler ran before the optimizer), or at a fractional step (the cluster's
    progress with unequal step counts: :func:`unequal.schedule_step`).

    Args:
        sched: the schedule over the base optimizer.
        step: the global step to continue from.
    """
    sched.last_epoch = step
    groups = sched.optimizer.param_groups
    for group, base_lr, factor in zip(groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base_lr * factor(step)


def autocast(args: argparse.Namespace, device: torch.device) -> Any:
    """The autocast context for --amp (fp16 on CUDA, bf16 on CPU), else a no-op context.

    Args:
        args: the parsed flags.
        device: the training device.
    """
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    if getattr(args, "amp_dtype", "auto") == "bf16":
        dtype = torch.bfloat16  # no loss scaling needed (see make_scaler)
    return torch.autocast(device.type, dtype=dtype, enabled=args.amp)


def make_scaler(args: argparse.Namespace, device: torch.device) -> torch.amp.GradScaler | None:
    """A GradScaler for --amp on CUDA (fp16 needs loss scaling); None otherwise (bf16 does not).

    Args:
        args: the parsed flags.
        device: the training device.
    """
    fp16 = args.amp and device.type == "cuda" and getattr(args, "amp_dtype", "auto") != "bf16"
    return torch.amp.GradScaler("cuda") if fp16 else None


def backward_and_step(
    loss: torch.Tensor,
    opt: hvd_slowmo.DistributedOptimizer,
    scaler: torch.amp.GradScaler | None,
    monitor: TrainingMonitor,
    hvd: Any,
) -> None:
    """Backward and one optimizer step, with Horovod's GradScaler recipe when ``scaler`` is set.

    With a scaler, all workers must agree on skipping a step: a local method whose workers skip
    different steps would reach its exact average at different times and deadlock. So the
    overflow flag is OR-ed across workers (one scalar allreduce) before stepping.

    Args:
        loss: the loss of this worker's batch.
        opt: the distributed optimizer.
        scaler: the GradScaler or None.
        monitor: the run's monitor (its consensus measurement must precede the step).
        hvd: the job (:class:`launch.Job`, from :func:`setup`).
    """
    opt.zero_grad()
    if scaler is None:
        loss.backward()
        monitor.before_step()
        opt.step()
        return
    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    bad = torch.tensor([0.0 if all(torch.isfinite(gr).all() for gr in grads) else 1.0])
    bad = hvd.allreduce(bad, op=hvd.Sum, name="examples.amp_overflow")
    if bad.item() > 0:
        # Skip everywhere and back the scale off, as GradScaler does for a local overflow.
        opt.zero_grad()
        scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
        return
    monitor.before_step()
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()


def allreduce_sums(values: Sequence[float], hvd: Any, name: str) -> list[float]:
    """Sum a few floats over all workers (validation counts and losses).

    Args:
        values: this worker's partial sums.
        hvd: the job (:class:`launch.Job`, from :func:`setup`).
        name: a unique Horovod tensor name.
    """
    t = hvd.allreduce(torch.tensor(list(values), dtype=torch.float64), op=hvd.Sum, name=name)
    return t.tolist()


def save_checkpoint(
    path: str,
    model: torch.nn.Module,
    opt: hvd_slowmo.DistributedOptimizer,
    epoch: int,
    scaler: torch.amp.GradScaler | None,
    rank: int,
) -> None:
    """Save one dict (model, optimizer with its SlowMo state, next epoch, scaler) with
    :func:`hvd_slowmo.save_checkpoint` (atomic). Call on every rank: ``opt.state_dict()`` first
    finishes the gossip messages in flight, which every rank must do; rank 0 then writes.

    Args:
        path: the checkpoint file (its folder is created).
        model: the model.
        opt: the distributed optimizer.
        epoch: the next epoch to run.
        scaler: the GradScaler or None.
        rank: this worker's rank.
    """
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": epoch,
        "scaler": scaler.state_dict() if scaler is not None else None,
    }
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        hvd_slowmo.save_checkpoint(state, path)


def load_checkpoint(
    path: str,
    model: torch.nn.Module,
    opt: hvd_slowmo.DistributedOptimizer,
    scaler: torch.amp.GradScaler | None,
    hvd: Any,
) -> int:
    """Rank 0 reads the checkpoint (:func:`hvd_slowmo.load_checkpoint`); every rank then gets
    its model and optimizer state (``hvd.broadcast_parameters`` and
    ``hvd_slowmo.broadcast_optimizer_state``). Collective.

    Args:
        path: the checkpoint file.
        model: the model.
        opt: the distributed optimizer.
        scaler: the GradScaler or None.
        hvd: the job (:class:`launch.Job`, from :func:`setup`).

    Returns:
        The epoch to continue from.
    """
    epoch = 0
    scaler_state = None
    if hvd.rank() == 0:
        if not os.path.exists(path):
            raise ValueError(f"--resume: no checkpoint at {path!r}; drop --resume to start afresh")
        ckpt = hvd_slowmo.load_checkpoint(path)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        epoch, scaler_state = int(ckpt["epoch"]), ckpt["scaler"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd_slowmo.broadcast_optimizer_state(opt, root_rank=0)
    epoch, scaler_state = hvd.broadcast_object(
        (epoch, scaler_state), root_rank=0, name="examples.resume"
    )
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    return epoch


def progress(
    iterable: Iterable[Any], rank: int, args: argparse.Namespace, **kwargs: Any
) -> Iterable[Any]:
    """A tqdm bar on rank 0 when its output (stderr) is a terminal and not --no-progress; the
    plain iterable otherwise.

    A bar redraws its line with carriage returns: in a ``horovodrun`` or CI log that is one
    endless line, so there the epoch lines of :func:`train` are the whole log of progress.

    Args:
        iterable: what to iterate.
        rank: this worker's rank.
        args: the parsed flags.
        kwargs: passed to tqdm (desc, total, ...).
    """
    if rank != 0 or args.no_progress or not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, dynamic_ncols=True, leave=False, **kwargs)


def log0(rank: int, *message: Any) -> None:
    """Print on rank 0 only.

    Args:
        rank: this worker's rank.
        message: what to print.
    """
    if rank == 0:
        print(*message, flush=True)


def _progress_line(args: argparse.Namespace, rank: int, event: str, **fields: Any) -> None:
    if rank != 0 or not (args.progress_lines or args.progress_file):
        return
    line = event_line(event, run=run_name(args), **fields)
    if args.progress_lines:
        print(line, flush=True)
    if args.progress_file:
        # Appended and closed at every event: a run that dies leaves the epochs it finished.
        os.makedirs(os.path.dirname(os.path.abspath(args.progress_file)), exist_ok=True)
        with open(args.progress_file, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def write_summary(path: str | None, summary: dict[str, Any], rank: int) -> None:
    """Rank 0 writes the run's final metrics as JSON (read by compare.py and the tests).

    Args:
        path: the file, or None for nothing.
        summary: the metrics.
        rank: this worker's rank.
    """
    if path is None or rank != 0:
        return
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, sort_keys=True)


# --- data ---------------------------------------------------------------------------------------
class OuterStepEpochs:
    """This worker's minibatches of an in-memory training set, in epochs of whole outer steps.

    Each worker reads an endless stream: pass ``k`` over the data is a fresh permutation (seeded
    by the run's seed and ``k``, the same on every worker), dealt round-robin to the workers, and
    minibatches run on across passes. An epoch is the multiple of ``tau`` steps closest to one
    pass (at least ``tau``), so every epoch ends at an outer-step boundary, where every worker
    holds the averaged model; the stream is a pure function of the epoch, so a resumed run
    reads the same batches.

    Args:
        num_examples: size of the training set.
        batch_size: per worker.
        rank: this worker's rank.
        size: number of workers.
        seed: the run's seed.
        tau: steps per outer step.
        max_steps: cap on steps per epoch (0: none; a cap that is not a multiple of ``tau``
            ends epochs inside an outer step).
        pass_examples: size the epochs for a pass over this many examples instead (e.g. the
            full training set, when a validation split was held out of it: same steps per epoch).
        epoch_steps: steps per epoch whatever ``tau`` is (0: the multiple of ``tau`` closest to
            a pass): settings at different ``tau`` then train the same steps on the same
            samples, and an epoch may end inside an outer step.

    Raises:
        ValueError: a worker's share of the data is smaller than one batch.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        rank: int,
        size: int,
        seed: int,
        tau: int,
        max_steps: int = 0,
        pass_examples: int | None = None,
        epoch_steps: int = 0,
    ) -> None:
        if isinstance(epoch_steps, bool) or not isinstance(epoch_steps, int) or epoch_steps < 0:
            raise ValueError(
                f"--epoch-steps must be an integer >= 0 (0: a multiple of tau), got {epoch_steps!r}"
            )
        self.per_worker = num_examples // size
        if batch_size < 1 or self.per_worker < batch_size:
            raise ValueError(
                f"--batch-size {batch_size} does not fit a worker's share of the "
                f"training set ({self.per_worker} examples); use 1 to "
                f"{max(self.per_worker, 1)}"
            )
        self.num_examples, self.batch_size, self.seed = num_examples, batch_size, seed
        self.rank, self.size = rank, size
        pass_steps = (pass_examples or num_examples) // size / batch_size
        steps = epoch_steps or tau * max(1, round(pass_steps / tau))
        self.steps_per_epoch = min(steps, max_steps) if max_steps > 0 else steps

    def _pass(self, k: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        perm = torch.randperm(self.num_examples, generator=g)
        return perm[self.rank :: self.size][: self.per_worker]

    def epoch(self, epoch: int) -> list[Tensor]:
        """The index tensors of this worker's ``steps_per_epoch`` minibatches in ``epoch``.

        Args:
            epoch: 0-based.
        """
        start = epoch * self.steps_per_epoch * self.batch_size
        stop = start + self.steps_per_epoch * self.batch_size
        first, last = start // self.per_worker, (stop - 1) // self.per_worker
        stream = torch.cat([self._pass(k) for k in range(first, last + 1)])
        offset = start - first * self.per_worker
        return list(stream[offset : offset + stop - start].split(self.batch_size))


# --- evaluation ---------------------------------------------------------------------------------
@torch.no_grad()
def classifier_metrics(
    model: torch.nn.Module,
    dataset: Dataset,
    hvd: Any,
    device: torch.device,
    args: argparse.Namespace,
    batch_size: int,
    name: str,
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (%) of ``model`` over the whole ``dataset``: worker ``r``
    scores every ``size``-th example (an exact partition) and the sums are added. Collective.

    Args:
        model: the model to score (the averaged one, see ``opt.use_consensus()``).
        dataset: yields ``(x, y)``.
        hvd: the job (:class:`launch.Job`, from :func:`setup`).
        device: the device.
        args: the parsed flags (--amp, --workers).
        batch_size: evaluation batch size.
        name: a unique Horovod name for the sums.
    """
    was_training = model.training
    model.eval()
    workers = 0 if getattr(args, "synthetic", True) else getattr(args, "workers", 0)
    shard = Subset(dataset, range(hvd.rank(), len(dataset), hvd.size()))
    loader = DataLoader(
        shard, batch_size=batch_size, num_workers=workers, pin_memory=device.type == "cuda"
    )
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(args, device):
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    model.train(was_training)
    loss_sum, correct, count = allreduce_sums([loss_sum, correct, count], hvd, name)
    return loss_sum / count, 100.0 * correct / count


# --- the training loop --------------------------------------------------------------------------
@dataclass
class Task:
    """What the shared training loop needs from an example.

    Attributes:
        name: the task name recorded in ``config.json`` (a row label of the report).
        optimizer: ``"sgd"`` or ``"adam"`` (recorded; the report labels rows "Local SGD" or
            "Local Adam").
        steps_per_epoch: optimizer steps per epoch (the same on every worker).
        batches: ``epoch -> this worker's batches`` (at least ``steps_per_epoch`` of them).
        loss: ``batch -> this worker's mean training loss`` (batch already on the device; runs
            under autocast).
        evaluate: collective; the metrics of the model as it is (the loop makes it the averaged
            model first): keys among ``val_loss``, ``val_accuracy``, ``val_nll`` and
            ``train_full_loss``.
        to_device: moves a batch to the training device.
        target: the metric whose best value the summary keeps (``val_accuracy``: higher is
            better; anything else: lower is better).
    """

    name: str
    optimizer: str
    steps_per_epoch: int
    batches: Callable[[int], Iterable[Any]]
    loss: Callable[[Any], Tensor]
    evaluate: Callable[[], dict[str, float]]
    to_device: Callable[[Any], Any]
    target: str = "val_accuracy"


def _fmt_metrics(metrics: dict[str, float]) -> str:
    names = {
        "train_full_loss": "train loss",
        "val_loss": "val loss",
        "val_accuracy": "val acc",
        "val_nll": "val nll",
    }
    return ", ".join(
        f"{names[k]} {v:.2f}%" if k == "val_accuracy" else f"{names[k]} {v:.4f}"
        for k, v in metrics.items()
    )


def _train_epoch(
    args: argparse.Namespace,
    hvd: Any,
    device: torch.device,
    task: Task,
    epoch: int,
    opt: Any,
    scaler: Any,
    sched: torch.optim.lr_scheduler.LRScheduler,
    monitor: TrainingMonitor,
    straggler: Straggler | EmulatedClock | None = None,
) -> tuple[float, int, bool]:
    """One epoch of :func:`train`'s steps; returns (the sum of this worker's minibatch losses, its
    steps, whether the run diverged: a non-finite check raised, on every rank at the same step)."""
    rank = hvd.rank()
    # Unequal step counts (time-based periods, a quorum): the epoch ends at its share of outer
    # steps, each worker drawing the epoch's batches again if it needs more.
    until = (epoch + 1) * max(1, task.steps_per_epoch // args.tau) if outer_driven(args) else None
    batches = task.batches(epoch) if until is None else _cycle(lambda: task.batches(epoch))
    bar = progress(batches, rank, args, total=task.steps_per_epoch, desc=f"epoch {epoch}")
    loss_sum, steps = 0.0, 0
    outer, taken = opt.outer_steps, 0  # this worker's steps since its last outer step
    for i, batch in enumerate(bar):
        if (i >= task.steps_per_epoch) if until is None else (opt.outer_steps >= until):
            break
        batch = task.to_device(batch)
        monitor.start_iteration()
        if straggler is not None:  # inside the iteration's time: the slowed worker's compute
            straggler.before_step()
        with autocast(args, device):
            loss = task.loss(batch)
        try:
            backward_and_step(loss, opt, scaler, monitor, hvd)
        except FloatingPointError as e:
            # Raised on every rank at the same outer step (a collective check): a learning rate
            # too large for this method. Record the run as diverged (its metrics: those of the
            # non-finite model) rather than end a sweep or a --plan launch.
            log0(
                rank,
                f"{run_name(args)}: diverged at step {opt.num_steps}: {str(e).splitlines()[0]}",
            )
            return loss_sum, steps, True
        if straggler is not None:
            straggler.after_step(opt.outer_steps)
        value = loss.item()
        monitor.end_iteration(value)
        loss_sum, steps = loss_sum + value, steps + 1
        if until is None:
            sched.step()
        else:  # unequal counts: the lr at the cluster's progress (unequal.schedule_step)
            outer, taken = opt.outer_steps, (0 if opt.outer_steps != outer else taken + 1)
            resume_schedule(sched, schedule_step(opt, args.tau, taken))
        if until is None and opt.num_steps % args.log_every == 0:
            window = monitor.log_window(opt.num_steps)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{window['train_loss']:.4f}", ms=f"{window['iter_ms']:.1f}")
    if until is not None:
        opt.finish()  # the quorum's late workers catch up before the epoch's collectives
        # A window's numbers are averaged over the workers (collective): with unequal step
        # counts the workers meet only here, so the window is the epoch.
        monitor.log_window(opt.num_steps)
    return loss_sum, steps, False


def _cycle(batches: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    """``batches()`` over and over (a worker that takes more steps than an epoch holds)."""
    while True:
        yield from batches()


def train(
    args: argparse.Namespace,
    hvd: Any,
    device: torch.device,
    task: Task,
    model: torch.nn.Module,
    base_optimizer: torch.optim.Optimizer,
    lr_factor: Callable[[int], float],
    islands: IslandLayout | None = None,
) -> dict[str, Any]:
    """The training loop every example runs: SlowMo around ``base_optimizer``, a per-step lr
    schedule, AMP, checkpoints, TensorBoard, rank-0 logs, and at the end of every epoch the
    metrics of the workers' averaged model (``opt.use_consensus()``).

    Args:
        args: the parsed flags (see :func:`add_common_args`).
        hvd: the job (:class:`launch.Job`, from :func:`setup`).
        device: the training device.
        task: the example's data, loss and evaluation.
        model: the model, on ``device``.
        base_optimizer: the local optimizer over ``model.parameters()``, at its peak lr.
        lr_factor: ``step -> factor`` of the peak lr.
        islands: the layout from :func:`shard_islands` (``model`` is then the unwrapped model), or
            None: every process is one worker.

    Returns:
        The final metrics (rank 0 also writes them to --summary-json).
    """
    t_start = time.perf_counter()
    rank, size = hvd.rank(), hvd.size()
    threads = None
    if isinstance(hvd, ThreadJob):
        hvd.end_turn()  # the model is built; the optimizer's checks are collective
        threads = hvd.comm
    worker = islands.worker if islands is not None else None
    # None but on the emulated straggler; with --emulated-step every worker's clock
    straggler = straggler_from_args(args, rank, size)
    clock = straggler if isinstance(straggler, EmulatedClock) else None
    opt = build_optimizer(
        base_optimizer, model, args, communicator=threads, worker=worker, clock=clock
    )
    sched = torch.optim.lr_scheduler.LambdaLR(base_optimizer, lr_factor)
    scaler = make_scaler(args, device)
    if islands is None:  # shard_islands broadcast the whole model before sharding it
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start_epoch = 0
    if args.resume:
        start_epoch = load_checkpoint(args.checkpoint, model, opt, scaler, hvd)
        resume_schedule(
            sched, schedule_step(opt, args.tau, 0) if outer_driven(args) else opt.num_steps
        )
    config = run_config(args, task.name, task.optimizer, size)
    config.update(buffers=opt.buffers, average=opt.average)  # as built (the base alone may differ)
    config.update(islands.summary() if islands is not None else {})
    layout = islands.describe() if islands is not None else f"{size} workers"
    monitor = make_monitor(opt, args, config, device, rank=rank)
    log0(
        rank,
        f"{run_name(args)}: {layout}, {task.steps_per_epoch} steps/epoch, "
        f"peak lr {sched.base_lrs[0]:g}, {describe(opt)}",
    )
    _progress_line(args, rank, "start", epochs=args.epochs, start_epoch=start_epoch)

    higher_is_better = task.target == "val_accuracy"
    best = -math.inf if higher_is_better else math.inf
    metrics: dict[str, float] = {}
    epoch_loss = float("nan")
    at_boundary = True
    skip_seconds, skip_iters = 0.0, 0
    diverged = False
    curve: list[list[float]] = []  # --emulated-step: (emulated seconds, target) per evaluation
    steps_total = 0  # every worker's base steps (unequal with time-based periods)
    for epoch in range(start_epoch, args.epochs):
        loss_sum, steps, diverged = _train_epoch(
            args, hvd, device, task, epoch, opt, scaler, sched, monitor, straggler
        )
        # The epoch's own mean minibatch loss over workers (a TensorBoard window may still be open).
        loss_sum, steps_all = allreduce_sums([loss_sum, steps], hvd, "examples.epoch_loss")
        steps_total += int(steps_all)
        epoch_loss = loss_sum / steps_all if steps_all else float("nan")
        with opt.use_consensus() as already_averaged:
            metrics = task.evaluate()
        at_boundary = already_averaged
        monitor.log_validation(opt.num_steps, metrics)
        value = metrics.get(task.target, math.nan)
        if not math.isnan(value):
            best = max(best, value) if higher_is_better else min(best, value)
        # --emulated-step: the evaluation dated in the cluster's emulated seconds
        curve += [[emulated_seconds(args, opt, size), value]] if clock is not None else []
        log0(
            rank,
            f"epoch {epoch}: train loss {epoch_loss:.4f} (minibatches); averaged model"
            f"{'' if at_boundary else ' (a copy)'}: {_fmt_metrics(metrics)}",
        )
        emulated = {"emulated_s": curve[-1][0]} if curve else {}
        _progress_line(
            args, rank, "epoch", epoch=epoch + 1, epochs=args.epochs, step=opt.num_steps,
            **metrics, **emulated,
        )  # fmt: skip
        if epoch == start_epoch:  # the first epoch pays Horovod's one-off negotiation: leave it out
            skip_seconds, skip_iters = monitor.total_seconds, monitor.total_iterations
        if diverged:
            break
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, opt, epoch + 1, scaler, rank)
    if not outer_driven(args) and opt.num_steps % args.log_every:
        monitor.log_window(opt.num_steps)  # close the last, partial TensorBoard window
    monitor.close()
    opt.flush()  # no outer step (overlap) nor gossip message (OSGP) stays in flight past the run
    timed = monitor.total_iterations - skip_iters
    summary = {
        "run": run_name(args),
        "task": task.name,
        "algo": args.algo,
        "slowmo": args.slowmo,
        "workers": size,
        "seed": args.seed,
        "lr": args.lr,
        "tau": args.tau,
        "slow_momentum": args.slow_momentum if args.slowmo else 0.0,
        "buffers": opt.buffers,
        "steps": opt.num_steps,
        "epochs": args.epochs,
        "train_loss": epoch_loss,
        **metrics,
        f"best_{task.target}": best if math.isfinite(best) else None,
        "evaluated_at_boundary": at_boundary,
        "ms_per_iter": (
            1000.0 * (monitor.total_seconds - skip_seconds) / timed
            if timed
            else monitor.mean_iteration_ms()
        ),
        "bytes_sent": opt.bytes_sent - monitor.measurement_bytes,
        "timings_s": dict(opt.timings),
        "outer_steps": opt.outer_steps,
        "diverged": diverged,
        "wall_s": time.perf_counter() - t_start,
        **(islands.summary() if islands is not None else {}),
    }
    summary.update(straggler_summary(straggler))  # on the emulated straggler: what it added
    summary.update({"emulated_curve": curve, "steps_all_workers": steps_total} if curve else {})
    summary.update(policy_summary(args, opt, rank))  # a quorum: the steps without everyone
    write_summary(args.summary_json, summary, rank)
    _progress_line(args, rank, "end", summary=summary)
    return summary


def train_classifier(
    args: argparse.Namespace,
    hvd: Any,
    device: torch.device,
    task: str,
    model: torch.nn.Module,
    train_set: Dataset,
    val_set: Dataset,
    peak_lr: float,
    lr_factor: Callable[[int, int], float],
    in_memory: bool = False,
    eval_batch_size: int | None = None,
    pass_examples: int | None = None,
) -> dict[str, Any]:
    """Image/signal classification with :func:`train`: Nesterov SGD (momentum 0.9, weight decay
    1e-4, the paper's CIFAR-10/ImageNet recipe) wrapped by SlowMo; cross-entropy; the averaged
    model's validation loss and accuracy (and, with --eval-train-loss, its loss on the whole
    training set) after every epoch.

    Args:
        args: the parsed flags (see :func:`add_common_args`).
        hvd: the job (:class:`launch.Job`, from :func:`setup`).
        device: the training device.
        task: the task name recorded in ``config.json``.
        model: the model, on ``device``.
        train_set: the training set.
        val_set: the held-out set.
        peak_lr: the learning rate after warm-up (already scaled for the global batch).
        lr_factor: ``(step, steps_per_epoch) -> factor`` of ``peak_lr``.
        in_memory: ``train_set`` is a ``TensorDataset``: batches come from :class:`OuterStepEpochs`
            (epochs of whole outer steps, evaluated at an outer-step boundary); otherwise a
            ``DistributedSampler`` deals one pass per epoch (``--max-steps`` caps it).
        eval_batch_size: batch size for evaluation (default --batch-size).
        pass_examples: with ``in_memory``, see :class:`OuterStepEpochs`.

    Returns:
        The final metrics (rank 0 also writes them to --summary-json).
    """
    rank, size = hvd.rank(), hvd.size()
    if in_memory:
        xs, ys = train_set.tensors  # type: ignore[attr-defined]
        epochs = OuterStepEpochs(
            len(ys),
            args.batch_size,
            rank,
            size,
            args.seed,
            args.tau,
            args.max_steps,
            pass_examples,
            getattr(args, "epoch_steps", 0),
        )
        steps_per_epoch = epochs.steps_per_epoch

        def batches(epoch: int) -> Iterable[Any]:
            return ((xs[i], ys[i]) for i in epochs.epoch(epoch))
    else:
        if getattr(args, "epoch_steps", 0):
            raise ValueError(
                f"--epoch-steps {args.epoch_steps}: only the in-memory examples round epochs to "
                "tau; this one takes one pass per epoch whatever tau is (use --max-steps)"
            )
        workers = 0 if getattr(args, "synthetic", True) else args.workers
        sampler = DistributedSampler(
            train_set, num_replicas=size, rank=rank, shuffle=True, seed=args.seed
        )
        loader = DataLoader(
            train_set,
            batch_size=args.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=workers,
            pin_memory=device.type == "cuda",
        )
        steps_per_epoch = len(loader) if args.max_steps <= 0 else min(len(loader), args.max_steps)
        if steps_per_epoch == 0:
            raise ValueError(
                f"--batch-size {args.batch_size} is larger than a worker's shard of "
                f"the training set ({len(sampler)} examples); lower it"
            )

        def batches(epoch: int) -> Iterable[Any]:  # type: ignore[misc]
            sampler.set_epoch(epoch)
            return loader

    eval_bs = eval_batch_size or args.batch_size

    def evaluate() -> dict[str, float]:
        out: dict[str, float] = {}
        if args.eval_train_loss:
            out["train_full_loss"], _ = classifier_metrics(
                model, train_set, hvd, device, args, eval_bs, "examples.eval_train"
            )
        out["val_loss"], out["val_accuracy"] = classifier_metrics(
            model, val_set, hvd, device, args, eval_bs, "examples.eval_val"
        )
        return out

    spec = Task(
        name=task,
        optimizer="sgd",
        steps_per_epoch=steps_per_epoch,
        batches=batches,
        loss=lambda b: F.cross_entropy(model(b[0]), b[1]),
        evaluate=evaluate,
        to_device=lambda b: (
            b[0].to(device, non_blocking=True),
            b[1].to(device, non_blocking=True),
        ),
    )
    base = torch.optim.SGD(
        model.parameters(), lr=peak_lr, momentum=0.9, nesterov=True, weight_decay=1e-4
    )
    return train(
        args, hvd, device, spec, model, base, lambda step: lr_factor(step, steps_per_epoch)
    )


def run_cli(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> int:
    """An example's command line, plus ``--plan FILE``: a JSON list of argument lists, each
    trained in turn inside this one launch after the other arguments (so a launcher pays
    ``horovodrun``'s start-up once for many runs: examples/compare.py and slowmo_lab.sweep),
    and ``--threads M``: every run on M thread workers of this one process, no launcher
    (:func:`launch.run_in_threads`; cheap for small models, e.g. ``slowmo_lab.sweep
    --launcher threads``).

    Args:
        main: the example's ``main(argv)``.
        argv: the arguments (default: sys.argv[1:]).

    Returns:
        0 (errors raise).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--plan", default=None)
    pre.add_argument("--threads", type=int, default=0)
    known, rest = pre.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if known.threads < 0:
        raise ValueError(
            f"--threads must be >= 0 (0: the launcher's processes), got {known.threads}"
        )

    def run(args: list[str]) -> None:
        if known.threads:
            run_in_threads(known.threads, functools.partial(main, args))
        else:
            main(args)

    if known.plan is None:
        run(rest)
        return 0
    with open(known.plan, encoding="utf-8") as f:
        plan = json.load(f)
    if not isinstance(plan, list) or not all(
        isinstance(e, list) and all(isinstance(a, str) for a in e) for e in plan
    ):
        raise ValueError(
            f"--plan {known.plan!r} must hold a JSON list of argument lists, e.g. "
            '[["--seed", "0"], ["--seed", "1"]]'
        )
    for entry in plan:
        run(rest + entry)
    return 0
