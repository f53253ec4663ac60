"""The overlapped (delayed) outer step: the exact average runs behind ``d`` base steps.

SlowMo (arXiv 1910.00643, Algorithm 1) stops every worker at each outer-step boundary for the
exact average. With ``overlap=d`` (``1 <= d < tau``) the boundary only takes a snapshot and
starts its average in the background (Horovod's asynchronous grouped allreduce); every worker
goes on with ``d`` base steps from its own parameters, then the slow step is applied. In the
spirit of streaming/overlapped DiLoCo (Douillard et al. 2025; Kale et al. 2025), with SlowMo's
update. For outer step ``t``, whose boundary is global step ``n_t = (t + 1) tau``::

    s_i   = x_i(n_t)                       the snapshot (numerators for push-sum bases)
    avg   = mean_i s_i                     in flight during steps n_t+1 .. n_t+d
    gamma = each param group's lr at n_t   (what the non-overlapped step would read)
    at step n_t + d:
      u     <- beta u + (x0 - avg) / gamma
      x0    <- x0 - alpha gamma u
      x_i   <- x0 + (x_i - s_i)            each worker keeps its progress since the snapshot

What is stale: the ``d`` steps after a boundary start from the worker's own (un-averaged)
parameters, and the next pseudo-gradient ``x0 - avg`` (measured from the new anchor) includes
their progress: every pseudo-gradient still covers exactly ``tau`` base steps per worker, of
which the first ``d`` were taken before the previous slow step landed. The slow buffer sees the
same sequence of pseudo-gradients as without overlap, each computed from that slightly stale
start. Model buffers (BatchNorm statistics) and, with ``buffers="average"``, the base
optimizer's buffers follow the same rule (average of the snapshot plus own progress);
``buffers="reset"`` resets at the apply step. With ``d = 0`` none of this runs.

Push-sum bases: the snapshot averages the numerators (their mean is the consensus value), the
progress is taken on the de-biased parameters, and the weight returns to 1 when the slow step
lands; ``average=False`` keeps each worker's own weight. The progress check (equal step counts,
finite parameters) rides in the background too, under the same collective name as
:meth:`~hvd_slowmo.DistributedOptimizer.finish` uses, and is read at the apply step. Memory:
two more copies of the parameters (the snapshot and the tensors in flight).
"""

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .buffers import averageable_buffers, reset_buffers
from .comm.base import Communicator, PendingAverage
from .progress import PROGRESS, all_finite, finite_verdict, progress_probe, read_progress

__all__ = ["PendingOuterStep", "land_outer_step", "load_pending", "start_outer_step"]


