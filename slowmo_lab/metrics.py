"""Training metrics for SlowMo runs (arXiv 1910.00643): TensorBoard scalars, the per-iteration
time split (compute / base communication / exact average / slow update), bytes sent and the
consensus distance between workers.

One :class:`TrainingMonitor` per process; every rank calls it (some measurements are
collectives), only rank 0 writes. The tag names below are what :mod:`slowmo_lab.report` reads;
each scalar carries its description, and every run also writes :mod:`slowmo_lab.dashboard`'s
custom-scalars layout and its settings for the HParams dashboard.
"""

import json
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from hvd_slowmo.comm import Communicator

from . import dashboard

__all__ = ["TAGS", "DESCRIPTIONS", "CONFIG_FILE", "consensus_distance", "TrainingMonitor"]

#: Scalar tags written to TensorBoard (step = global base-step count).
TAGS = {
    "train_loss": "train/loss",
    "train_full_loss": "train/full_loss",
    "lr": "train/lr",
    "val_loss": "val/loss",
    "val_accuracy": "val/accuracy",
    "val_nll": "val/nll",
    "iter_ms": "time/iter_ms",
    "train_s": "time/train_s",
    "compute_ms": "time/compute_ms",
    "base_comm_ms": "time/base_comm_ms",
    "average_ms": "time/average_ms",
    "slow_update_ms": "time/slow_update_ms",
    "bytes_sent": "comm/bytes_sent",
    "consensus": "consensus/distance",
}
#: What each scalar means, shown under its chart in TensorBoard (markdown).
DESCRIPTIONS = {
    "train_loss": "Training loss of the minibatches: mean over the workers and the logging window.",
    "train_full_loss": (
        "Loss of the workers' averaged model on the whole training set, at each epoch's end."
    ),
    "lr": "The base optimizer's learning rate (first parameter group).",
    "val_loss": "Held-out loss of the workers' averaged model, at each epoch's end.",
    "val_accuracy": (
        "Held-out (test) accuracy of the workers' averaged model in percent, at each epoch's end."
    ),
    "val_nll": "Translation: held-out per-token negative log-likelihood of the averaged model.",
    "iter_ms": "Wall time per iteration on rank 0, mean over the logging window (ms).",
    "train_s": (
        "Seconds of training so far (rank 0's summed iteration times; evaluations and the "
        "consensus measurement left out). Every scalar's wall time runs on this clock, so the "
        "Relative horizontal axis compares runs by training time."
    ),
    "compute_ms": (
        "Per iteration: iter_ms minus the three communication phases (forward, backward and "
        "the base optimizer's own step), ms."
    ),
    "base_comm_ms": (
        "Per iteration: the base algorithm's own communication (gossip for SGP/OSGP/D-PSGD, "
        "the gradient allreduce for AR-SGD; zero for Local SGD), ms."
    ),
    "average_ms": (
        "Per iteration: the exact average every tau steps, its exposed part only (what overlap "
        "hides is not counted), ms."
    ),
    "slow_update_ms": "Per iteration: the slow momentum update and the buffer strategy, ms.",
    "bytes_sent": "Payload bytes sent by rank 0 so far (training traffic only), cumulative.",
    "consensus": (
        "Mean distance of the workers' parameters to their average, mean_i ||x_i - mean_j x_j||, "
        "just before an exact average."
    ),
}
#: File written next to the event files with the run's configuration (read by the report).
CONFIG_FILE = "config.json"
_PHASES = ("base_comm", "average", "slow_update")
_EVAL_KEYS = ("val_loss", "val_accuracy", "val_nll", "train_full_loss")


