"""One fragment's outer step (SlowMo, arXiv 1910.00643, Algorithm 1; streaming, arXiv
2501.18512): the object that owns a fragment's parameters, its boundary in the period, its outer
state (its slow state: anchor and slow buffer or outer optimizer; its exchange, with a codec's
residual; its eager estimate), its outer step in flight (the snapshot and the tensors being
averaged) and its entry of the saved state. The whole model is the one-fragment case.

Its life, driven by :class:`hvd_slowmo.outer_step.OuterLoop` (the scheduler)::

    start(base, ...)        at the fragment's boundary: snapshot, start the exchange and the
                            progress probe; with eager updates, the provisional slow step
    land(base)              ``overlap`` steps later (at once with overlap=0): read the probe
                            (False: a worker is non-finite, the scheduler skips), finish the
                            average, slow update of the fragment's anchor, carry the progress
    drop()                  a restart: forget what is in flight and the estimate

At the boundary the base algorithm brings its messages home, and the exact average of the
fragment's parameters (with the model buffers for the fragment that ends the period, and the base
optimizer's buffers under ``buffers="average"``) starts together with a 4-number progress probe
(equal step counts, finite parameters). ``d = overlap`` base steps later it lands: the probe is
read, then either every worker skips (a non-finite worker under ``nonfinite="skip"``: back to
the anchor) or the slow update runs on the average and each worker keeps its progress since the
boundary. With ``d = 0`` (the paper's algorithm) start and landing run in the same step, on the
parameters themselves, and no copy is made. For the outer step whose boundary is global step
``n_t`` (over the fragment's parameters and anchor; the streaming and eager recurrences:
:mod:`hvd_slowmo.fragments`)::

    s_i   = x_i(n_t)                        snapshot (numerators for push-sum bases)
    avg   = mean_i s_i                      in flight during steps n_t+1 .. n_t+d
    gamma = each param group's lr at n_t    (what the non-overlapped step reads)
    at step n_t + d:
      u     <- beta u + (x0 - avg) / gamma
      x0    <- x0 - alpha gamma u
      x_i   <- x0 + (x_i - s_i)             each worker keeps its progress since the snapshot
               + mix (s_i - x0)             and, with ``mix > 0``, part of its own difference
                                            from the new anchor (:func:`hvd_slowmo.slowmo.land_`)

What is stale with ``d >= 1``: the ``d`` steps after a boundary start from the worker's own,
un-averaged parameters, and the next pseudo-gradient (measured from the new anchor) includes
their progress; every pseudo-gradient still covers exactly ``tau`` base steps per worker, and the
slow buffer sees one per outer step. Model buffers and, with ``buffers="average"``, the base
optimizer's buffers follow the same rule; ``buffers="reset"`` resets at the landing. Push-sum
bases average the numerators (their mean is the consensus value), measure the progress on the
de-biased parameters, and return the weight to 1 when the slow step lands (``average=False``
keeps each worker's own weight). Cost of ``d >= 1``: two more copies of the parameters (the
snapshot and the tensors in flight).
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .bases.base import BaseAlgorithm
from .buffers import averageable_buffers, reset_buffers
from .comm.base import Communicator, PendingAverage
from .comm.hierarchy import Hierarchy
from .compression.offload import CodecThread
from .config import SlowMoConfig
from .eager import EagerEstimate, GroupSlice, check_shares, make_estimate
from .exchange import Exchange, HierarchicalExchange, Payload, make_exchange
from .fragments import boundaries
from .islands import LocalViews
from .merge import Merged, Work, make_tally, read_tally
from .progress import PROGRESS, all_finite, finite_verdict, progress_probe, read_progress
from .slow_state import LoadedSlowState, SlowState, make_slow_state
from .slowmo import land_
from .state_format import check_in_flight
from .timing import PhaseTimer

__all__ = [
    "Fragment",
    "InFlight",
    "LoadedFragment",
    "OuterParts",
    "make_fragments",
    "make_outer_states",
]


def _clone(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class OuterParts:
    """What every fragment's outer step works with (shared, owned by the optimizer; a
    fragment's own state is the fragment's).

    Attributes:
        config: the optimizer's configuration.
        comm: the communicator over all workers.
        optimizer: the wrapped optimizer (its param groups' lrs, its buffers).
        params: every parameter as the outer step reads and writes it (its local tensor:
            :class:`~hvd_slowmo.islands.LocalViews`), in the index order used on every rank;
            ``params.keys`` are the parameters themselves (the base optimizer's state keys).
        names: every parameter's name (for messages), in the same order.
        model_buffers: floating-point model buffers (averaged with the fragment that ends the
            period).
        timer: the optimizer's phase timer.
    """

    config: SlowMoConfig
    comm: Communicator
    optimizer: torch.optim.Optimizer
    params: LocalViews
    names: list[str]
    model_buffers: list[Tensor]
    timer: PhaseTimer


@dataclass
class InFlight:
    """A fragment's outer step between its start (the boundary) and its landing.

    Attributes:
        land_at: the inner step at which it lands (0: in the boundary's own step).
        lrs: each param group's lr at the boundary.
        sent: the tensors averaged, then slow-updated into the new anchor: the parameters
            themselves when it lands at once, else a copy of them (numerators for push-sum).
        snapshot: the de-biased parameters at the boundary (the progress is measured from
            them; with eager updates the provisional anchor); None when it lands at once.
        extra_sent, extra_snapshot: the same for the model buffers.
        state_sent, state_snapshot: the same for the base optimizer's buffers
            (``buffers="average"``); ``state_live`` are the live buffers they belong to.
        mine: this worker's progress at the boundary, or None when nothing is checked
            (``nonfinite="ignore"``).
        probe: the progress probe (averaged over workers once its collective completed).
        averaged, state_averaged: whether ``sent`` (with the model buffers), and the base
            optimizer's buffers, hold their averages.
        fragment: the fragment's index (0: the whole model).
        tally: this worker's tally (the merge's weight and lrs, the period's step time),
            averaged with ``sent`` (:mod:`hvd_slowmo.merge`), or None.
    """

    land_at: int
    lrs: list[float]
    sent: list[Tensor]
    snapshot: list[Tensor] | None
    extra_sent: list[Tensor]
    extra_snapshot: list[Tensor] | None
    state_sent: list[Tensor]
    state_snapshot: list[Tensor] | None
    state_live: list[Tensor] = field(default_factory=list)
    mine: dict[str, Any] | None = None
    probe: Tensor | None = None
    averaged: bool = False
    state_averaged: bool = False
    fragment: int = 0
    tally: Tensor | None = None
    _probe_handle: PendingAverage | None = None
    _average: PendingAverage | None = None
    _state_average: PendingAverage | None = None

    @property
    def in_place(self) -> bool:
        """Whether it lands in the boundary's own step, on the parameters themselves."""
        return self.snapshot is None

    def start_averages(self, comm: Communicator, exchange: Exchange, exact: bool) -> None:
        """Start the averages not yet started or done: the parameters with the model buffers
        (through the fragment's exchange) and the base optimizer's buffers. Collective.

        Args:
            comm: the communicator over all workers.
            exchange: the fragment's exchange.
            exact: whether the parameters need averaging (False: ``sent`` is this worker's own).
        """
        if not self.averaged and self._average is None:
            self._average = exchange.start(Payload(self.sent, self.extra_sent, self.tally), exact)
        if self.state_sent and not self.state_averaged and self._state_average is None:
            self._state_average = comm.average_start(
                self.state_sent, name="hvd_slowmo.buffer_average"
            )

    def poll(self) -> None:
        """Advance the parameters' average if it runs in stages; never blocks."""
        if self._average is not None:
            self._average.done()

    def finish_averages(self, deferred: bool) -> None:
        """Wait for the averages in flight; ``deferred`` also runs those an exchange could not
        start in the background (collective).

        Args:
            deferred: run deferred averages too (False: only complete what is in flight).
        """
        if self._probe_handle is not None:
            self._probe_handle.wait()
        if self._average is not None and (deferred or self._average.started):
            self._average.wait()
            self._average, self.averaged = None, True
        if self._state_average is not None and (deferred or self._state_average.started):
            self._state_average.wait()
            self._state_average, self.state_averaged = None, True

    def read_progress(self, comm: Communicator) -> list[dict[str, Any]] | None:
        """Every worker's progress at the boundary, from the probe (None when nothing was
        checked). Collective only when something is wrong.

        Args:
            comm: the communicator over all workers.
        """
        if self.mine is None or self.probe is None:
            return None
        if self._probe_handle is not None:
            self._probe_handle.wait()
            self._probe_handle = None
        return read_progress(comm, self.probe, self.mine)

    def state_dict(self) -> dict[str, Any]:
        """Everything to finish this outer step in a new process; waits for the averages in
        flight first (collective), so a checkpoint taken now continues bit for bit."""
        self.finish_averages(deferred=False)
        return {
            "land_at": self.land_at,
            "lrs": list(self.lrs),
            "averaged": self.averaged,
            "state_averaged": self.state_averaged,
            "sent": self.sent,
            "snapshot": self.snapshot,
            "extra_sent": self.extra_sent,
            "extra_snapshot": self.extra_snapshot,
            "state_sent": self.state_sent,
            "state_snapshot": self.state_snapshot,
            "mine": self.mine,
            "probe": self.probe,
            **({"tally": self.tally} if self.tally is not None else {}),
        }


@dataclass
class LoadedFragment:
    """A fragment's checked saved entry, ready for :meth:`Fragment.commit_load`.

    Attributes:
        slow_state: its slow state, checked (:meth:`SlowState.prepare_load`).
        in_flight: its outer step in flight, or None.
        shares: its eager shares, or None.
        exchange: its exchange's saved state (taken where it is this worker's own).
    """

    slow_state: LoadedSlowState
    in_flight: InFlight | None
    shares: list[Tensor] | None
    exchange: dict[str, Any] | None


class Fragment:
    """One fragment of the parameters and its outer step.

    Args:
        index: the fragment's index ``k``.
        members: its parameters' indices, in the optimizer's order (the list is the fragment's:
            the whole model's grows with ``add_param_group``).
        boundary: the inner step of the period at which its outer step starts
            (:func:`hvd_slowmo.fragments.boundaries`).
        ends_period: whether its boundary ends the period (the last fragment: the model
            buffers travel with it, and the counters turn over).
        parts: what every fragment works with.
        slow_state: its slow state, over its parameters alone (:mod:`hvd_slowmo.slow_state`).
        exchange: its exchange (:mod:`hvd_slowmo.exchange`), with what it keeps over its
            parameters alone (a codec's residual).

    Attributes:
        eager: its eager estimate (:mod:`hvd_slowmo.eager`), over its slow state.
        in_flight: its outer step in flight, or None.
        work: what its next pseudo-gradient covers (:class:`~hvd_slowmo.merge.Work`), when a
            tally travels with its average (``merge="samples"`` or ``period_seconds``), else None.
        merged: what the tally of its last landed outer step said, or None.
    """

    def __init__(
        self,
        index: int,
        members: list[int],
        boundary: int,
        ends_period: bool,
        parts: OuterParts,
        slow_state: SlowState,
        exchange: Exchange,
    ) -> None:
        self.index, self.members, self.boundary = index, members, boundary
        self.ends_period, self.parts = ends_period, parts
        self.slow_state, self.exchange = slow_state, exchange
        self.eager: EagerEstimate = make_estimate(parts.config, parts.comm, slow_state)
        self.in_flight: InFlight | None = None
        cfg = parts.config
        self.work = Work(cfg.timed, cfg.tau) if cfg.tallied else None
        self.merged: Merged | None = None

    # --- what it is made of ----------------------------------------------------------------
    def keys(self) -> list[Tensor]:
        """Its parameters themselves (the base optimizer's state keys), in the optimizer's
        order."""
        return [self.parts.params.keys[j] for j in self.members]

    def live(self) -> list[Tensor]:
        """Its parameters (detached), in the optimizer's order."""
        return [self.parts.params[j].detach() for j in self.members]

    def group_of(self) -> list[int]:
        """The param group of each of its parameters."""
        param_groups = self.parts.optimizer.param_groups
        group_of = [g for g, group in enumerate(param_groups) for _ in group["params"]]
        return [group_of[j] for j in self.members]

    def capture_(self) -> None:
        """Its slow state takes the anchor from its parameters, once (called at every step)."""
        # Without an anchor to keep (no slow update, no skip) nothing is ever captured: no
        # lists are built at every step for it.
        if self.parts.config.keeps_anchor and not self.slow_state.captured:
            self.slow_state.capture_(self.live(), self.group_of())

    def add_(self, new: list[Tensor]) -> None:
        """Parameters appended to this (the only) fragment by ``add_param_group``: its members,
        slow state and eager shares grow.

        Args:
            new: the new parameters (already appended to the parameter list).
        """
        count = len(self.parts.params)
        self.members.extend(range(count - len(new), count))
        self.slow_state.add_(self.live(), self.group_of())
        self.eager.extend(new)

    def restore_(self) -> None:
        """Back to the anchor: its parameters take the anchor (collective for a sharded
        layout), and what its exchange kept is dropped with the steps since."""
        self.slow_state.restore_(self.live())
        self.exchange.reset()

    def extra(self) -> list[Tensor]:
        """The model buffers averaged with it (those of the fragment that ends the period)."""
        return self.parts.model_buffers if self.parts.config.average and self.ends_period else []

    def groups(self, lrs: list[float]) -> list[GroupSlice]:
        """Each param group with parameters in this fragment: its lr in ``lrs`` and the
        positions of its parameters in the fragment."""
        mine = self.group_of()
        out = []
        for g in range(len(self.parts.optimizer.param_groups)):
            pos = [k for k, h in enumerate(mine) if h == g]
            if pos:
                out.append((lrs[g], pos))
        return out

    def due(self, inner_step: int) -> bool:
        """Whether its outer step in flight lands at ``inner_step``."""
        return self.in_flight is not None and inner_step == self.in_flight.land_at

    # --- the outer step's life -------------------------------------------------------------
    @torch.no_grad()
    def start(
        self,
        base: BaseAlgorithm,
        num_steps: int,
        outer_steps: int,
        samples: float = 0.0,
        seconds: float | None = None,
    ) -> None:
        """The boundary: start the outer step's averages and its progress check. With
        ``overlap=d >= 1`` the parameters are snapshot and the worker goes on (from a provisional
        slow step with eager updates); with ``d = 0`` the averages are deferred to :meth:`land`,
        in the same step, after the check (a non-finite worker is never averaged into the
        others). Collective.

        Args:
            base: the base algorithm.
            num_steps: base steps taken in total (for the progress probe).
            outer_steps: boundaries passed (for the progress probe).
            samples: the samples this worker reported in total (for a weighted merge).
            seconds: this worker's seconds per base step in the period (time-based periods).
        """
        cfg = self.parts.config
        base.before_average()  # push-sum: every message home, parameters hold numerators
        params, extra = self.live(), self.extra()
        state = averageable_buffers(self.parts.optimizer.state, self.keys())
        state = state if cfg.buffers == "average" else []
        f = self._in_flight(base, params, extra, state)
        if self.work is not None:
            comm = self.parts.comm
            ratio = self.work.ratio(samples, num_steps) if cfg.merge == "samples" else 1.0
            f.tally = make_tally(ratio, f.lrs, seconds, comm.rank, comm.size)
        if cfg.nonfinite != "ignore" and cfg.straggler is None:
            # (under a quorum a non-finite worker is left out by the exchange instead: a probe
            # averaged over every worker would wait for the late ones)
            f.mine = {"at": "outer step", "finite": all_finite(params),
                      "num_steps": num_steps, "outer_steps": outer_steps}  # fmt: skip
            # Time-based periods: the step counts differ by design; the outer steps must not.
            f.probe = progress_probe(f.mine, by="outer_steps" if cfg.timed else "num_steps")
            if base.needs_exact_average:
                f._probe_handle = self.parts.comm.average_start([f.probe], name=PROGRESS)
            # else (AR-SGD) every worker holds the same parameters after the same steps (or
            # would be stuck in another gradient average): this probe is the average.
        if f.snapshot is not None:
            f.start_averages(self.parts.comm, self.exchange, cfg.exact_average)
            if self.eager.provisional_(f.snapshot, self.groups(f.lrs)):
                torch._foreach_copy_(params, f.snapshot)
        self.in_flight = f

    def _in_flight(
        self, base: BaseAlgorithm, params: list[Tensor], extra: list[Tensor], state: list[Tensor]
    ) -> InFlight:
        """The record of the outer step starting now: on the tensors themselves when it lands
        at once (``overlap=0``), else on copies."""
        cfg = self.parts.config
        lrs = [float(g["lr"]) for g in self.parts.optimizer.param_groups]
        if cfg.overlap == 0:
            return InFlight(
                land_at=0, lrs=lrs, sent=params, snapshot=None, extra_sent=list(extra),
                extra_snapshot=None, state_sent=state, state_snapshot=None, state_live=state,
                fragment=self.index,
            )  # fmt: skip
        sent = _clone(params)
        base.after_average(False)  # de-biased; a push-sum weight is kept until the landing
        return InFlight(
            land_at=cfg.overlap + (0 if self.ends_period else self.boundary),
            lrs=lrs, sent=sent, snapshot=_clone(params), extra_sent=_clone(extra),
            extra_snapshot=_clone(extra), state_sent=_clone(state),
            state_snapshot=_clone(state), state_live=state, fragment=self.index,
        )  # fmt: skip

    @torch.no_grad()
    def land(self, base: BaseAlgorithm) -> tuple[bool, float | None]:
        """The outer step in flight lands: read the progress check; if every worker is finite,
        finish the average, run the slow update of the fragment's anchor and carry each
        worker's progress since the boundary. Collective.

        Args:
            base: the base algorithm.

        Returns:
            ``(landed, spread)``: ``landed`` False when a worker was non-finite under
            ``nonfinite="skip"`` (the averages in flight are completed and unused: the scheduler
            restarts every worker from the anchor); ``spread`` this worker's RMS distance from
            the average at the boundary (overlapped outer steps), else None.
        """
        f, self.in_flight = self.in_flight, None
        assert f is not None, "land() needs an outer step in flight"
        cfg, parts = self.parts.config, self.parts
        with parts.timer("average"):
            everyone = f.read_progress(parts.comm)
            if everyone is not None and f.mine is not None:
                if not finite_verdict(
                    everyone, cfg.nonfinite, f.mine["num_steps"], f.mine["outer_steps"]
                ):
                    f.finish_averages(deferred=False)  # a started collective completes everywhere
                    if not f.in_place:
                        base.before_average()  # push-sum: the messages since the boundary home
                    return False, None
            # Started here: overlap=0, a resumed state, or an exchange that cannot overlap.
            f.start_averages(parts.comm, self.exchange, cfg.exact_average)
            f.finish_averages(deferred=True)
            if self.exchange.resumed_at is not None:  # a late worker took the state it missed
                self._merged(f)  # time-based periods: the next counts, as every worker plans
                if cfg.buffers == "reset":
                    reset_buffers(parts.optimizer.state, self.keys())
                return True, None
            self._merged(f)
            if f.in_place:
                base.after_average(cfg.average)
            else:
                base.before_average()  # push-sum: the last steps' messages home
                base.after_average(False)  # the progress is measured on de-biased parameters
        with parts.timer("slow_update"):
            spread = None if f.in_place else self._spread(f)
            self._slow_step(f, base)
        self.exchange.landed(f.sent + f.extra_sent)
        return True, spread

    def _merged(self, f: InFlight) -> None:
        """Read the averaged tally: the slow step takes the workers' weighted mean lrs where
        they took unequal work (:mod:`hvd_slowmo.merge`)."""
        if f.tally is None:
            return
        self.merged = read_tally(f.tally, len(f.lrs), self.parts.comm.size)
        if self.work is not None:
            self.work.landed(self.merged)
        if self.merged.lrs is not None:
            f.lrs = self.merged.lrs

    def _slow_step(self, f: InFlight, base: BaseAlgorithm) -> None:
        """The slow update of the fragment's anchor from the average, at the boundary's lrs;
        each worker keeps its progress since the boundary."""
        cfg, parts = self.parts.config, self.parts
        groups = parts.optimizer.param_groups
        at_boundary = [dict(g, lr=lr) for g, lr in zip(groups, f.lrs)] + groups[len(f.lrs) :]
        self.slow_state.update_(f.sent, at_boundary)
        if not f.in_place:
            for now, avg, snap in (
                (self.live(), f.sent, f.snapshot),
                (self.extra(), f.extra_sent, f.extra_snapshot),
                (f.state_live, f.state_sent, f.state_snapshot),
            ):
                if now and snap is not None:
                    land_(now, snap, avg, cfg.mix)
        if cfg.buffers == "reset":
            reset_buffers(parts.optimizer.state, self.keys())
        if not f.in_place and cfg.average:
            base.after_average(True)  # push-sum weight back to 1

    def _spread(self, f: InFlight) -> float:
        """Before the slow step of an overlapped outer step: this worker's RMS distance from
        the average at the boundary (``opt.replica_spread``); the eager estimate updates what it
        keeps and recovers ``s_i`` where the snapshot is the provisional anchor."""
        assert f.snapshot is not None
        spread = list(torch._foreach_sub(f.snapshot, f.sent))
        self.eager.landed_(f.snapshot, f.sent, self.groups(f.lrs), spread)
        # Squared in the float64 copy itself: one copy of a tensor at a time, not two.
        square = sum(float(d.double().square_().sum()) for d in spread)
        return (square / max(sum(d.numel() for d in spread), 1)) ** 0.5

    def drop(self) -> None:
        """A restart: forget the outer step in flight and the estimate's kept state."""
        self.in_flight = None
        self.eager.reset()

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Its entry of the saved state (:mod:`hvd_slowmo.state_format`): its members, slow
        state, exchange state, outer step in flight and eager shares. Waits for its averages in
        flight first (collective): the exchange's state is read after them."""
        flight = None if self.in_flight is None else self.in_flight.state_dict()
        shares = self.eager.shares
        return {
            "members": list(self.members),
            "slow_state": self.slow_state.state_dict(),
            "exchange": self.exchange.state_dict(),
            "in_flight": flight,
            "eager_shares": None if shares is None else dict(enumerate(shares)),
        }

    def prepare_load(
        self, saved: dict[str, Any], position: dict[str, Any], base_state: dict[str, Any]
    ) -> LoadedFragment:
        """Check its entry of a saved state (current format, its members checked by the caller)
        against this fragment and configuration; changes nothing.

        Args:
            saved: its entry (:meth:`state_dict` output).
            position: the saved (checked) position.
            base_state: the saved base optimizer's ``state_dict``.

        Raises:
            ValueError: the entry does not belong to this fragment or configuration.
        """
        cfg, names = self.parts.config, self.parts.names
        params = self.live()
        slow = self.slow_state.prepare_load(
            saved["slow_state"], params, self.group_of(), position,
            [names[j] for j in self.members],
        )  # fmt: skip
        in_flight = None
        if saved.get("in_flight") is not None:
            land_at = check_in_flight(saved["in_flight"], position, cfg.tau, cfg.overlap)
            in_flight = self._prepare_in_flight(saved["in_flight"], land_at, base_state)
        shares = check_shares(saved.get("eager_shares"), params, cfg.estimate)
        return LoadedFragment(slow, in_flight, shares, saved.get("exchange"))

    def _prepare_in_flight(
        self, saved: dict[str, Any], land_at: int, base_state: dict[str, Any]
    ) -> InFlight:
        """Check a saved outer step in flight of this fragment against this model; changes
        nothing. Its base optimizer buffers are bound by :meth:`commit_load`.

        Args:
            saved: :meth:`InFlight.state_dict` output (format checked by the caller).
            land_at: its (checked) landing step.
            base_state: the saved base optimizer's ``state_dict``.

        Raises:
            ValueError: its tensors do not match this fragment.
        """
        cfg = self.parts.config
        params, extra = self.live(), self.extra()
        state: list[Tensor] = []
        if cfg.buffers == "average":
            saved_state = base_state.get("state", {})
            every = self.parts.params.keys
            by_param = {p: saved_state[i] for i, p in enumerate(every) if i in saved_state}
            state = averageable_buffers(by_param, self.keys())

        def like(key: str, model: list[Tensor]) -> list[Tensor]:
            tensors = saved.get(key)
            if (
                not isinstance(tensors, list)
                or len(tensors) != len(model)
                or any(
                    not isinstance(t, Tensor) or t.shape != m.shape for t, m in zip(tensors, model)
                )
            ):
                raise ValueError(f"load_state_dict: 'in_flight.{key}' does not match this model")
            return [t.detach().to(m.device, m.dtype).clone() for t, m in zip(tensors, model)]

        return InFlight(
            land_at=land_at,
            lrs=[float(lr) for lr in saved.get("lrs", [])],
            sent=like("sent", params),
            snapshot=like("snapshot", params),
            extra_sent=like("extra_sent", extra),
            extra_snapshot=like("extra_snapshot", extra),
            state_sent=like("state_sent", state),
            state_snapshot=like("state_snapshot", state),
            mine=saved.get("mine"),
            probe=None if saved.get("probe") is None else saved["probe"].clone(),
            averaged=bool(saved.get("averaged")),
            # Format 1 always started the buffers' average at the boundary (done when saved).
            state_averaged=bool(saved.get("state_averaged", True)),
            fragment=self.index,
            tally=None if saved.get("tally") is None else saved["tally"].clone(),
        )

    def commit_load(self, loaded: LoadedFragment) -> None:
        """Install a checked entry: its slow state, exchange state, eager shares and outer step
        in flight (after the base optimizer's state is loaded: the live buffers of
        ``buffers="average"``).

        Args:
            loaded: :meth:`prepare_load`'s result.
        """
        self.slow_state.commit_load(loaded.slow_state)
        self.exchange.load_state_dict(loaded.exchange)
        self.eager.load(loaded.shares)
        in_flight = loaded.in_flight
        if in_flight is not None and self.parts.config.buffers == "average":
            in_flight.state_live = averageable_buffers(self.parts.optimizer.state, self.keys())
        self.in_flight = in_flight


def make_outer_states(
    comm: Communicator,
    config: SlowMoConfig,
    timer: PhaseTimer,
    count: int,
    levels: Callable[[], tuple[Hierarchy, bool] | None] | None = None,
) -> list[tuple[SlowState, Exchange]]:
    """Each fragment's own slow state and exchange (built empty: a slow state takes its
    fragment's parameters at its capture). Their background work shares one thread, so the
    fragments' collectives run in one order on every worker.

    Args:
        comm: the communicator over all workers.
        config: the optimizer's configuration.
        timer: the optimizer's phase timer.
        count: the number of fragments.
        levels: with ``config.hierarchical``, builds the node and cross-node levels and says
            whether a node's ranks hold identical parameters
            (:func:`~hvd_slowmo.exchange.make_exchange`); called once, after the layouts' and
            the hierarchical exchange's refusals (building the launch's nodes is collective).

    Raises:
        ValueError, TypeError: the layout or exchange cannot run with ``config`` or ``comm``
            (:func:`~hvd_slowmo.slow_state.make_slow_state`,
            :func:`~hvd_slowmo.exchange.make_exchange`).
    """
    thread = CodecThread(comm.counter)
    slow_states = [make_slow_state(comm, config, timer) for _ in range(count)]
    built = None
    if config.hierarchical and levels is not None:
        HierarchicalExchange.check_supported(config.features())
        built = levels()
    return [(s, make_exchange(comm, config, s, built, thread)) for s in slow_states]


def make_fragments(
    parts: OuterParts, split: list[list[int]], owned: list[tuple[SlowState, Exchange]]
) -> list[Fragment]:
    """The fragments of ``split``, each with its boundary in the period and its own outer state.

    Args:
        parts: what every fragment works with.
        split: the parameter indices of each fragment (one list: the whole model).
        owned: each fragment's slow state and exchange (:func:`make_outer_states`).
    """
    starts = boundaries(parts.config.tau, len(split))
    return [
        Fragment(
            index=k,
            members=members,
            boundary=starts[k],
            ends_period=k == len(split) - 1,
            parts=parts,
            slow_state=slow_state,
            exchange=exchange,
        )
        for k, (members, (slow_state, exchange)) in enumerate(zip(split, owned))
    ]
