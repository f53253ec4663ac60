"""Outer periods by time (``period_seconds``): every worker takes the base steps that fit in the
period, and the outer step starts at the same step boundary everywhere (SlowMo, arXiv
1910.00643, with unequal workers; Decoupled DiLoCo, arXiv 2604.21428).

The first period is ``tau`` base steps on every worker. At each outer step every worker puts the
seconds per base step it measured in the period (from the end of the previous outer step to its
boundary: compute and data loading, not the wait for the others) into its own slot of the tally
that travels with the exact average (:mod:`hvd_slowmo.merge`): one collective, no round trip of
its own. From that vector, the same bits on every worker, each worker computes every worker's
count for the next period (:func:`plan_steps`)::

    n_r = floor(T / t_r)        T = period_seconds, t_r = worker r's seconds per step

so a worker twice as fast takes twice the steps, and all reach the boundary after about ``T``
seconds. The first plan refuses a period shorter than a worker's step (``ValueError`` naming
``period_seconds``, on every worker: the setting is wrong); later plans give a worker whose last
period was that slow (it paused) one step. The plan is a pure function of the measured step
times: the plans are recorded (:attr:`TimedPeriod.plans`, and the current one in the saved
state), so a run can be replayed from them (:meth:`TimedPeriod.replay`). The clock is injectable
(a fake clock in tests).
"""

import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["TimedPeriod", "parse_seconds", "plan_steps"]

_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_seconds(value: Any) -> float:
    """``period_seconds`` in seconds: a number, or a string with a unit (``"30s"``, ``"500ms"``,
    ``"2min"``, ``"1h"``; no unit: seconds).

    Args:
        value: the ``period_seconds`` argument.

    Raises:
        TypeError: neither a number nor a string.
        ValueError: a string that does not parse, or not a finite duration > 0.
    """
    if isinstance(value, str):
        match = _DURATION.match(value.lower())
        if match is None or match.group(2) not in ("", *_UNITS):
            raise ValueError(
                f"period_seconds={value!r} does not parse as a duration; pass seconds "
                "(period_seconds=30) or a number with a unit: '30s', '500ms', '2min', '1h'"
            )
        seconds = float(match.group(1)) * _UNITS.get(match.group(2), 1.0)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"period_seconds must be seconds (a number) or a duration string like '30s', got "
            f"{value!r}"
        )
    else:
        seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0.0):
        raise ValueError(
            f"period_seconds must be a finite duration > 0, got {value!r}; e.g. period_seconds=30"
        )
    return seconds


def plan_steps(seconds_per_step: Sequence[float], period: float, strict: bool = True) -> list[int]:
    """Each worker's base steps in the next period: ``floor(period / t_r)``, at least 1.

    Args:
        seconds_per_step: ``t_r``, each worker's measured seconds per base step, in rank order.
        period: ``T``, the period in seconds.
        strict: raise where a step takes longer than the period (the first plan: the setting
            is wrong); else such a worker takes one step (a worker that paused).

    Raises:
        ValueError: ``strict`` and a worker's step takes longer than the period.
    """
    out = []
    for rank, t in enumerate(seconds_per_step):
        # A relative 1e-9 keeps an exact quotient (3.0 / 0.375 -> 8) from rounding down to 7
        # when t is a mean times the size that rounded up by an ulp.
        steps = math.floor(period / t * (1.0 + 1e-9)) if t > 0.0 else math.inf
        if steps < 1 and strict:
            raise ValueError(
                f"period_seconds={period:g} is shorter than one base step of rank {rank} "
                f"({t:.3g} s measured): raise period_seconds above the slowest worker's step"
            )
        out.append(int(min(max(steps, 1), 2**31)))
    return out


class TimedPeriod:
    """One worker's time-based periods: its count for the current period, the clock and the
    recorded plans.

    Args:
        seconds: ``T``, the period in seconds.
        first: the base steps of the first period (``tau``), the same on every worker.
        rank: this worker's rank.
        size: the number of workers.
        clock: seconds as a float (default ``time.monotonic``; a fake clock in tests).

    Attributes:
        steps: this worker's base steps in the current period.
        plans: every worker's counts of each period planned so far, in order.
    """

    def __init__(
        self,
        seconds: float,
        first: int,
        rank: int,
        size: int,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.seconds, self.rank, self.size = seconds, rank, size
        self.clock = clock or time.monotonic
        self.steps = first
        self.plans: list[list[int]] = []
        self._began: float | None = None
        self._replay: list[list[int]] = []

    def begin(self) -> None:
        """The period starts now (after an outer step, or at the first base step)."""
        self._began = self.clock()

    def seconds_per_step(self, steps: int) -> float:
        """At the boundary: the seconds per base step measured since :meth:`begin`.

        Args:
            steps: the base steps taken in the period.
        """
        began = self._began if self._began is not None else self.clock()
        return max(self.clock() - began, 0.0) / max(steps, 1)

    def replan(self, seconds_per_step: list[float] | None) -> None:
        """After an outer step: every worker's count for the next period, from the step times
        every worker measured (the same on every worker), or from the replayed plans.

        Args:
            seconds_per_step: each worker's seconds per step, in rank order (None: no plan).
        """
        if self._replay:
            plan = self._replay.pop(0)
        elif seconds_per_step is None:
            return
        else:
            # The first plan checks the setting; later, a worker that stalled takes one step.
            plan = plan_steps(seconds_per_step, self.seconds, strict=not self.plans)
        self.plans.append(plan)
        self.steps = plan[self.rank]

    def replay(self, plans: list[list[int]]) -> None:
        """Use these plans (recorded by another run's :attr:`plans`) for the next periods, in
        order, instead of the clock: the run repeats that run's step counts.

        Args:
            plans: every worker's counts per period, in rank order.

        Raises:
            ValueError: a plan that does not have one count >= 1 per worker.
        """
        for plan in plans:
            if len(plan) != self.size or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in plan
            ):
                raise ValueError(
                    f"replay: each plan needs one step count >= 1 per worker ({self.size}), got "
                    f"{plan!r}"
                )
        self._replay = [list(p) for p in plans]

    def state_dict(self) -> dict[str, Any]:
        """The current period's count, the seconds spent in it so far, and the plans so far."""
        elapsed = 0.0 if self._began is None else self.clock() - self._began
        return {"steps": self.steps, "elapsed": elapsed, "plans": [list(p) for p in self.plans]}

    def load(self, saved: dict[str, Any] | None) -> None:
        """Take back :meth:`state_dict`'s output (None or not a state: keep the first period's
        count; never raises, as a load after its checks must not); the period's clock goes on
        from the seconds it had spent.

        Args:
            saved: the saved ``"period"`` entry, or None.
        """
        self._began = self.clock()
        steps = None if saved is None else saved.get("steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            return  # none saved, or not a count: the first period's count stays
        self.steps = steps
        plans = saved.get("plans", []) if saved is not None else []
        self.plans = [list(p) for p in plans if isinstance(p, (list, tuple))]
        elapsed = saved.get("elapsed", 0.0) if saved is not None else 0.0
        if isinstance(elapsed, (int, float)) and math.isfinite(elapsed):
            self._began -= float(elapsed)
