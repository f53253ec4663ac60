"""Wall-clock time per phase of the optimizer (base communication, exact average, slow update),
kept out of the algorithm's interfaces: code runs inside ``with timer("phase"):`` and never
returns seconds.

Phases nest: time spent in an inner phase (the all-gather of a sharded anchor, which is
communication, inside the slow update) is booked to the inner phase only. Every phase is also a
``torch.profiler.record_function`` range (``hvd_slowmo.<phase>``), so a profiler trace shows it.
"""

import contextlib
import time
from collections.abc import Iterable, Iterator

import torch

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Cumulative seconds per phase, exclusive of nested phases.

    Args:
        phases: the phase names; :attr:`totals` starts at zero for each.

    Attributes:
        totals: phase -> cumulative seconds (the optimizer's ``timings``).
    """

    def __init__(self, phases: Iterable[str]) -> None:
        self.totals: dict[str, float] = dict.fromkeys(phases, 0.0)
        self._nested: list[float] = []  # per open phase: seconds spent in phases inside it

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        """Book the block's wall time to ``phase`` (minus any phase nested inside it).

        Args:
            phase: one of the phases given at construction.
        """
        if phase not in self.totals:
            raise KeyError(f"PhaseTimer: unknown phase {phase!r}; known: {sorted(self.totals)}")
        with torch.profiler.record_function(f"hvd_slowmo.{phase}"):
            start = time.perf_counter()
            self._nested.append(0.0)
            try:
                yield
            finally:
                elapsed = time.perf_counter() - start
                self.totals[phase] += elapsed - self._nested.pop()
                if self._nested:
                    self._nested[-1] += elapsed
