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

Streaming (``fragments=P``) and eager updates (``eager=True``) run through the same two
functions, one fragment at a time: the split, the schedule and their recurrences are in
:mod:`hvd_slowmo.fragments`.
"""

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .buffers import averageable_buffers, reset_buffers
from .comm.base import Communicator, PendingAverage
from .progress import PROGRESS, all_finite, finite_verdict, progress_probe, read_progress
from .slowmo import eager_anchor_, eager_landed_

__all__ = ["PendingOuterStep", "land_outer_step", "load_pending", "start_outer_step"]


def _clone(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class PendingOuterStep:
    """An outer step whose exact average is in flight.

    Attributes:
        apply_at: the inner step at which the slow step lands (the delay ``d`` after the
            fragment's boundary, counted in the inner steps of its period).
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
        fragment: the fragment in flight (:mod:`hvd_slowmo.fragments`); 0 for the whole model.
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
    fragment: int = 0
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
            "fragment": self.fragment,
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
def start_outer_step(opt: Any, fragment: int = 0) -> None:
    """The boundary of an overlapped outer step (of one fragment): snapshot, start the averages,
    take the provisional step (eager), go on. Collective.

    Args:
        opt: a :class:`hvd_slowmo.DistributedOptimizer` with ``overlap >= 1`` or ``fragments >
            1``, at the fragment's boundary.
        fragment: which fragment (0 for the whole model).
    """
    opt.base.before_average()  # push-sum: every message home, parameters hold numerators
    t0 = time.perf_counter()
    members = opt.fragment_members[fragment]
    last = fragment == len(opt.fragment_members) - 1  # the period's end: model buffers go too
    live = [opt.params[j] for j in members]
    params = [p.detach() for p in live]
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
        opt.model_buffers if opt.average and last else [],
        averageable_buffers(opt.optimizer.state, live) if opt.buffers == "average" else [],
        [float(g["lr"]) for g in opt.param_groups],
        opt.config.overlap + (0 if last else opt.inner_step),
        exact,
        mine,
    )
    opt.pending.fragment = fragment
    if opt.config.eager:
        _provisional_step(opt, opt.pending, members)
        torch._foreach_copy_(params, opt.pending.snapshot)
    opt.timings["average"] += time.perf_counter() - t0
    if last:
        opt.inner_step = 0
        opt.outer_steps += 1


def _by_group(opt: Any, members: list[int]) -> list[tuple[int, list[int]]]:
    """The positions in ``members`` of each param group's parameters, per group."""
    group_of = [g for g, group in enumerate(opt.param_groups) for _ in group["params"]]
    out = []
    for g in range(len(opt.param_groups)):
        pos = [k for k, j in enumerate(members) if group_of[j] == g]
        if pos:
            out.append((g, pos))
    return out


def _provisional_step(opt: Any, pending: PendingOuterStep, members: list[int]) -> None:
    """Eager updates: the snapshot becomes the provisional anchor ``x^0`` (recurrence in
    :mod:`hvd_slowmo.fragments`), from which this worker continues until the landing."""
    state = opt.slow_state
    if opt.eager_shares is None:  # no previous outer step: the other workers' shares are 0
        opt.eager_shares = [torch.zeros_like(p) for p in opt.params]
    cfg = opt.config
    for g, pos in _by_group(opt, members):
        lr = pending.lrs[g]
        if lr <= 0:  # no slow step at lr = 0 (the landing keeps the average): nothing to guess
            continue
        idx = [members[k] for k in pos]
        eager_anchor_(
            [pending.snapshot[k] for k in pos],
            [state.anchor[j] for j in idx],
            None if state.slow_buffer is None else [state.slow_buffer[j] for j in idx],
            [opt.eager_shares[j] for j in idx],
            lr,
            cfg.slow_lr,
            cfg.slow_momentum,
            opt.comm.size,
            nesterov=cfg.nesterov,
        )


