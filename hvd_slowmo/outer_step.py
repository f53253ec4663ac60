"""The outer loop of SlowMo (arXiv 1910.00643, Algorithm 1): the scheduler of the outer steps.

Every ``tau`` base steps a worker reaches a *boundary*, where the outer step **starts**; ``d =
overlap`` base steps later it **lands**, or every worker **skips** it (a non-finite worker under
``nonfinite="skip"``: back to the anchor). A change of workers **restarts** every fragment
from its anchor, dropping an average in flight (the counters go back to the most recent boundary
that landed: :meth:`OuterLoop.restart`). Streaming
(``fragments=P``, :mod:`hvd_slowmo.fragments`) gives each fragment its own boundary in the
period, one fragment in flight at a time; ``P = 1`` is the whole model, through the same code.

Who owns what: each fragment's outer step is a :class:`~hvd_slowmo.fragment.Fragment` (its
parameters, boundary, outer step in flight, and its own outer state: slow state, exchange, eager
estimate; the recurrence is documented there); :class:`OuterLoop` keeps the counters, says
whose turn it is, and does what concerns the whole model (a skip, a restart, the saved state's
envelope), asking each fragment for its part.
"""

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from .bases.base import BaseAlgorithm
from .buffers import reset_buffers
from .exchange import Exchange
from .fragment import Fragment, InFlight, LoadedFragment, OuterParts, make_fragments
from .period import TimedPeriod
from .slow_state import SlowState
from .state_format import Split

__all__ = ["InFlight", "OuterLoop", "Position"]

log = logging.getLogger("hvd_slowmo")


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


