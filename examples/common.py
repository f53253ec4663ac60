"""Pieces shared by the example training scripts: the algorithm flags, building the SlowMo
optimizer from them, learning-rate schedules, the AMP step, checkpoints and rank-0 logging.

The examples import it as ``from common import ...`` (Python puts the script's folder on the
path). Paper: arXiv 1910.00643.
"""
import argparse
import glob
import json
import math
import os
import random
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

# Run from a checkout without installing: the package sits one folder up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hvd_slowmo  # noqa: E402
from hvd_slowmo.tools.metrics import CONFIG_FILE, TrainingMonitor  # noqa: E402

__all__ = [
    "ALGOS", "add_common_args", "describe", "setup", "build_optimizer", "run_name", "run_config", "make_monitor",
    "warmup_multistep", "inverse_sqrt", "resume_schedule", "backward_and_step", "autocast", "make_scaler", "allreduce_sums",
    "save_checkpoint", "load_checkpoint", "progress", "log0", "write_summary", "train_classifier",
]

#: Base algorithms selectable with --algo (the gossip ones need their base registered in hvd_slowmo.BASES).
ALGOS = ("allreduce", "localsgd", "sgp", "osgp", "dpsgd")


def add_common_args(parser: argparse.ArgumentParser, *, tau: int, slow_momentum: float, buffers: str,
                    epochs: int, batch_size: int, lr: float, data_flags: bool = True) -> None:
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
    """
    g = parser.add_argument_group("algorithm (arXiv 1910.00643)")
    g.add_argument("--algo", default="localsgd", choices=ALGOS, help="base algorithm")
    g.add_argument("--slowmo", action=argparse.BooleanOptionalAction, default=True,
                   help="SlowMo on top of the base (--no-slowmo: the base alone: allreduce every step, "
                        "Local SGD's plain average every tau steps, gossip without exact average)")
    g.add_argument("--tau", type=int, default=tau, help="base steps per outer step")
    g.add_argument("--slow-lr", type=float, default=1.0, help="alpha")
    g.add_argument("--slow-momentum", type=float, default=slow_momentum, help="beta")
    g.add_argument("--buffers", default=buffers, choices=("reset", "maintain", "average"),
                   help="base optimizer buffers at each outer step")
    g.add_argument("--no-average", action="store_true",
                   help="skip the exact average (SGP-SlowMo-noaverage; gossip bases only)")
    t = parser.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=epochs)
    t.add_argument("--batch-size", type=int, default=batch_size, help="per worker")
    t.add_argument("--lr", type=float, default=lr)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-steps", type=int, default=0, help="stop after this many steps per epoch (0: no limit)")
    t.add_argument("--amp", action="store_true",
                   help="mixed precision: fp16 autocast + GradScaler on CUDA, bf16 autocast on CPU")
    if data_flags:
        t.add_argument("--synthetic", action="store_true", help="random tensors and a tiny model (seconds on a CPU)")
        t.add_argument("--data", default="data", help="dataset folder")
        t.add_argument("--download", action="store_true", help="download the dataset into --data (needs network)")
        t.add_argument("--workers", type=int, default=2, help="data-loader processes per rank")
    o = parser.add_argument_group("logging and checkpoints")
    o.add_argument("--logdir", default="runs", help="TensorBoard runs go to LOGDIR/<run name>/")
    o.add_argument("--run-name", default=None, help="default: encodes algo, slowmo, tau, alpha, beta, buffers")
    o.add_argument("--log-every", type=int, default=20, help="steps between TensorBoard training points")
    o.add_argument("--checkpoint", default=None, help="save here at the end of every epoch (rank 0)")
    o.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    o.add_argument("--summary-json", default=None, help="rank 0 writes the final metrics here")
    o.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def setup(args: argparse.Namespace) -> Tuple[Any, torch.device]:
    """``hvd.init()``, pick the device (one GPU per local rank), seed, and keep CPU threads
    from oversubscribing the cores (several ranks share one machine).

    Args:
        args: the parsed flags.

    Returns:
        ``(hvd, device)``.
    """
    import horovod.torch as hvd

    hvd.init()
    if args.tau < 1:
        raise ValueError(f"--tau must be >= 1, got {args.tau}")
    if torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(hvd.local_size(), 1)))
    # Same seed everywhere: identical initial models (broadcast below makes sure anyway).
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    return hvd, device


def build_optimizer(base_optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                    args: argparse.Namespace) -> hvd_slowmo.DistributedOptimizer:
    """Wrap ``base_optimizer`` as the algorithm the flags name.

    Without SlowMo the base runs alone: allreduce with its momentum kept; Local SGD with a plain
    average every ``tau`` steps (alpha=1, beta=0); gossip bases without any exact average.

    Args:
        base_optimizer: SGD/Adam over ``model.parameters()``.
        model: the model (its buffers, e.g. BatchNorm statistics, are averaged with the parameters).
        args: the parsed flags.
    """
    if args.algo not in hvd_slowmo.BASES:
        raise ValueError(f"--algo {args.algo}: this hvd_slowmo has no such base (registered: "
                         f"{sorted(hvd_slowmo.BASES)})")
    kwargs: Dict[str, Any] = dict(base=args.algo, tau=args.tau, buffers=args.buffers, average=not args.no_average,
                                  slow_lr=args.slow_lr, slow_momentum=args.slow_momentum)
    if not args.slowmo:
        kwargs.update(slow_lr=1.0, slow_momentum=0.0)
        if args.algo != "localsgd":
            # The base alone never has an outer step: keep the local buffers, no exact average.
            kwargs.update(buffers="maintain", average=args.algo == "allreduce")
    elif args.algo == "allreduce" and args.buffers == "average":
        kwargs.update(buffers="maintain")  # identical on every worker already
    return hvd_slowmo.DistributedOptimizer(base_optimizer, named_parameters=model.named_parameters(),
                                           model_buffers=model.buffers(), **kwargs)


def describe(opt: hvd_slowmo.DistributedOptimizer) -> str:
    """One line naming the algorithm and its SlowMo settings (for rank 0's log).

    Args:
        opt: the distributed optimizer.
    """
    return (f"base={opt.base_name} tau={opt.tau} slow_lr={opt.slow_lr:g} slow_momentum={opt.slow_momentum:g} "
            f"buffers={opt.buffers} average={opt.average} optimizer={type(opt.optimizer).__name__}")


def run_name(args: argparse.Namespace) -> str:
    """The TensorBoard run name: algorithm, SlowMo, tau, alpha, beta, buffers (so runs overlay)."""
    if args.run_name:
        return args.run_name
    if not args.slowmo:
        return f"{args.algo}" + (f"_tau{args.tau}" if args.algo == "localsgd" else "")
    tag = "-slowmo-noavg" if args.no_average else "-slowmo"
    return f"{args.algo}{tag}_tau{args.tau}_a{args.slow_lr:g}_b{args.slow_momentum:g}_{args.buffers}"


def run_config(args: argparse.Namespace, task: str, optimizer_name: str, world_size: int) -> Dict[str, Any]:
    """What ``config.json`` records (the report groups runs by ``algo`` and ``slowmo``).

    Args:
        args: the parsed flags.
        task: e.g. ``"cifar10_resnet18"``.
        optimizer_name: ``"sgd"`` or ``"adam"``.
        world_size: number of workers.
    """
    return {"task": task, "algo": args.algo, "slowmo": bool(args.slowmo), "tau": args.tau,
            "slow_lr": args.slow_lr if args.slowmo else 1.0,
            "slow_momentum": args.slow_momentum if args.slowmo else 0.0,
            "buffers": args.buffers, "average": not args.no_average, "optimizer": optimizer_name,
            "workers": world_size, "batch_size": args.batch_size, "lr": args.lr, "epochs": args.epochs,
            "amp": args.amp, "synthetic": getattr(args, "synthetic", False)}


def make_monitor(opt: hvd_slowmo.DistributedOptimizer, args: argparse.Namespace, config: Dict[str, Any],
                 device: torch.device) -> TrainingMonitor:
    """The TensorBoard monitor for ``LOGDIR/<run name>``; a fresh run (not --resume) first
    removes that run's old event files so TensorBoard does not mix two runs.

    Args:
        opt: the distributed optimizer.
        args: the parsed flags.
        config: from :func:`run_config`.
        device: the training device.
    """
    logdir = os.path.join(args.logdir, run_name(args))
    if opt.comm.rank == 0 and not args.resume:
        for old in glob.glob(os.path.join(logdir, "events.out.tfevents.*")) + [os.path.join(logdir, CONFIG_FILE)]:
            if os.path.exists(old):
                os.remove(old)
    return TrainingMonitor(opt, logdir, config, device=device)


def warmup_multistep(step: int, steps_per_epoch: int, warmup_epochs: float, milestones: Sequence[int],
                     gamma: float = 0.1) -> float:
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


def resume_schedule(sched: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put a per-step LambdaLR at ``step`` after a resume (without stepping it, which would warn
    that the scheduler ran before the optimizer).

    Args:
        sched: the schedule over the base optimizer.
        step: the global step to continue from.
    """
    sched.last_epoch = step
    for group, base_lr, factor in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base_lr * factor(step)


def autocast(args: argparse.Namespace, device: torch.device) -> Any:
    """The autocast context for --amp (fp16 on CUDA, bf16 on CPU), else a no-op context.

    Args:
        args: the parsed flags.
        device: the training device.
    """
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=args.amp)