def _replica_spread(opt: Any, pending: PendingOuterStep, members: list[int]) -> float:
    """This worker's RMS distance from the average at the boundary, ``|s_i - avg|``, over the
    fragment (before the slow step; with eager updates ``s_i - avg = (x0 - avg) + lr m c_i``,
    since the snapshot holds the provisional anchor)."""
    if not pending.sent:
        return 0.0
    diff = list(torch._foreach_sub(pending.snapshot, pending.sent))
    if opt.config.eager:
        for g, pos in _by_group(opt, members):
            if pending.lrs[g] > 0:  # else no provisional step was taken: the snapshot is s_i
                for k in pos:
                    j = members[k]
                    diff[k] = (opt.slow_state.anchor[j] - pending.sent[k]).add_(
                        opt.eager_shares[j], alpha=pending.lrs[g] * opt.comm.size
                    )
    square = sum(float(d.double().square().sum()) for d in diff)
    return (square / max(sum(d.numel() for d in diff), 1)) ** 0.5


@torch.no_grad()
def land_outer_step(opt: Any) -> None:
    """The slow step of the outer step in flight (``opt.pending``, one fragment); each worker
    keeps its progress since the snapshot (since the provisional anchor, with eager updates).
    Collective.

    Args:
        opt: a :class:`hvd_slowmo.DistributedOptimizer` with an outer step in flight.
    """
    pending, opt.pending = opt.pending, None
    t0 = time.perf_counter()
    members = opt.fragment_members[pending.fragment]
    last = pending.fragment == len(opt.fragment_members) - 1
    live = [opt.params[j] for j in members]
    params = [p.detach() for p in live]
    exact = opt.config.exact_average

    def average_now() -> PendingAverage:
        return opt.slow_state.average_start_(pending.sent, pending.extra_sent, exact)

    everyone = pending.check_progress(opt.comm)
    if everyone is not None and not finite_verdict(
        everyone, opt.nonfinite, opt.num_steps, opt.outer_steps
    ):
        # nonfinite="skip" (whole model only): every worker restarts from the previous anchor
        # (the steps since the boundary are dropped too); the average, which holds the NaN, is
        # not used, nor are the eager shares of this outer step.
        pending.wait(average_now)
        opt.base.before_average()
        opt.slow_state.restore_(params)
        reset_buffers(opt.optimizer.state, live)
        opt.base.after_average(True)
        opt.eager_shares = None
        return
    pending.wait(average_now)
    opt.base.before_average()  # push-sum: the last steps' messages home
    opt.base.after_average(False)  # the progress is measured on de-biased parameters
    opt.replica_spread = _replica_spread(opt, pending, members)
    if opt.config.eager:
        anchor = opt.slow_state.anchor
        for g, pos in _by_group(opt, members):
            if pending.lrs[g] > 0:
                idx = [members[k] for k in pos]
                eager_landed_(
                    [opt.eager_shares[j] for j in idx],
                    [anchor[j] for j in idx],
                    [pending.sent[k] for k in pos],
                    pending.lrs[g],
                )
    t1 = time.perf_counter()
    groups = [dict(g, lr=lr) for g, lr in zip(opt.param_groups, pending.lrs)]
    groups += opt.param_groups[len(groups) :]
    if len(opt.fragment_members) > 1:
        t1 += opt.slow_state.update_(pending.sent, groups, members)
    else:
        t1 += opt.slow_state.update_(pending.sent, groups)
    _land(pending, params, opt.model_buffers if opt.average and last else [])
    if opt.buffers == "reset":
        reset_buffers(opt.optimizer.state, live)
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
    fragment, count = saved.get("fragment", 0), len(opt.fragment_members)
    if saved.get("fragments", 1) != count or fragment not in range(count):
        raise ValueError(
            f"load_state_dict: the state was saved with fragments={saved.get('fragments', 1)!r} "
            f"and one in flight, this optimizer has fragments={count}: resume with the "
            "fragments it was saved with, or save when opt.pending is None"
        )
    if not inner < saved["apply_at"] <= opt.tau:
        raise ValueError(
            f"load_state_dict: the outer step in flight lands at inner step {saved['apply_at']}, "
            f"outside ({inner}, tau={opt.tau}]: the state was saved with another tau or overlap"
        )
    live = [opt.params[j] for j in opt.fragment_members[fragment]]
    params = [p.detach() for p in live]
    extra = opt.model_buffers if opt.average and fragment == count - 1 else []

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
        state_saved = averageable_buffers(by_param, live)
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
        fragment=fragment,
    )