class OuterLoop:
    """The scheduler of the outer steps of one worker: its position, whose turn it is, and
    what concerns the whole model (a skip, a restart, the saved state).
    :class:`~hvd_slowmo.DistributedOptimizer` calls :meth:`advance` after each base step;
    nothing else changes the counters.

    Args:
        parts: what every fragment works with (configuration, communicator, optimizer,
            parameters, model buffers, timer).
        make_base: builds the base algorithm for the current workers (at construction and after
            every change of workers).
        split: the parameter indices of each fragment
            (:func:`hvd_slowmo.fragments.fragment_of`).
        owned: each fragment's own slow state and exchange
            (:func:`hvd_slowmo.fragment.make_outer_states`).
        clock: the clock of time-based periods (``period_seconds``; default
            ``time.monotonic``).

    Attributes:
        position: the step counters (:class:`Position`).
        fragments: the fragments (:class:`~hvd_slowmo.fragment.Fragment`), in period order,
            each with its own slow state and exchange.
        base: the base algorithm.
        samples: the samples this worker reported in total (``step(samples=n)``; one per base
            step by default), for a weighted merge.
        period: the time-based periods (:class:`~hvd_slowmo.period.TimedPeriod`), or None:
            ``tau`` base steps per period.
        replica_spread: this worker's RMS distance ``|s_i - avg|`` from the workers' average at
            the boundary of the last outer step that landed, over its fragment (no
            communication; ``overlap >= 1`` only), or None.
    """

    def __init__(
        self,
        parts: OuterParts,
        make_base: Callable[[], BaseAlgorithm],
        split: list[list[int]],
        owned: list[tuple[SlowState, Exchange]],
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.parts, self.config, self.comm = parts, parts.config, parts.comm
        self._make_base = make_base
        self.position = Position(world=(self.comm.rank, self.comm.size))
        self.fragments = make_fragments(parts, split, owned)
        self._at = {f.boundary: f for f in self.fragments}  # inner step -> whose boundary
        self.replica_spread: float | None = None
        self.samples = 0.0
        seconds = self.config.period_seconds  # seconds: parsed by the configuration
        self.period = (
            None
            if seconds is None
            else TimedPeriod(float(seconds), self.config.tau, self.comm.rank, self.comm.size, clock)
        )
        if self.period is not None:
            self.period.begin()
        self.base = make_base()
        self.base.attach(parts.params.keys)

    @property
    def in_flight(self) -> InFlight | None:
        """The outer step whose average is in flight (``overlap >= 1``; one at a time), or None."""
        return next((f.in_flight for f in self.fragments if f.in_flight is not None), None)

    @property
    def eager_shares(self) -> list[Tensor] | None:
        """``eager=True``: the other workers' shares of the last outer gradient, per parameter
        (zero for a fragment that has none yet); None while no fragment has any."""
        if all(f.eager.shares is None for f in self.fragments):
            return None
        out = [torch.zeros_like(p) for p in self.parts.params]
        for f in self.fragments:
            for j, share in zip(f.members, f.eager.shares or []):
                out[j] = share
        return out

    def rebuild_base(self) -> None:
        """A fresh base algorithm for the current workers (gossip graph, transport, push-sum
        weight); messages of the previous one still in flight are dropped."""
        self.base = self._make_base()
        self.base.attach(self.parts.params.keys)

    def add_params(self, new: list[Tensor]) -> None:
        """Parameters appended to the (single) fragment by ``add_param_group``.

        Args:
            new: the new parameters (already appended to the parameter list and param groups).
        """
        (whole,) = self.fragments  # config: add_param_group needs fragments=1
        whole.add_(new)
        self.base.attach(self.parts.params.keys)

    def capture_(self) -> None:
        """Each fragment's slow state takes its anchor, once (called at every step, after
        ``hvd.broadcast_parameters``)."""
        for f in self.fragments:
            f.capture_()

    @property
    def captured(self) -> bool:
        """Whether every fragment's anchor is captured (or loaded)."""
        return all(f.slow_state.captured for f in self.fragments)

    @property
    def per_rank(self) -> bool:
        """Whether each rank holds a different part of the outer state (a sharded layout)."""
        return any(f.slow_state.per_rank for f in self.fragments)

    def split(self) -> Split:
        """How this worker cuts its parameters into fragments, for a saved state's load."""
        return Split(
            [list(f.members) for f in self.fragments], [p.numel() for p in self.parts.params]
        )

    # --- the schedule ----------------------------------------------------------------------
    def advance(self, samples: float = 1.0) -> None:
        """After a base step: count it; land the outer steps whose delay is up, then start
        (and with ``overlap=0`` land) the outer step of the fragment whose boundary this is;
        the boundary of the fragment that ends the period turns the counters over. Collective
        then.

        Args:
            samples: the samples (or tokens) the step processed, for a weighted merge.
        """
        pos = self.position
        pos.num_steps += 1
        pos.inner_step += 1
        self.samples += samples
        for fragment in self.fragments:
            if fragment.in_flight is not None:
                fragment.in_flight.poll()
        for fragment in self.fragments:
            if fragment.due(pos.inner_step):
                self._land(fragment)
        starting = self._starting(pos.inner_step)
        if starting is not None:
            self._boundary(starting)

    def _boundary(self, starting: Fragment) -> None:
        """Start (and with ``overlap=0`` land) ``starting``'s outer step; turn the counters
        over at the period's end."""
        pos, period = self.position, self.period
        seconds = None if period is None else period.seconds_per_step(pos.inner_step)
        with self.parts.timer("average"):
            starting.start(self.base, pos.num_steps, pos.outer_steps, self.samples, seconds)
        if self.config.overlap == 0:
            self._land(starting)
        if starting.ends_period:
            pos.inner_step = 0
            pos.outer_steps += 1
            if starting.exchange.resumed_at is not None:  # resynchronized to a later step
                pos.outer_steps = starting.exchange.resumed_at
            if period is not None:
                period.begin()  # the wait at the outer step is not the worker's step time

    def _starting(self, inner_step: int) -> Fragment | None:
        """The fragment whose boundary is ``inner_step`` (time-based periods: the one fragment,
        at this period's planned count), or None."""
        if self.period is not None:
            return self.fragments[0] if inner_step == self.period.steps else None
        return self._at.get(inner_step)

    def _land(self, fragment: Fragment) -> None:
        """Land ``fragment``'s outer step; a non-finite worker (``nonfinite="skip"``) restarts
        every worker from the anchor (the steps since the boundary are dropped too)."""
        landed, spread = fragment.land(self.base)
        if spread is not None:
            self.replica_spread = spread
        if landed:
            if self.period is not None and fragment.merged is not None:
                self.period.replan(fragment.merged.seconds)
            return
        self._back_to_anchor(reset=True)
        self.base.after_average(True)
        for f in self.fragments:
            f.eager.reset()  # the shares of the skipped outer step are not used

    @torch.no_grad()
    def _back_to_anchor(self, reset: bool) -> None:
        """The parameters become the anchor (identical on every worker); what the exchange
        kept is dropped with the steps since; ``reset`` also resets the base optimizer's
        buffers."""
        for f in self.fragments:
            f.restore_()
        for f in self.fragments:
            if f.work is not None:  # the next pseudo-gradients start here
                f.work.restart(self.samples, self.position.num_steps)
        if reset:
            reset_buffers(self.parts.optimizer.state, self.parts.params.keys)

    def flush(self) -> None:
        """Land the outer steps in flight now, and mix gossip messages in flight. Collective."""
        for fragment in self.fragments:
            if fragment.in_flight is not None:
                self._land(fragment)
        self.base.flush()

    def restart(self, why: str) -> None:
        """Continue with the current workers: rebuild the base algorithm and restart every
        fragment from its anchor, dropping an average in flight. One log line on rank 0 says
        what was done.

        The rule (per fragment): each fragment's anchor holds the base steps up to the last
        boundary whose outer step *landed* (:meth:`_anchor_offsets`); the counters go back to
        the most recent of those boundaries over all fragments, and no further. So no base step
        is counted twice by any fragment (every anchor is at or before the counter) and no
        fragment lands twice in a period (the counter never goes back past a landing); a
        fragment whose anchor is older loses the steps between its anchor and the counter
        (its next pseudo-gradient is that much shorter). With one fragment this is the outer
        step's start (the previous one's when its average is in flight).

        Without an anchor (``slow_lr=1, slow_momentum=0`` and ``nonfinite != "skip"``) there is
        no common point: the outer step continues from the parameters as they are.

        Args:
            why: what changed the workers, for the log line and errors.
        """
        pos, tau = self.position, self.config.tau
        self.fragments[0].slow_state.check_world(pos.world, why)  # the same layout in each
        old, pos.world = pos.world, (self.comm.rank, self.comm.size)
        back_to = max(self._anchor_offsets())  # relative to the current period's start
        for fragment in self.fragments:
            fragment.drop()  # the in-flight average and the shares belong to the old workers
        self.rebuild_base()
        if self.period is not None:  # its slots and plan follow the new ranks
            self.period.rank, self.period.size = self.comm.rank, self.comm.size
            self.period.begin()
        captured = self.captured
        dropped = pos.inner_step - back_to
        # With several fragments the others are off their anchors even when nothing is dropped.
        if captured and (dropped > 0 or len(self.fragments) > 1):
            self._back_to_anchor(reset=self.config.buffers == "reset")
            pos.num_steps -= dropped
            periods_back = -(back_to // tau)  # a negative offset is in an earlier period
            pos.inner_step = back_to + periods_back * tau
            pos.outer_steps -= periods_back
            for f in self.fragments:
                if f.work is not None:
                    f.work.restart(self.samples, pos.num_steps)
            who = f"outer step {pos.outer_steps}"
            who = f"every fragment of {who}" if len(self.fragments) > 1 else who
            what = (
                f"{who} restarts from its anchor ({dropped} base steps dropped, num_steps "
                f"back to {pos.num_steps})"
            )
        elif old != pos.world:
            what = f"continuing at step {pos.num_steps} (inner step {pos.inner_step})"
        else:
            return
        if self.comm.rank == 0:
            change = f"{old[1]} -> {self.comm.size} workers, " if old[1] != self.comm.size else ""
            base, size = self.config.base_name, self.comm.size
            log.warning(
                f"hvd_slowmo: {why} ({change}base {base!r} rebuilt for {size} workers): {what}. "
                "The learning rate is yours: rescale it in a reset callback if it depends on "
                "the number of workers"
            )

    def _anchor_offsets(self) -> list[int]:
        """Per fragment, the boundary whose outer step last landed into its anchor, as an
        offset from the current period's start (``num_steps - inner_step``; negative: an
        earlier period), or the first step of training when none has landed."""
        pos, tau = self.position, self.config.tau
        start = pos.num_steps - pos.inner_step
        out = []
        for f in self.fragments:
            # The boundary that ends the period is the period's start (inner step 0).
            b = 0 if f.ends_period else f.boundary
            latest = b if b <= pos.inner_step else b - tau
            if f.in_flight is not None:
                latest -= tau  # started, not landed: the anchor is the boundary before
            out.append(max(latest, -start))
        return out

    def check_progress(self) -> None:
        """Read the progress probe of an outer step in flight (before :func:`finish`'s own
        probe, which has the same collective name). Collective only when something is wrong."""
        if self.in_flight is not None:
            self.in_flight.read_progress(self.comm)

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The position and each fragment's entry (its outer state; waits for an average in
        flight: collective)."""
        pos = self.position
        return {
            "position": {
                "num_steps": pos.num_steps,
                "inner_step": pos.inner_step,
                "outer_steps": pos.outer_steps,
                # A state loaded by another number of workers restarts its outer step.
                "world_size": self.comm.size,
            },
            "fragments": [f.state_dict() for f in self.fragments],
            # Only with a weighted merge or time-based periods (older states lack them).
            **self._unequal_state(),
        }

    def _unequal_state(self) -> dict[str, Any]:
        """The ``"work"`` (samples, each fragment's marks and unit) and ``"period"`` entries."""
        out: dict[str, Any] = {}
        if any(f.work is not None for f in self.fragments):
            out["work"] = {
                "samples": self.samples,
                "fragments": [f.work.state_dict() for f in self.fragments if f.work is not None],
            }
        if self.period is not None:
            out["period"] = self.period.state_dict()
        return out

    def load_unequal(self, work: Any, period: Any) -> None:
        """Take back :meth:`_unequal_state`'s entries (after :meth:`commit_load`; never raises);
        absent or damaged (a state saved without them): the marks start at the loaded step and
        the unit stays.

        Args:
            work: the saved ``"work"`` entry, or None.
            period: the saved ``"period"`` entry, or None.
        """
        pos = self.position
        total = work.get("samples") if isinstance(work, dict) else None
        if isinstance(total, (int, float)) and not isinstance(total, bool):
            self.samples = float(total)
        saved = work.get("fragments", []) if isinstance(work, dict) else []
        for f in self.fragments:
            if f.work is None:
                continue
            if len(saved) != len(self.fragments) or not f.work.load(saved[f.index]):
                f.work.restart(self.samples, pos.num_steps)
        if self.period is not None:
            self.period.load(period if isinstance(period, dict) else None)

    def prepare_load(
        self, saved: dict[str, Any], base_state: dict[str, Any]
    ) -> list[LoadedFragment]:
        """Check each fragment's saved entry against this model and configuration; changes
        nothing.

        Args:
            saved: the saved ``"slowmo"`` entry (current format, checked:
                :func:`hvd_slowmo.state_format.check_saved_state`).
            base_state: the saved base optimizer's ``state_dict``.

        Raises:
            ValueError: an entry does not belong to this model or configuration.
        """
        position = saved["position"]
        return [
            f.prepare_load(entry, position, base_state)
            for f, entry in zip(self.fragments, saved["fragments"])
        ]

    def commit_load(self, position: dict[str, Any], loaded: list[LoadedFragment]) -> None:
        """Install a checked position and each fragment's checked entry (after the base
        optimizer's state is loaded, so the live buffers of ``buffers="average"`` are bound
        here).

        Args:
            position: the saved position.
            loaded: :meth:`prepare_load`'s result.
        """
        for f, mine in zip(self.fragments, loaded):
            f.commit_load(mine)
        pos = self.position
        pos.num_steps = int(position["num_steps"])
        pos.inner_step = int(position["inner_step"])
        pos.outer_steps = int(position["outer_steps"])

    def counters(self) -> dict[str, int]:
        """The step counters, as a plain dict (for logs and tests)."""
        return {k: v for k, v in asdict(self.position).items() if k != "world"}