def _clone(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class PendingOuterStep:
    """An outer step whose exact average is in flight.

    Attributes:
        apply_at: the inner step at which the slow step lands (the delay ``d``).
        lrs: each param group's lr at the boundary.
        sent: what is averaged: the parameters at the boundary (numerators for push-sum); after
            the average (and the slow update), the new anchor.
        snapshot: the parameters at the boundary, de-biased (the progress is measured from them).
        extra_sent, extra_snapshot: the same for the model buffers.
        state_sent, state_snapshot: the same for the base optimizer's buffers
            (``buffers="average"``); ``state_live`` are the live buffers they belong to.
        mine: this worker's progress at the boundary (the probe's plain values), or None when
            nothing is checked (``nonfinite="ignore"``).
        probe: the progress probe, averaged in the background (None without a check).
        averaged: whether ``sent`` already holds the average (after :meth:`wait`).
    """

    apply_at: int
    lrs: list[float]
    sent: list[Tensor]
    snapshot: list[Tensor]
    extra_sent: list[Tensor]
    extra_snapshot: list[Tensor]
    state_sent: list[Tensor]
    state_snapshot: list[Tensor]
    state_live: list[Tensor]
    mine: dict[str, Any] | None = None
    probe: Tensor | None = None
    averaged: bool = False
    _average: PendingAverage | None = None
    _others: tuple[PendingAverage, ...] = ()

    def check_progress(self, comm: Communicator) -> list[dict[str, Any]] | None:
        """Wait for the progress probe and read it (see :func:`hvd_slowmo.progress.read_progress`);
        None when nothing was checked. Collective only when something is wrong.

        Args:
            comm: the communicator over all workers.
        """
        if self.mine is None or self.probe is None:
            return None
        for pending in self._others[:1]:  # the probe is started first
            pending.wait()
        return read_progress(comm, self.probe, self.mine)

    def wait(self, average_now: Any) -> None:
        """Finish the averages: wait for those in flight, or (after a resume, or for a slow state
        that does not overlap) run the deferred one now. Collective when it runs one.

        Args:
            average_now: ``slow_state.average_start_`` (called when nothing was started).
        """
        for pending in self._others:
            pending.wait()
        if not self.averaged:
            if self._average is None:
                self._average = average_now()
            self._average.wait()
            self.averaged = True

    def state_dict(self) -> dict[str, Any]:
        """Everything to finish this outer step in a new process. Waits for an average in flight
        (so a checkpoint taken now continues bit for bit): collective, like the whole
        ``state_dict()`` under ``overlap``."""
        for pending in self._others:
            pending.wait()
        if self._average is not None and self._average.started:
            self._average.wait()
            self.averaged = True
        return {
            "apply_at": self.apply_at,
            "lrs": list(self.lrs),
            "averaged": self.averaged,
            "sent": self.sent,
            "snapshot": self.snapshot,
            "extra_sent": self.extra_sent,
            "extra_snapshot": self.extra_snapshot,
            "state_sent": self.state_sent,
            "state_snapshot": self.state_snapshot,
            "mine": self.mine,
            "probe": self.probe,
        }


def _snapshot(
    comm: Communicator,
    slow_state: Any,
    params: list[Tensor],
    sent: list[Tensor],
    extra: list[Tensor],
    state_buffers: list[Tensor],
    lrs: list[float],
    delay: int,
    exact: bool,
    mine: dict[str, Any] | None,
) -> PendingOuterStep:
    """Snapshot this worker and start the outer step's averages in the background. Collective.

    Args:
        comm: the communicator over all workers.
        slow_state: the optimizer's slow state (its ``average_start_``).
        params: the parameters, de-biased (their snapshot measures the progress).
        sent: the copies to average (numerators for push-sum bases).
        extra: the model buffers to average.
        state_buffers: the base optimizer's buffers to average (``buffers="average"``), or [].
        lrs: each param group's current lr.
        delay: the inner steps until the slow step lands.
        exact: whether the parameters need averaging (False: ``sent`` is this worker's own).
        mine: this worker's progress for the check, or None (``nonfinite="ignore"``).
    """
    pending = PendingOuterStep(
        apply_at=delay,
        lrs=list(lrs),
        sent=sent,
        snapshot=_clone(params),
        extra_sent=_clone(extra),
        extra_snapshot=_clone(extra),
        state_sent=_clone(state_buffers),
        state_snapshot=_clone(state_buffers),
        state_live=list(state_buffers),
    )
    others = []
    if mine is not None:
        pending.mine = dict(mine, finite=all_finite(params))
        pending.probe = progress_probe(pending.mine)
        others.append(comm.average_start([pending.probe], name=PROGRESS))
    if state_buffers:
        others.append(comm.average_start(pending.state_sent, name="hvd_slowmo.buffer_average"))
    pending._others = tuple(others)
    pending._average = slow_state.average_start_(pending.sent, pending.extra_sent, exact)
    return pending


@torch.no_grad()
def start_outer_step(opt: Any) -> None:
    """The boundary of an overlapped outer step: snapshot, start the averages, go on. Collective.

    Args:
        opt: a :class:`hvd_slowmo.DistributedOptimizer` with ``overlap >= 1``, at the boundary.
    """
    opt.base.before_average()  # push-sum: every message home, parameters hold numerators
    t0 = time.perf_counter()
    params = [p.detach() for p in opt.params]
    exact = opt.config.exact_average
    sent = _clone(params) if exact else []
    opt.base.after_average(False)  # de-biased; a push-sum weight is kept until landing
    mine = None
    if opt.nonfinite != "ignore":
        mine = {"at": "outer step", "finite": True, "num_steps": opt.num_steps,
                "outer_steps": opt.outer_steps}  # fmt: skip
    opt.pending = _snapshot(
        opt.comm,
        opt.slow_state,
        params,
        sent or _clone(params),
        opt.model_buffers if opt.average else [],
        averageable_buffers(opt.optimizer.state, opt.params) if opt.buffers == "average" else [],
        [float(g["lr"]) for g in opt.param_groups],
        opt.config.overlap,
        exact,
        mine,
    )
    opt.timings["average"] += time.perf_counter() - t0
    opt.inner_step = 0
    opt.outer_steps += 1


@torch.no_grad()
def land_outer_step(opt: Any) -> None:
    """The slow step of the outer step in flight (``opt.pending``); each worker keeps its
    progress since the snapshot. Collective.

    Args:
        opt: a :class:`hvd_slowmo.DistributedOptimizer` with an outer step in flight.
    """
    pending, opt.pending = opt.pending, None
    t0 = time.perf_counter()
    params = [p.detach() for p in opt.params]
    exact = opt.config.exact_average

    def average_now() -> PendingAverage:
        return opt.slow_state.average_start_(pending.sent, pending.extra_sent, exact)

    everyone = pending.check_progress(opt.comm)
    if everyone is not None and not finite_verdict(
        everyone, opt.nonfinite, opt.num_steps, opt.outer_steps
    ):
        # nonfinite="skip": every worker restarts from the previous anchor (the steps since the
        # boundary are dropped too); the average, which holds the NaN, is not used.
        pending.wait(average_now)
        opt.base.before_average()
        opt.slow_state.restore_(params)
        reset_buffers(opt.optimizer.state, opt.params)
        opt.base.after_average(True)
        return
    pending.wait(average_now)
    opt.base.before_average()  # push-sum: the last steps' messages home
    opt.base.after_average(False)  # the progress is measured on de-biased parameters
    t1 = time.perf_counter()
    groups = [dict(g, lr=lr) for g, lr in zip(opt.param_groups, pending.lrs)]
    t1 += opt.slow_state.update_(pending.sent, groups + opt.param_groups[len(groups) :])
    _land(pending, params, opt.model_buffers if opt.average else [])
    if opt.buffers == "reset":
        reset_buffers(opt.optimizer.state, opt.params)
    if opt.average:
        opt.base.after_average(True)  # push-sum weight back to 1
    opt.timings["average"] += t1 - t0  # the exposed part only: the wait for the average
    opt.timings["slow_update"] += time.perf_counter() - t1


@torch.no_grad()
def _land(pending: PendingOuterStep, params: list[Tensor], extra: list[Tensor]) -> None:
    """Each worker's model becomes the new anchor plus its progress since the snapshot
    (``pending.sent`` holds the new anchor); model and optimizer buffers likewise become their
    average plus their progress.

    Args:
        pending: the outer step, averaged and slow-updated.
        params: the parameters, de-biased.
        extra: the model buffers.
    """
    for live, avg, snap in (
        (params, pending.sent, pending.snapshot),
        (extra, pending.extra_sent, pending.extra_snapshot),
        (pending.state_live, pending.state_sent, pending.state_snapshot),
    ):
        if live:
            torch._foreach_sub_(live, snap)
            torch._foreach_add_(live, avg)


def load_pending(
    opt: Any, saved: Any, inner: int, base_state: dict[str, Any]
) -> PendingOuterStep | None:
    """Check a saved outer step in flight against ``opt``; changes nothing. Its optimizer
    buffers (``buffers="average"``) are bound by the caller once the base state is loaded.

    Args:
        opt: the :class:`hvd_slowmo.DistributedOptimizer` loading it.
        saved: :meth:`PendingOuterStep.state_dict` output, or None.
        inner: the saved inner step.
        base_state: the saved base optimizer's ``state_dict``.

    Raises:
        ValueError: the entry does not belong to this model or configuration.
    """
    if saved is None:
        return None
    if not opt.config.overlap:
        raise ValueError(
            "load_state_dict: the state was saved with an outer step in flight (overlap >= 1); "
            "resume with the overlap it was saved with, or save when opt.pending is None"
        )
    if not isinstance(saved, dict) or not isinstance(saved.get("apply_at"), int):
        raise ValueError(
            "load_state_dict: 'overlap' is not an outer step in flight: a damaged state"
        )
    if not inner < saved["apply_at"] < opt.tau:
        raise ValueError(
            f"load_state_dict: the outer step in flight lands at inner step {saved['apply_at']}, "
            f"outside ({inner}, tau={opt.tau}): the state was saved with another tau or overlap"
        )
    params = [p.detach() for p in opt.params]
    extra = opt.model_buffers if opt.average else []

    def like(key: str, model: list[Tensor]) -> list[Tensor]:
        tensors = saved.get(key)
        if (
            not isinstance(tensors, list)
            or len(tensors) != len(model)
            or any(not isinstance(t, Tensor) or t.shape != m.shape for t, m in zip(tensors, model))
        ):
            raise ValueError(f"load_state_dict: 'overlap.{key}' does not match this model")
        return [t.detach().to(m.device, m.dtype).clone() for t, m in zip(tensors, model)]

    state_saved: list[Tensor] = []
    if opt.buffers == "average":
        saved_state = base_state.get("state", {})
        by_param = {p: saved_state[i] for i, p in enumerate(opt.params) if i in saved_state}
        state_saved = averageable_buffers(by_param, opt.params)
    return PendingOuterStep(
        apply_at=saved["apply_at"],
        lrs=[float(lr) for lr in saved.get("lrs", [])],
        sent=like("sent", params),
        snapshot=like("snapshot", params),
        extra_sent=like("extra_sent", extra),
        extra_snapshot=like("extra_snapshot", extra),
        state_sent=like("state_sent", state_saved),
        state_snapshot=like("state_snapshot", state_saved),
        state_live=[],
        mine=saved.get("mine"),
        probe=None if saved.get("probe") is None else saved["probe"].clone(),
        averaged=bool(saved.get("averaged")),
    )
