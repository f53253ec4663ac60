"""The outer loop of SlowMo (arXiv 1910.00643, Algorithm 1): the step counters, and the life of
each outer step (start, landing, skip, restart from the anchor, flush), owned by one object.

Every ``tau`` base steps a worker reaches a *boundary*. There the outer step **starts**: the base
algorithm brings its messages home, and the exact average of the parameters (with the model
buffers, and the base optimizer's buffers under ``buffers="average"``) is started together with a
4-number progress probe (equal step counts, finite parameters). ``d = overlap`` base steps later
it **lands**: the probe is read, then either every worker **skips** (a non-finite worker under
``nonfinite="skip"``: back to the anchor) or the slow update runs on the average and each worker
keeps its progress since the boundary. With ``d = 0`` (the paper's algorithm) start and landing
run in the same step, on the parameters themselves, and no copy is made. For outer step ``t``,
whose boundary is global step ``n_t``::

    s_i   = x_i(n_t)                        snapshot (numerators for push-sum bases)
    avg   = mean_i s_i                      in flight during steps n_t+1 .. n_t+d
    gamma = each param group's lr at n_t    (what the non-overlapped step reads)
    at step n_t + d:
      u     <- beta u + (x0 - avg) / gamma
      x0    <- x0 - alpha gamma u
      x_i   <- x0 + (x_i - s_i)             each worker keeps its progress since the snapshot

What is stale with ``d >= 1``: the ``d`` steps after a boundary start from the worker's own,
un-averaged parameters, and the next pseudo-gradient (measured from the new anchor) includes
their progress; every pseudo-gradient still covers exactly ``tau`` base steps per worker, and the
slow buffer sees one per outer step. Model buffers and, with ``buffers="average"``, the base
optimizer's buffers follow the same rule; ``buffers="reset"`` resets at the landing. Push-sum
bases average the numerators (their mean is the consensus value), measure the progress on the
de-biased parameters, and return the weight to 1 when the slow step lands (``average=False``
keeps each worker's own weight). Cost of ``d >= 1``: two more copies of the parameters (the
snapshot and the tensors in flight).

A change of workers (elastic, a state loaded by another number of workers) **restarts** the
outer step from its anchor, dropping an average in flight: the steps since that anchor are
dropped and the counters go back with them.

Streaming (``fragments=P``) gives each fragment of the parameters its own outer step at its own
inner step of the period, one fragment in flight at a time; eager updates (``eager="shares"`` or
``"local"``) let the worker continue from a provisional slow step while the average is in
flight. The split, the schedule and the recurrences: :mod:`hvd_slowmo.fragments`. ``P = 1``
without eager is the recurrence above, through the same code.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from .bases.base import BaseAlgorithm
from .buffers import averageable_buffers, reset_buffers
from .comm.base import Communicator, PendingAverage
from .config import SlowMoConfig
from .fragments import boundaries
from .progress import PROGRESS, all_finite, finite_verdict, progress_probe, read_progress
from .slow_state import SlowState
from .slowmo import eager_anchor_, eager_landed_, local_anchor_, local_gradient
from .timing import PhaseTimer

__all__ = ["InFlight", "OuterLoop", "Position"]

log = logging.getLogger("hvd_slowmo")


def _clone(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


@dataclass
class Position:
    """Where a worker is in Algorithm 1.

    Attributes:
        num_steps: base steps taken in total.
        inner_step: base steps taken since the last boundary.
        outer_steps: boundaries passed.
        world: ``(rank, size)`` of the workers the base algorithm was built for.
    """

    num_steps: int = 0
    inner_step: int = 0
    outer_steps: int = 0
    world: tuple[int, int] = (0, 1)


@dataclass
class InFlight:
    """An outer step between its start (the boundary) and its landing.

    Attributes:
        land_at: the inner step at which it lands (0: in the boundary's own step).
        lrs: each param group's lr at the boundary.
        sent: the tensors averaged, then slow-updated into the new anchor: the parameters
            themselves when it lands at once, else a copy of them (numerators for push-sum).
        snapshot: the de-biased parameters at the boundary (the progress is measured from
            them); None when it lands at once (no progress to carry).
        extra_sent, extra_snapshot: the same for the model buffers.
        state_sent, state_snapshot: the same for the base optimizer's buffers
            (``buffers="average"``); ``state_live`` are the live buffers they belong to.
        mine: this worker's progress at the boundary, or None when nothing is checked
            (``nonfinite="ignore"``).
        probe: the progress probe (averaged over workers once its collective completed).
        averaged: whether ``sent`` (and the buffers) hold their averages.
        fragment: which fragment of the parameters (:mod:`hvd_slowmo.fragments`; 0: the whole
            model); ``sent`` and ``snapshot`` hold its parameters only. With eager updates the
            snapshot holds the provisional anchor (the progress is measured from it).
    """

    land_at: int
    lrs: list[float]
    sent: list[Tensor]
    snapshot: list[Tensor] | None
    extra_sent: list[Tensor]
    extra_snapshot: list[Tensor] | None
    state_sent: list[Tensor]
    state_snapshot: list[Tensor] | None
    state_live: list[Tensor]
    mine: dict[str, Any] | None = None
    probe: Tensor | None = None
    averaged: bool = False
    state_averaged: bool = False
    fragment: int = 0
    _probe_handle: PendingAverage | None = None
    _average: PendingAverage | None = None
    _state_average: PendingAverage | None = None

    @property
    def in_place(self) -> bool:
        """Whether it lands in the boundary's own step, on the parameters themselves."""
        return self.snapshot is None

    def start_averages(
        self, comm: Communicator, slow_state: SlowState, exact: bool, indices: Sequence[int] = ()
    ) -> None:
        """Start the averages not yet started or done: the parameters with the model buffers
        (as the slow state's layout averages them) and the base optimizer's buffers. Collective.

        Args:
            comm: the communicator over all workers.
            slow_state: the slow state.
            exact: whether the parameters need averaging (False: ``sent`` is this worker's own).
            indices: which parameters ``sent`` holds (one of several fragments: a compressed
                average reads their anchor); empty for the whole model.
        """
        if not self.averaged and self._average is None:
            self._average = slow_state.average_start_(self.sent, self.extra_sent, exact, indices)
        if self.state_sent and not self.state_averaged and self._state_average is None:
            self._state_average = comm.average_start(
                self.state_sent, name="hvd_slowmo.buffer_average"
            )

    def poll(self) -> None:
        """Advance the parameters' average if it runs in stages (a compressed average starts its
        all-gather once its all-to-all is done); never blocks."""
        if self._average is not None:
            self._average.done()

    def finish_averages(self, deferred: bool) -> None:
        """Wait for the averages in flight; ``deferred`` also runs those a layout could not
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
            "apply_at": self.land_at,
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
            "fragment": self.fragment,
        }


class OuterLoop:
    """The outer loop of one worker: its position, and every outer step's start, landing, skip
    and restart. :class:`~hvd_slowmo.DistributedOptimizer` calls :meth:`advance` after each base
    step; nothing else changes the counters.

    Args:
        config: the optimizer's configuration (``tau``, ``overlap``, ``buffers``, ...).
        comm: the communicator over all workers (the exact average).
        optimizer: the wrapped optimizer (its param groups' lrs, its buffers).
        params: the parameters, in the index order used on every rank.
        model_buffers: floating-point model buffers averaged with the parameters.
        slow_state: the anchor and slow buffer.
        make_base: builds the base algorithm for the current workers (at construction and after
            every change of workers).
        timer: the optimizer's phase timer.
        fragments: the parameter indices of each fragment
            (:func:`hvd_slowmo.fragments.fragment_of`); None: one fragment, the whole model.

    Attributes:
        position: the step counters (:class:`Position`).
        in_flight: the outer step whose average is in flight (``overlap >= 1``), or None.
        base: the base algorithm.
        fragments: the parameter indices of each fragment.
        starts: the inner step of each fragment's boundary
            (:func:`~hvd_slowmo.fragments.boundaries`).
        eager_shares: ``eager="shares"``: ``c_i``, the other workers' shares of the last outer
            gradient, per parameter (None until the first boundary, after a restart or a
            skip, and always with ``eager="local"``).
        replica_spread: this worker's RMS distance ``|s_i - avg|`` from the workers' average at
            the boundary of the last outer step that landed, over its fragment (no
            communication; ``overlap >= 1`` only), or None.
    """

    def __init__(
        self,
        config: SlowMoConfig,
        comm: Communicator,
        optimizer: torch.optim.Optimizer,
        params: list[Tensor],
        model_buffers: list[Tensor],
        slow_state: SlowState,
        make_base: Callable[[], BaseAlgorithm],
        timer: PhaseTimer,
        fragments: list[list[int]] | None = None,
    ) -> None:
        self.config, self.comm, self.optimizer = config, comm, optimizer
        self.params, self.model_buffers = params, model_buffers
        self.slow_state, self.timer = slow_state, timer
        self._make_base = make_base
        self.position = Position(world=(comm.rank, comm.size))
        self.in_flight: InFlight | None = None
        self.fragments = fragments or [list(range(len(params)))]
        self.starts = boundaries(config.tau, len(self.fragments))
        self.eager_shares: list[Tensor] | None = None
        self.replica_spread: float | None = None
        self.base = make_base()
        self.base.attach(params)

    def rebuild_base(self) -> None:
        """A fresh base algorithm for the current workers (gossip graph, transport, push-sum
        weight); messages of the previous one still in flight are dropped."""
        self.base = self._make_base()
        self.base.attach(self.params)

    # --- the outer step's life -------------------------------------------------------------
    def advance(self) -> None:
        """After a base step: count it; land the outer step in flight when its delay is up, and
        start (and with ``overlap=0`` land) an outer step at a (fragment's) boundary; the last
        fragment's boundary ends the period. Collective then."""
        pos = self.position
        pos.num_steps += 1
        pos.inner_step += 1
        if self.in_flight is not None:
            self.in_flight.poll()
        lands = self.in_flight is not None and pos.inner_step == self.in_flight.land_at
        boundary = pos.inner_step in self.starts
        if not (lands or boundary):
            return
        if lands:
            self.land()
        if boundary:
            fragment = self.starts.index(pos.inner_step)
            self.start(fragment)
            if self.config.overlap == 0:
                self.land()
            if fragment == len(self.fragments) - 1:
                pos.inner_step = 0
                pos.outer_steps += 1

    @torch.no_grad()
    def start(self, fragment: int = 0) -> None:
        """The boundary (of one fragment): start the outer step's averages and its progress
        check. With ``overlap=d >= 1`` the parameters are snapshot and the worker goes on (from a
        provisional slow step with ``eager``); with ``d = 0`` the averages are deferred to
        :meth:`land`, in the same step, after the check (a non-finite worker is never averaged
        into the others). Collective.

        Args:
            fragment: which fragment's boundary (0: the whole model).
        """
        cfg, pos = self.config, self.position
        members = self.fragments[fragment]
        last = fragment == len(self.fragments) - 1  # the period's end: the model buffers go too
        live = [self.params[j] for j in members]
        with self.timer("average"):
            self.base.before_average()  # push-sum: every message home, parameters hold numerators
            params = [p.detach() for p in live]
            extra = self.model_buffers if cfg.average and last else []
            state = averageable_buffers(self.optimizer.state, live)
            state = state if cfg.buffers == "average" else []
            lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
            if cfg.overlap == 0:
                f = InFlight(0, lrs, params, None, list(extra), None, state, None, state)
            else:
                sent = _clone(params)
                self.base.after_average(False)  # de-biased; a push-sum weight is kept until landing
                land_at = cfg.overlap + (0 if last else pos.inner_step)
                f = InFlight(
                    land_at, lrs, sent, _clone(params), _clone(extra), _clone(extra),
                    _clone(state), _clone(state), state,
                )  # fmt: skip
            f.fragment = fragment
            if cfg.nonfinite != "ignore":
                f.mine = {"at": "outer step", "finite": all_finite(params),
                          "num_steps": pos.num_steps, "outer_steps": pos.outer_steps}  # fmt: skip
                f.probe = progress_probe(f.mine)
                if self.base.needs_exact_average:
                    f._probe_handle = self.comm.average_start([f.probe], name=PROGRESS)
                # else (AR-SGD) every worker holds the same parameters after the same steps (or
                # would be stuck in another gradient average): this probe is the average.
            if not f.in_place:
                f.start_averages(self.comm, self.slow_state, cfg.exact_average, self._indices(f))
                if cfg.eager:
                    self._provisional_step(f, members)
                    assert f.snapshot is not None  # not in place: a snapshot was taken
                    torch._foreach_copy_(params, f.snapshot)
            self.in_flight = f

    def _indices(self, f: InFlight) -> list[int]:
        """The parameters of ``f``'s fragment, or none (all of them) for ``fragments=1``."""
        return self.fragments[f.fragment] if len(self.fragments) > 1 else []

    def _by_group(self, members: list[int]) -> list[tuple[int, list[int]]]:
        """Each param group with the positions in ``members`` of its parameters."""
        group_of = [
            g for g, group in enumerate(self.optimizer.param_groups) for _ in group["params"]
        ]
        out = []
        for g in range(len(self.optimizer.param_groups)):
            pos = [k for k, j in enumerate(members) if group_of[j] == g]
            if pos:
                out.append((g, pos))
        return out

    def _provisional_step(self, f: InFlight, members: list[int]) -> None:
        """Eager updates: the snapshot becomes the provisional anchor ``x^0`` (recurrence in
        :mod:`hvd_slowmo.fragments`), from which this worker continues until the landing."""
        cfg, state = self.config, self.slow_state
        local = cfg.eager == "local"  # the own fresh outer gradient alone: no shares kept
        if self.eager_shares is None and not local:  # no previous step: the others' shares are 0
            self.eager_shares = [torch.zeros_like(p) for p in self.params]
        assert f.snapshot is not None and state.anchor is not None
        for g, pos in self._by_group(members):
            if f.lrs[g] <= 0:  # no slow step at lr = 0 (the landing keeps the average)
                continue
            idx = [members[k] for k in pos]
            if local:
                local_anchor_(
                    [f.snapshot[k] for k in pos],
                    [state.anchor[j] for j in idx],
                    None if state.slow_buffer is None else [state.slow_buffer[j] for j in idx],
                    f.lrs[g],
                    cfg.slow_lr,
                    cfg.slow_momentum,
                    nesterov=cfg.nesterov,
                )
                continue
            assert self.eager_shares is not None
            eager_anchor_(
                [f.snapshot[k] for k in pos],
                [state.anchor[j] for j in idx],
                None if state.slow_buffer is None else [state.slow_buffer[j] for j in idx],
                [self.eager_shares[j] for j in idx],
                f.lrs[g],
                cfg.slow_lr,
                cfg.slow_momentum,
                self.comm.size,
                nesterov=cfg.nesterov,
            )

    @torch.no_grad()
    def _after_average(self, f: InFlight, members: list[int]) -> None:
        """Before the slow step of an overlapped outer step: this worker's distance from the
        average at the boundary (``opt.replica_spread``) and, with eager updates, the other
        workers' shares ``c_i <- c_i + G`` (the snapshot is then the provisional anchor, and
        ``s_i - avg = (x0 - avg) + lr m c_i``; with ``eager="local"``,
        ``s_i - avg = (x0 - avg) - lr g_i``, ``lr g_i`` recovered from the provisional anchor)."""
        assert f.snapshot is not None
        cfg = self.config
        diff = list(torch._foreach_sub(f.snapshot, f.sent))
        if cfg.eager == "local":
            anchor, slow = self.slow_state.anchor, self.slow_state.slow_buffer
            assert anchor is not None
            for g, pos in self._by_group(members):
                lr = f.lrs[g]
                if lr <= 0:  # no provisional step was taken: the snapshot is s_i
                    continue
                for k in pos:
                    j = members[k]
                    own = local_gradient(
                        f.snapshot[k], anchor[j], None if slow is None else slow[j], lr,
                        cfg.slow_lr, cfg.slow_momentum, cfg.nesterov,
                    )  # fmt: skip
                    diff[k] = (anchor[j] - f.sent[k]).sub_(own)
        elif cfg.eager and self.eager_shares is not None:
            anchor = self.slow_state.anchor
            assert anchor is not None
            for g, pos in self._by_group(members):
                lr = f.lrs[g]
                if lr <= 0:  # no provisional step was taken: the snapshot is s_i
                    continue
                for k in pos:
                    j = members[k]
                    diff[k] = (anchor[j] - f.sent[k]).add_(
                        self.eager_shares[j], alpha=lr * self.comm.size
                    )
                idx = [members[k] for k in pos]
                eager_landed_(
                    [self.eager_shares[j] for j in idx],
                    [anchor[j] for j in idx],
                    [f.sent[k] for k in pos],
                    lr,
                )
        square = sum(float(d.double().square().sum()) for d in diff)
        self.replica_spread = (square / max(sum(d.numel() for d in diff), 1)) ** 0.5

    @torch.no_grad()
    def land(self) -> None:
        """The outer step in flight lands: read the progress check, then skip it (back to the
        anchor) or run the slow update and carry each worker's progress since the boundary.
        Collective."""
        f, self.in_flight = self.in_flight, None
        assert f is not None, "land() needs an outer step in flight"
        cfg = self.config
        members = self.fragments[f.fragment]
        live = [self.params[j] for j in members]
        last = f.fragment == len(self.fragments) - 1
        with self.timer("average"):
            everyone = f.read_progress(self.comm)
            if (
                everyone is not None
                and f.mine is not None
                and not finite_verdict(
                    everyone, cfg.nonfinite, f.mine["num_steps"], f.mine["outer_steps"]
                )
            ):
                self._skip(f)
                return
            # Started here: overlap=0, a resumed state, or a layout that cannot overlap.
            f.start_averages(self.comm, self.slow_state, cfg.exact_average, self._indices(f))
            f.finish_averages(deferred=True)
            if f.in_place:
                self.base.after_average(cfg.average)
            else:
                self.base.before_average()  # push-sum: the last steps' messages home
                self.base.after_average(False)  # the progress is measured on de-biased parameters
        with self.timer("slow_update"):
            if not f.in_place:
                self._after_average(f, members)
            groups = self.optimizer.param_groups
            at_boundary = [dict(g, lr=lr) for g, lr in zip(groups, f.lrs)] + groups[len(f.lrs) :]
            if len(self.fragments) > 1:  # a full layout (config): its update takes the indices
                self.slow_state.update_(f.sent, at_boundary, members)  # type: ignore[call-arg]
            else:
                self.slow_state.update_(f.sent, at_boundary)
            if not f.in_place:
                params = [p.detach() for p in live]
                extra = self.model_buffers if cfg.average and last else []
                for now, avg, snap in (
                    (params, f.sent, f.snapshot),
                    (extra, f.extra_sent, f.extra_snapshot),
                    (f.state_live, f.state_sent, f.state_snapshot),
                ):
                    if now and snap is not None:
                        torch._foreach_sub_(now, snap)
                        torch._foreach_add_(now, avg)
            if cfg.buffers == "reset":
                reset_buffers(self.optimizer.state, live)
            if not f.in_place and cfg.average:
                self.base.after_average(True)  # push-sum weight back to 1

    def _skip(self, f: InFlight) -> None:
        """``nonfinite="skip"``: every worker restarts from the anchor (the steps since the
        boundary are dropped too); the average, which would hold the NaN, is not used."""
        f.finish_averages(deferred=False)  # a started collective must complete everywhere
        if not f.in_place:
            self.base.before_average()  # push-sum: messages of the steps since the boundary home
        self._back_to_anchor(reset=True)
        self.base.after_average(True)
        self.eager_shares = None  # the shares of the skipped outer step are not used

    @torch.no_grad()
    def _back_to_anchor(self, reset: bool) -> None:
        """The parameters become the anchor (identical on every worker); ``reset`` also resets
        the base optimizer's buffers."""
        self.slow_state.restore_([p.detach() for p in self.params])
        if reset:
            reset_buffers(self.optimizer.state, self.params)

    def flush(self) -> None:
        """Land an outer step in flight now, and mix gossip messages in flight. Collective."""
        if self.in_flight is not None:
            self.land()
        self.base.flush()

    def restart(self, why: str) -> None:
        """Continue with the current workers: rebuild the base algorithm and restart the outer
        step from its anchor, dropping an average in flight (the steps since that anchor are
        dropped, and the counters go back with them). One log line on rank 0 says what was done.

        Without an anchor (``slow_lr=1, slow_momentum=0`` and ``nonfinite != "skip"``) there is
        no common point: the outer step continues from the parameters as they are.

        Args:
            why: what changed the workers, for the log line and errors.
        """
        pos, tau = self.position, self.config.tau
        self.slow_state.check_world(pos.world, why)
        old, pos.world = pos.world, (self.comm.rank, self.comm.size)
        flight, self.in_flight = self.in_flight, None
        # Only the last fragment's boundary ends a period: with it in flight the anchor is still
        # the previous period's (for fragments=1, the previous outer step's).
        dropped_flight = flight is not None and flight.fragment == len(self.fragments) - 1
        self.eager_shares = None  # the other workers' shares belong to the old workers
        self.rebuild_base()
        captured = self.slow_state.captured
        dropped = pos.inner_step + (tau if dropped_flight and captured else 0)
        if captured and dropped > 0:
            self._back_to_anchor(reset=self.config.buffers == "reset")
            pos.num_steps -= dropped
            pos.inner_step = 0
            pos.outer_steps -= int(dropped_flight)
            what = (
                f"outer step {pos.outer_steps} restarts from its anchor ({dropped} base steps "
                f"dropped, num_steps back to {pos.num_steps})"
            )
        elif old != pos.world:
            what = f"continuing at step {pos.num_steps} (inner step {pos.inner_step})"
        else:
            return
        if self.comm.rank == 0:
            change = f"{old[1]} -> {self.comm.size} workers, " if old[1] != self.comm.size else ""
            log.warning(
                "hvd_slowmo: %s (%sbase %r rebuilt for %d workers): %s. The learning rate is "
                "yours: rescale it in a reset callback if it depends on the number of workers",
                why,
                change,
                self.config.base_name,
                self.comm.size,
                what,
            )

    def check_progress(self) -> None:
        """Read the progress probe of an outer step in flight (before :func:`finish`'s own
        probe, which has the same collective name). Collective only when something is wrong."""
        if self.in_flight is not None:
            self.in_flight.read_progress(self.comm)

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position and the outer step in flight (waits for its averages: collective)."""
        pos = self.position
        return {
            "position": {
                "num_steps": pos.num_steps,
                "inner_step": pos.inner_step,
                "outer_steps": pos.outer_steps,
                # A state loaded by another number of workers restarts its outer step.
                "world_size": self.comm.size,
            },
            "in_flight": None
            if self.in_flight is None
            else {**self.in_flight.state_dict(), "fragments": len(self.fragments)},
            "eager_shares": None
            if self.eager_shares is None
            else dict(enumerate(self.eager_shares)),
        }

    def prepare_load(
        self, position: dict[str, Any], saved: Any, base_state: dict[str, Any]
    ) -> InFlight | None:
        """Check a saved outer step in flight against this model and configuration; changes
        nothing. Its base optimizer buffers are bound by :meth:`commit_load`.

        Args:
            position: the saved (checked) position.
            saved: :meth:`InFlight.state_dict` output, or None.
            base_state: the saved base optimizer's ``state_dict``.

        Raises:
            ValueError: the entry does not belong to this model or configuration.
        """
        if saved is None:
            return None
        cfg, inner = self.config, position["inner_step"]
        if not cfg.overlap:
            raise ValueError(
                "load_state_dict: the state was saved with an outer step in flight (overlap >= 1);"
                " resume with the overlap it was saved with, or save when no average is in flight"
            )
        if not isinstance(saved, dict) or not isinstance(saved.get("apply_at"), int):
            raise ValueError("load_state_dict: 'in_flight' is not an outer step: a damaged state")
        fragment, count = saved.get("fragment", 0), len(self.fragments)
        if saved.get("fragments", 1) != count or fragment not in range(count):
            raise ValueError(
                f"load_state_dict: the state was saved with fragments={saved.get('fragments', 1)!r}"
                f" and one in flight, this optimizer has fragments={count}: resume with the "
                "fragments it was saved with, or save when no average is in flight"
            )
        if not inner < saved["apply_at"] <= cfg.tau:
            raise ValueError(
                f"load_state_dict: the outer step in flight lands at inner step "
                f"{saved['apply_at']}, outside ({inner}, tau={cfg.tau}]: the state was saved "
                "with another tau or overlap"
            )
        live = [self.params[j] for j in self.fragments[fragment]]
        params = [p.detach() for p in live]
        extra = self.model_buffers if cfg.average and fragment == count - 1 else []
        state: list[Tensor] = []
        if cfg.buffers == "average":
            saved_state = base_state.get("state", {})
            by_param = {p: saved_state[i] for i, p in enumerate(self.params) if i in saved_state}
            state = averageable_buffers(by_param, live)

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
            land_at=saved["apply_at"],
            lrs=[float(lr) for lr in saved.get("lrs", [])],
            sent=like("sent", params),
            snapshot=like("snapshot", params),
            extra_sent=like("extra_sent", extra),
            extra_snapshot=like("extra_snapshot", extra),
            state_sent=like("state_sent", state),
            state_snapshot=like("state_snapshot", state),
            state_live=[],
            mine=saved.get("mine"),
            probe=None if saved.get("probe") is None else saved["probe"].clone(),
            averaged=bool(saved.get("averaged")),
            # Format 1 always started the buffers' average at the boundary (done when saved).
            state_averaged=bool(saved.get("state_averaged", True)),
            fragment=fragment,
        )

    def prepare_eager_shares(self, saved: Any) -> list[Tensor] | None:
        """Check saved eager shares against this model; changes nothing.

        Args:
            saved: the ``"eager_shares"`` entry of a saved state (None: none yet, not eager, or
                a state written before they existed; the estimate then starts from zero shares).

        Raises:
            ValueError: they do not match this model.
        """
        if saved is None or self.config.eager != "shares":  # "local" keeps no shares
            return None
        if (
            not isinstance(saved, dict)
            or set(saved) != set(range(len(self.params)))
            or any(
                not isinstance(saved[i], Tensor) or saved[i].shape != p.shape
                for i, p in enumerate(self.params)
            )
        ):
            raise ValueError("load_state_dict: 'eager_shares' does not match this model")
        return [saved[i].detach().to(p.device, p.dtype).clone() for i, p in enumerate(self.params)]

    def commit_load(
        self,
        position: dict[str, Any],
        in_flight: InFlight | None,
        eager_shares: list[Tensor] | None = None,
    ) -> None:
        """Install a checked position and outer step in flight (after the base optimizer's
        state is loaded, so the live buffers of ``buffers="average"`` are bound here).

        Args:
            position: the saved position.
            in_flight: :meth:`prepare_load`'s result.
            eager_shares: :meth:`prepare_eager_shares`'s result.
        """
        self.eager_shares = eager_shares
        pos = self.position
        pos.num_steps = int(position["num_steps"])
        pos.inner_step = int(position["inner_step"])
        pos.outer_steps = int(position["outer_steps"])
        if in_flight is not None and self.config.buffers == "average":
            live = [self.params[j] for j in self.fragments[in_flight.fragment]]
            in_flight.state_live = averageable_buffers(self.optimizer.state, live)
        self.in_flight = in_flight

    def counters(self) -> dict[str, int]:
        """The step counters, as a plain dict (for logs and tests)."""
        return {k: v for k, v in asdict(self.position).items() if k != "world"}
