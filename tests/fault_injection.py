"""Fault injection for tests: one fault, on one rank, at a chosen step and phase of a
:class:`hvd_slowmo.DistributedOptimizer`.

The injection point is read off the optimizer's public counters (``num_steps``, ``inner_step``)
and a phase name; the harness wraps methods of *this* optimizer object and its communicator
(nothing in the library changes). Usage in a worker::

    fault = Fault(action="kill", step=7, phase="in_flight")
    fault.arm(opt, rank=hvd.rank(), faulty_rank=1)
    for k in range(steps):
        fault.before_step(opt)      # the phases "before_start" and "in_flight" fire here
        ...; opt.step()

Phases:
    ``before_start``: before the base step at which an outer step (a fragment's) starts, the
        first such step at or after ``step``.
    ``in_flight``: before the first base step at or after ``step`` with an average in flight
        (``overlap >= 1``; else the same as ``before_start``).
    ``landing``: inside a fragment's landing (``Fragment.land``), the first at or after
        ``step``, before its average is finished.
    ``compressed``: inside the exchange's start (a compressed exchange encodes there), the
        first at or after ``step``.

Actions:
    ``kill``: ``SIGKILL`` to itself (no cleanup, as a lost machine).
    ``freeze``: ``SIGSTOP`` to itself (a frozen process: its sockets stay open).
    ``raise``: a collective that fails on this rank only (:class:`InjectedFault`): raised at the
        hook itself for ``landing`` and ``compressed``, else by the communicator's next average
        start.
    ``late_join``: nothing at run time: :meth:`Fault.join_delay` is the seconds the worker waits
        before it initializes the engine.
    ``slow``: from then on, the rank sleeps ``slow`` seconds before each base step (a throttled
        node, a stalling data loader): it is late, not gone.
    ``link_down``: ``ip link set dev LINK down`` in the worker's own network namespace (the
        process goes on with its link gone: a pulled cable). Only in an emulated host
        (``slowmo_lab.netns``: the worker runs under ``ip netns exec``, as root); downing the
        machine's own link would cut every other job off.

Each firing writes ``{"rank", "num_steps", "inner_step", "phase", "action", "t"}`` to
``record`` (a JSON path), so a test can time the outcome from the fault: before the fault
fires, except for ``link_down``, whose record is written once the link is down (it proves the
command worked).
"""

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

PHASES = ("before_start", "in_flight", "landing", "compressed")
ACTIONS = ("kill", "freeze", "raise", "late_join", "link_down", "slow")


class InjectedFault(RuntimeError):
    """The error of an injected failing collective."""


@dataclass
class Fault:
    """One fault to inject.

    Args:
        action: one of :data:`ACTIONS`.
        step: the earliest ``num_steps`` (base steps taken before it fires) at which it fires.
        phase: one of :data:`PHASES`.
        record: a JSON path written when it fires (None: nothing written).
        delay: ``late_join``'s wait in seconds.
        link: ``link_down``'s interface (``eth0`` in every ``slowmo_lab.netns`` host).
        slow: ``slow``'s extra seconds per base step.
    """

    action: str
    step: int = 0
    phase: str = "before_start"
    record: str | None = None
    delay: float = 5.0
    link: str = "eth0"
    slow: float = 0.01

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"Fault: action={self.action!r} is not one of {ACTIONS}")
        if self.phase not in PHASES:
            raise ValueError(f"Fault: phase={self.phase!r} is not one of {PHASES}")
        self._armed = False
        self._fired = False
        self._opt: Any = None

    # --- set-up ---------------------------------------------------------------------------
    def join_delay(self, rank: int, faulty_rank: int) -> float:
        """Seconds this rank waits before joining (``late_join`` on the faulty rank), else 0."""
        return self.delay if self.action == "late_join" and rank == faulty_rank else 0.0

    def arm(self, opt: Any, rank: int, faulty_rank: int) -> None:
        """Install the hooks on ``opt`` if ``rank`` is the faulty one (a no-op elsewhere).

        Args:
            opt: a :class:`hvd_slowmo.DistributedOptimizer`.
            rank: this worker's rank.
            faulty_rank: the rank that fails.
        """
        if rank != faulty_rank or self.action == "late_join":
            return
        self._armed, self._opt, self._rank = True, opt, rank
        if self.phase == "landing":
            for fragment in opt.outer.fragments:
                fragment.land = self._wrap(fragment.land)
        elif self.phase == "compressed":
            for exchange in opt.exchanges:  # each fragment's own
                exchange.start = self._wrap(exchange.start)

    def _wrap(self, method: Any) -> Any:
        def hooked(*args: Any, **kwargs: Any) -> Any:
            if self._due():
                self._fire()
            return method(*args, **kwargs)

        return hooked

    # --- the injection point ----------------------------------------------------------------
    def before_step(self, opt: Any) -> None:
        """Call before each ``opt.step()``: fires the ``before_start`` and ``in_flight`` phases."""
        if self._fired and self.action == "slow":
            time.sleep(self.slow)
        if not self._armed or self._fired or opt.num_steps < self.step:
            return
        # With period_seconds (one fragment, its boundary at 0) the period is the planned count.
        tau = opt.config.tau if opt.period is None else opt.period.steps
        starts = {f.boundary % tau for f in opt.outer.fragments}
        next_inner = (opt.inner_step + 1) % tau
        in_flight = opt.outer.in_flight is not None
        if self.phase == "before_start" and next_inner in starts:
            self._fire()
        elif self.phase == "in_flight" and (in_flight or opt.config.overlap == 0):
            if in_flight or next_inner in starts:
                self._fire()

    def _due(self) -> bool:
        return self._armed and not self._fired and self._opt.num_steps >= self.step

    def _fire(self) -> None:
        self._fired = True
        opt = self._opt
        info = {"rank": self._rank, "num_steps": opt.num_steps, "inner_step": opt.inner_step,
                "phase": self.phase, "action": self.action, "t": time.time()}  # fmt: skip
        if self.action == "link_down":
            self._link_down()
        if self.record:
            with open(self.record, "w") as f:
                json.dump(info, f)
                f.flush()
                os.fsync(f.fileno())
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "raise" and self.phase in ("landing", "compressed"):
            where = f"rank {self._rank} at step {opt.num_steps}, phase {self.phase}"
            raise InjectedFault(f"injected collective failure on {where}")
        elif self.action == "raise":
            self._fail_next_average()

    def _link_down(self) -> None:
        # Refuse outside a named namespace (ip netns exec): the root namespace's link is everyone's.
        where = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True)
        if where.returncode != 0 or not where.stdout.strip():
            raise RuntimeError("Fault('link_down') runs only in an emulated host (ip netns exec)")
        cmd = ["ip", "link", "set", "dev", self.link, "down"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")

    def _fail_next_average(self) -> None:
        """The communicator's next average start raises (the collective fails on this rank)."""
        comm = self._opt.comm
        original = comm.average_start
        where = f"rank {self._rank} at step {self._opt.num_steps}, phase {self.phase}"

        def failing(*args: Any, **kwargs: Any) -> Any:
            comm.average_start = original
            raise InjectedFault(f"injected collective failure on {where}")

        comm.average_start = failing
