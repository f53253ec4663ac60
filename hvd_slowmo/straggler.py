"""The straggler policy of the outer step (``straggler=Quorum(...)``): how long the exact average
of SlowMo (arXiv 1910.00643, Algorithm 1, line 6) waits for the last workers.

Without a policy every worker waits for every other at each outer step, so one paused or slowed
worker stalls everyone. With :class:`Quorum`, the outer step closes once ``min_workers`` workers
have arrived and a grace period has passed (or every worker arrived); the late ones are
resynchronized from the new anchor (:mod:`hvd_slowmo.exchange.quorum`). The grace is fixed, or
adaptive (:class:`Grace`): the median of the recent arrival delays after the quorum plus
``mad_factor`` times their median absolute deviation, as hivemind's adaptive deadlines suggest
(its issue 676) and Decoupled DiLoCo's grace window does (arXiv 2604.21428).
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass

from .validation import check_number

__all__ = ["Grace", "Quorum"]


@dataclass(frozen=True)
class Quorum:
    """Close the outer step once ``min_workers`` have arrived and the grace has passed.

    Args:
        min_workers: the quorum ``k`` (1 <= k <= workers): fewer arrivals than this wait (up to
            the collective deadline); ``k = workers`` waits for everyone, as without a policy.
        grace: seconds to wait after the quorum for the others, or ``"adaptive"``
            (:class:`Grace`).
        mad_factor: the adaptive grace's ``c`` in median + c x MAD (>= 0).
        window: how many recent post-quorum arrival delays the adaptive grace keeps (>= 1).
        min_grace: the adaptive grace's floor in seconds (>= 0).
        max_grace: the adaptive grace's ceiling, and its value before any delay was seen
            (seconds, >= min_grace): the first outer steps wait this long for everyone.

    Raises:
        ValueError: a value out of range, named with the fix.
    """

    min_workers: int
    grace: float | str = "adaptive"
    mad_factor: float = 3.0
    window: int = 16
    min_grace: float = 0.0
    max_grace: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.min_workers, bool) or not isinstance(self.min_workers, int):
            raise TypeError(
                f"Quorum: min_workers must be an int, got {self.min_workers!r}; "
                "e.g. Quorum(min_workers=3)"
            )
        if self.min_workers < 1:
            raise ValueError(
                f"Quorum: min_workers must be >= 1, got {self.min_workers}; e.g. "
                "Quorum(min_workers=3) goes on with 3 of 4 workers"
            )
        if isinstance(self.grace, str):
            if self.grace != "adaptive":
                raise ValueError(f"Quorum: grace must be seconds or 'adaptive', got {self.grace!r}")
        else:
            check_number("Quorum grace", self.grace, low=0.0, fix="seconds, e.g. grace=2.0")
        check_number("Quorum mad_factor", self.mad_factor, low=0.0, fix="e.g. mad_factor=3")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"Quorum: window must be an int >= 1, got {self.window!r}")
        check_number("Quorum min_grace", self.min_grace, low=0.0, fix="seconds, e.g. 0.1")
        check_number("Quorum max_grace", self.max_grace, low=0.0, fix="seconds, e.g. 30")
        if self.max_grace < self.min_grace:
            raise ValueError(
                f"Quorum: max_grace ({self.max_grace}) must be >= min_grace ({self.min_grace})"
            )

    def check_world(self, size: int) -> None:
        """Refuse a quorum larger than the workers.

        Args:
            size: the number of workers.
        """
        if self.min_workers > size:
            raise ValueError(
                f"Quorum: min_workers={self.min_workers} is larger than the {size} workers; "
                f"use 1 <= min_workers <= {size}"
            )


class Grace:
    """How long the outer step waits after its quorum, from the policy and the recent delays.

    Args:
        policy: the quorum policy.

    Attributes:
        delays: the recent post-quorum arrival delays (seconds) of the workers that made it.
    """

    def __init__(self, policy: Quorum) -> None:
        self.policy = policy
        self.delays: deque[float] = deque(maxlen=policy.window)

    def seconds(self) -> float:
        """The grace of the next outer step: fixed, or ``clamp(median + c MAD)`` of the window
        (``max_grace`` while the window is empty).

        Only the arrivals the grace admitted are in the window (a late worker's delay is not
        known when the step closes), so the adaptive grace follows the admitted workers;
        ``min_grace`` keeps room for a healthy worker's jitter."""
        p = self.policy
        if not isinstance(p.grace, str):
            return float(p.grace)
        if not self.delays:
            return p.max_grace
        med = statistics.median(self.delays)
        mad = statistics.median(abs(d - med) for d in self.delays)
        return min(p.max_grace, max(p.min_grace, med + p.mad_factor * mad))

    def record(self, delays: list[float]) -> None:
        """Keep the delays after the quorum of the workers that arrived within the grace.

        Args:
            delays: seconds from the quorum to each later arrival (finite, >= 0).
        """
        self.delays.extend(d for d in delays if math.isfinite(d) and d >= 0)