def _local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's (FSDP2's) local shard, any other tensor itself."""
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@torch.no_grad()
def consensus_distance(params: Iterable[Tensor], comm: Communicator, inside: Any = None) -> float:
    """Mean distance of the workers' parameters to their average: ``mean_i ||x_i - x_bar||_2``.

    Collective: every worker must call it with the same parameter shapes; all get the same
    value. Costs two allreduces (the parameters, then one scalar). See arXiv 1910.00643 for
    why drift between exact averages matters for SlowMo.

    Args:
        params: this worker's parameters ``x_i`` (with islands: DTensors, of which this rank
            measures its local shard).
        comm: the communicator over all workers (with islands: this rank's shard's peers).
        inside: with sharded islands, the ``torch.distributed`` group of this rank's island: the
            shards' squared distances are summed over it (one more scalar allreduce), so the
            value is the whole model's.
    """
    params = [_local(p) for p in params]
    if not params:
        raise ValueError("consensus_distance: params is empty; pass model.parameters()")
    # float64 so that the subtraction of two nearly equal models does not lose the difference.
    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in params])
    mean = flat.clone()
    comm.average_([mean], name="hvd_slowmo.metrics.consensus_mean")
    squared = torch.linalg.vector_norm(flat - mean).square().reshape(1)
    if inside is not None:
        torch.distributed.all_reduce(squared, group=inside)
    dist = squared.sqrt()
    comm.average_([dist], name="hvd_slowmo.metrics.consensus_dist")
    return float(dist.item())


class TrainingMonitor:
    """Times iterations, measures consensus and writes TensorBoard scalars on rank 0 (with
    their descriptions, the custom-scalars layout and the run's settings for HParams).

    Usage, per iteration (every rank)::

        monitor.start_iteration()
        loss = ...; loss.backward()
        monitor.before_step()          # consensus distance, when an exact average is next
        opt.step()
        monitor.end_iteration(loss.item())
        if step % log_every == 0: monitor.log_window(step)

    The consensus measurement and the loss averaging run outside the timed region and their
    traffic is subtracted from ``comm/bytes_sent``.

    Args:
        optimizer: the :class:`hvd_slowmo.DistributedOptimizer` being trained.
        logdir: the run's TensorBoard directory (rank 0 creates it); None writes nothing.
        config: the run's configuration, saved as ``config.json`` next to the event files.
        measure_consensus: measure the consensus distance before each exact average.
        device: the training device; on CUDA the clock is read after a synchronize so the
            time split is real.
    """

    def __init__(
        self,
        optimizer: Any,
        logdir: str | None,
        config: dict[str, Any],
        measure_consensus: bool = True,
        device: torch.device | None = None,
    ) -> None:
        for attr in ("comm", "timings", "inner_step", "tau", "base", "param_groups"):
            if not hasattr(optimizer, attr):
                raise TypeError(
                    f"optimizer must be a hvd_slowmo.DistributedOptimizer (it lacks {attr!r}), "
                    f"got {type(optimizer).__name__}"
                )
        self.opt = optimizer
        self.comm: Communicator = optimizer.comm
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.measure_consensus = measure_consensus
        self.writer = None
        if logdir is not None and self.comm.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(logdir, exist_ok=True)
            with open(os.path.join(logdir, CONFIG_FILE), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=1, sort_keys=True, default=str)
            self.writer = SummaryWriter(logdir)
            self.writer.add_custom_scalars(dashboard.LAYOUT)
            self.writer.file_writer.add_summary(dashboard.hparams_summary(config, time.time()))
        self._described: set[str] = set()  # tags written once already, with their description
        self.measurement_bytes = 0  # traffic of the monitor itself, kept out of comm/bytes_sent
        self.last_consensus: float | None = None
        self.total_iterations = 0
        self.total_seconds = 0.0
        self._reset_window()
        self._t0: float | None = None
        self._phase0: dict[str, float] = {}
        # Every scalar's TensorBoard wall time is this start plus the training seconds so far,
        # so the "Relative" axis compares runs by training time, evaluations left out.
        self.wall_start = time.time()
        self._write({"train_s": 0.0}, int(getattr(optimizer, "num_steps", 0)))

    def _reset_window(self) -> None:
        self._win_iters = 0
        self._win_seconds = 0.0
        self._win_phases = {k: 0.0 for k in _PHASES}
        self._win_loss = 0.0
        self._win_loss_count = 0
        self._win_consensus: list[float] = []

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start_iteration(self) -> None:
        """Call at the top of an iteration, after the batch is loaded."""
        self._phase0 = dict(self.opt.timings)
        self._t0 = self._clock()

    def before_step(self) -> None:
        """Call right before ``optimizer.step()``: if that step ends an outer loop (its exact
        average comes next), measure the consensus distance. Collective on those steps."""
        if self._t0 is None:
            raise RuntimeError("TrainingMonitor.before_step() called before start_iteration()")
        # Allreduce keeps the workers identical: nothing to measure there.
        if not self.measure_consensus or not self.opt.base.needs_exact_average:
            return
        if self.opt.inner_step != self.opt.tau - 1:
            return
        t = self._clock()
        before = self.comm.bytes_sent
        params = [p for group in self.opt.param_groups for p in group["params"]]
        islands = getattr(self.opt, "islands", None)
        # Sharded islands: each rank holds a shard, summed over the island; a DDP island's
        # ranks hold whole replicas, each measures the whole model.
        inside = None
        if islands is not None and any(_is_dtensor(p) for p in params):
            inside = islands.groups()[1]
        self.last_consensus = consensus_distance(params, self.comm, inside)
        self.measurement_bytes += self.comm.bytes_sent - before
        self._win_consensus.append(self.last_consensus)
        self._t0 += self._clock() - t  # the measurement is not training time

    def end_iteration(self, loss: float) -> float:
        """Call after ``optimizer.step()``; returns this iteration's wall time in seconds.

        Args:
            loss: this worker's training loss of the iteration (a float).
        """
        if self._t0 is None:
            raise RuntimeError("TrainingMonitor.end_iteration() called before start_iteration()")
        elapsed = self._clock() - self._t0
        self._t0 = None
        for k in _PHASES:
            self._win_phases[k] += self.opt.timings[k] - self._phase0[k]
        self._win_iters += 1
        self._win_seconds += elapsed
        self._win_loss += float(loss)
        self._win_loss_count += 1
        self.total_iterations += 1
        self.total_seconds += elapsed
        return elapsed

    @torch.no_grad()
    def log_window(self, step: int) -> dict[str, float]:
        """Write the window's means (loss over all workers; times of this rank) and start a new
        window. Collective (one small allreduce for the loss). Returns what was computed.

        Args:
            step: the global step for the x axis (e.g. ``opt.num_steps``).
        """
        before = self.comm.bytes_sent
        loss = torch.tensor([self._win_loss, float(self._win_loss_count)], dtype=torch.float64)
        self.comm.average_([loss], name="hvd_slowmo.metrics.train_loss")
        self.measurement_bytes += self.comm.bytes_sent - before
        out: dict[str, float] = {}
        if loss[1] > 0:
            out["train_loss"] = float(loss[0] / loss[1])
        if self._win_iters:
            n = self._win_iters
            out["iter_ms"] = 1000.0 * self._win_seconds / n
            for k in _PHASES:
                out[f"{k}_ms"] = 1000.0 * self._win_phases[k] / n
            out["compute_ms"] = out["iter_ms"] - sum(out[f"{k}_ms"] for k in _PHASES)
        if self._win_consensus:
            out["consensus"] = sum(self._win_consensus) / len(self._win_consensus)
        out["lr"] = float(self.opt.param_groups[0]["lr"])
        out["bytes_sent"] = float(self.comm.bytes_sent - self.measurement_bytes)
        self._write(out, step)
        self._reset_window()
        return out

    def log_validation(self, step: int, metrics: dict[str, float]) -> None:
        """Write evaluation metrics (rank 0).

        Args:
            step: the global step for the x axis.
            metrics: keys among ``val_loss``, ``val_accuracy``, ``val_nll`` and ``train_full_loss``.
        """
        unknown = sorted(set(metrics) - set(_EVAL_KEYS))
        if unknown:
            raise ValueError(
                f"log_validation: unknown metric(s) {unknown}; use {', '.join(_EVAL_KEYS)}"
            )
        self._write({**metrics, "train_s": self.total_seconds}, step)

    def _write(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        walltime = self.wall_start + self.total_seconds
        for key, value in values.items():
            text = None if key in self._described else DESCRIPTIONS[key]
            self._described.add(key)
            summary = dashboard.scalar_summary(TAGS[key], value, text)
            self.writer.file_writer.add_summary(summary, step, walltime)
        self.writer.flush()

    def mean_iteration_ms(self) -> float:
        """Mean wall time per iteration over the whole run so far (this rank), in ms."""
        return 1000.0 * self.total_seconds / max(self.total_iterations, 1)

    def close(self) -> None:
        """Flush and close the event file."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