def make_scaler(args: argparse.Namespace, device: torch.device) -> Optional[torch.amp.GradScaler]:
    """A GradScaler for --amp on CUDA (fp16 needs loss scaling); None otherwise (bf16 does not).

    Args:
        args: the parsed flags.
        device: the training device.
    """
    return torch.amp.GradScaler("cuda") if args.amp and device.type == "cuda" else None


def backward_and_step(loss: torch.Tensor, opt: hvd_slowmo.DistributedOptimizer,
                      scaler: Optional[torch.amp.GradScaler], monitor: TrainingMonitor, hvd: Any) -> None:
    """Backward and one optimizer step, with Horovod's GradScaler recipe when ``scaler`` is set.

    With a scaler, all workers must agree on skipping a step: a local method whose workers skip
    different steps would reach its exact average at different times and deadlock. So the
    overflow flag is OR-ed across workers (one scalar allreduce) before stepping.

    Args:
        loss: the loss of this worker's batch.
        opt: the distributed optimizer.
        scaler: the GradScaler or None.
        monitor: the run's monitor (its consensus measurement must precede the step).
        hvd: ``horovod.torch``.
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


def allreduce_sums(values: Sequence[float], hvd: Any, name: str) -> List[float]:
    """Sum a few floats over all workers (validation counts and losses).

    Args:
        values: this worker's partial sums.
        hvd: ``horovod.torch``.
        name: a unique Horovod tensor name.
    """
    t = hvd.allreduce(torch.tensor(list(values), dtype=torch.float64), op=hvd.Sum, name=name)
    return t.tolist()


def save_checkpoint(path: str, model: torch.nn.Module, opt: hvd_slowmo.DistributedOptimizer, epoch: int,
                    scaler: Optional[torch.amp.GradScaler], rank: int) -> None:
    """Rank 0 saves one dict: model, optimizer (SlowMo state included), next epoch, scaler.

    Args:
        path: the checkpoint file.
        model: the model.
        opt: the distributed optimizer.
        epoch: the next epoch to run.
        scaler: the GradScaler or None.
        rank: this worker's rank.
    """
    if rank != 0:
        return
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
             "step": opt.num_steps, "scaler": scaler.state_dict() if scaler is not None else None}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # never leave a half-written checkpoint behind


def load_checkpoint(path: str, model: torch.nn.Module, opt: hvd_slowmo.DistributedOptimizer,
                    scaler: Optional[torch.amp.GradScaler], hvd: Any) -> int:
    """Rank 0 reads the checkpoint; every rank then gets its model and optimizer state
    (``hvd.broadcast_parameters`` and ``hvd_slowmo.broadcast_optimizer_state``). Collective.

    Args:
        path: the checkpoint file.
        model: the model.
        opt: the distributed optimizer.
        scaler: the GradScaler or None.
        hvd: ``horovod.torch``.

    Returns:
        The epoch to continue from.
    """
    epoch = 0
    scaler_state = None
    if hvd.rank() == 0:
        if not os.path.exists(path):
            raise ValueError(f"--resume: no checkpoint at {path!r}; drop --resume to start afresh")
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        epoch, scaler_state = int(ckpt["epoch"]), ckpt["scaler"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd_slowmo.broadcast_optimizer_state(opt, root_rank=0)
    epoch, scaler_state = hvd.broadcast_object((epoch, scaler_state), root_rank=0, name="examples.resume")
    if scaler is not None and scaler_state is not None:
        scaler.load_state_dict(scaler_state)
    return epoch


def progress(iterable: Iterable[Any], rank: int, args: argparse.Namespace, **kwargs: Any) -> Iterable[Any]:
    """A tqdm bar on rank 0 (unless --no-progress); the plain iterable elsewhere.

    Args:
        iterable: what to iterate.
        rank: this worker's rank.
        args: the parsed flags.
        kwargs: passed to tqdm (desc, total, ...).
    """
    if rank != 0 or args.no_progress:
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


def write_summary(path: Optional[str], summary: Dict[str, Any], rank: int) -> None:
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


@torch.no_grad()
def evaluate_classifier(model: torch.nn.Module, loader: DataLoader, hvd: Any, device: torch.device,
                        args: argparse.Namespace) -> Dict[str, float]:
    """Validation loss and accuracy (%) over the whole validation set: each worker scores its
    own model on its shard (the workers' models differ between exact averages, so this is the
    mean over the workers' models), and the sums are added over workers.

    Args:
        model: this worker's model.
        loader: this worker's shard of the validation set.
        hvd: ``horovod.torch``.
        device: the device.
        args: the parsed flags (for --amp).
    """
    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(args, device):
            logits = model(x)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    model.train()
    loss_sum, correct, count = allreduce_sums([loss_sum, correct, count], hvd, "examples.eval")
    return {"val_loss": loss_sum / count, "val_accuracy": 100.0 * correct / count}


def train_classifier(args: argparse.Namespace, hvd: Any, device: torch.device, task: str, model: torch.nn.Module,
                     train_set: Dataset, val_set: Dataset, peak_lr: float,
                     lr_factor: Callable[[int, int], float]) -> Dict[str, Any]:
    """The image-classification loop shared by the examples: Nesterov SGD (momentum 0.9,
    weight decay 1e-4, the paper's CIFAR-10/ImageNet recipe) wrapped by SlowMo, DistributedSampler,
    per-step lr schedule, AMP, checkpoints, TensorBoard, rank-0 logs.

    Args:
        args: the parsed flags (see :func:`add_common_args`).
        hvd: ``horovod.torch`` (initialized).
        device: the training device.
        task: the task name recorded in ``config.json`` (a row label of the report).
        model: the model, on ``device``.
        train_set: the training set (sharded across workers here).
        val_set: the validation set (sharded for evaluation).
        peak_lr: the learning rate after warm-up (already scaled for the global batch).
        lr_factor: ``(step, steps_per_epoch) -> factor`` of ``peak_lr``.

    Returns:
        The final metrics (rank 0 also writes them to --summary-json).
    """
    rank, size = hvd.rank(), hvd.size()
    workers = 0 if getattr(args, "synthetic", True) else args.workers
    sampler = DistributedSampler(train_set, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=workers, pin_memory=device.type == "cuda")
    # Every size-th validation example: an exact partition (DistributedSampler would pad).
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), size)), batch_size=args.batch_size,
                            num_workers=workers, pin_memory=device.type == "cuda")
    steps_per_epoch = len(loader) if args.max_steps <= 0 else min(len(loader), args.max_steps)
    if steps_per_epoch == 0:
        raise ValueError(f"--batch-size {args.batch_size} is larger than a worker's shard of the training set "
                         f"({len(sampler)} examples); lower it")

    base = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    opt = build_optimizer(base, model, args)
    sched = torch.optim.lr_scheduler.LambdaLR(base, lambda s: lr_factor(s, steps_per_epoch))
    scaler = make_scaler(args, device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start_epoch = 0
    if args.resume:
        start_epoch = load_checkpoint(args.checkpoint, model, opt, scaler, hvd)
        resume_schedule(sched, opt.num_steps)
    monitor = make_monitor(opt, args, run_config(args, task, "sgd", size), device)
    log0(rank, f"{run_name(args)}: {size} workers, {steps_per_epoch} steps/epoch, peak lr {peak_lr:g}, {describe(opt)}")

    window: Dict[str, float] = {}
    val: Dict[str, float] = {}
    best_acc = 0.0
    skip_seconds, skip_iters = 0.0, 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        bar = progress(loader, rank, args, total=steps_per_epoch, desc=f"epoch {epoch}")
        for i, (x, y) in enumerate(bar):
            if i >= steps_per_epoch:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            monitor.start_iteration()
            with autocast(args, device):
                loss = F.cross_entropy(model(x), y)
            backward_and_step(loss, opt, scaler, monitor, hvd)
            monitor.end_iteration(loss.item())
            sched.step()
            if opt.num_steps % args.log_every == 0:
                window = monitor.log_window(opt.num_steps)
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{window['train_loss']:.4f}", ms=f"{window['iter_ms']:.1f}")
        val = evaluate_classifier(model, val_loader, hvd, device, args)
        best_acc = max(best_acc, val["val_accuracy"])
        monitor.log_validation(opt.num_steps, val)
        log0(rank, f"epoch {epoch}: train loss {window.get('train_loss', float('nan')):.4f}, "
                   f"val loss {val['val_loss']:.4f}, val acc {val['val_accuracy']:.2f}%")
        if epoch == start_epoch:  # the first epoch pays Horovod's one-off negotiation: leave it out
            skip_seconds, skip_iters = monitor.total_seconds, monitor.total_iterations
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, opt, epoch + 1, scaler, rank)
    if monitor.total_iterations % args.log_every:
        window = monitor.log_window(opt.num_steps)
    monitor.close()
    timed = monitor.total_iterations - skip_iters
    summary = {"run": run_name(args), "task": task, "algo": args.algo, "slowmo": args.slowmo, "workers": size,
               "steps": opt.num_steps, "train_loss": window.get("train_loss"), "val_loss": val.get("val_loss"),
               "val_accuracy": val.get("val_accuracy"), "best_val_accuracy": best_acc,
               "ms_per_iter": (1000.0 * (monitor.total_seconds - skip_seconds) / timed if timed
                               else monitor.mean_iteration_ms()),
               "bytes_sent": opt.comm.bytes_sent - monitor.measurement_bytes, "timings_s": dict(opt.timings),
               "outer_steps": opt.outer_steps}
    write_summary(args.summary_json, summary, rank)
    return summary
