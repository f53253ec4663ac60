"""Emulated unequal workers for the examples (issue 37): one worker slowed by a factor, or paused
for some outer periods, while the others train as usual.

The slowdown is a busy-wait, not a repeated forward/backward: a repeated pass would change the
slowed worker's numbers (BatchNorm's running statistics, the data order, accumulated gradients),
so a slowed run would no longer train the same model as the plain one; a busy-wait keeps the
worker's arithmetic bit for bit what it was and holds its core as more compute would (a sleep would
hand the core to a co-located worker). Its length is ``factor - 1`` times the worker's own
measured step time, taken from the last step that ended no outer step (a step that ends one also
waits for the others, which is not this worker's compute). A pause is a sleep (a stalled host
does nothing) of ``periods`` times the seconds of the worker's last outer period.
"""

import argparse
import math
import time
from collections.abc import Callable

__all__ = [
    "Straggler",
    "add_straggler_args",
    "straggler_flags",
    "straggler_from_args",
    "straggler_summary",
]


class Straggler:
    """Slows or pauses this worker: call :meth:`before_step` before each base step and
    :meth:`after_step` after it.

    Args:
        slow_factor: this worker's steps take this many times as long (>= 1; 1: not slowed).
        pause_at: the outer step after which the worker pauses once (0: never).
        pause_periods: the pause's length, in this worker's last outer period (> 0 with
            ``pause_at``).
        clock: seconds (``time.perf_counter``; a fake clock in tests).
        sleep: the pause's wait (``time.sleep``).
    """

    def __init__(
        self,
        slow_factor: float = 1.0,
        pause_at: int = 0,
        pause_periods: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        check_straggler(slow_factor, pause_at, pause_periods)
        self.slow_factor, self.pause_at, self.pause_periods = slow_factor, pause_at, pause_periods
        self.clock, self.sleep = clock, sleep
        self.busy_seconds = 0.0  # the extra compute spent so far
        self.paused_seconds = 0.0
        self._step_time: float | None = None  # the last step that ended no outer step
        self._t0 = 0.0
        self._period_start: float | None = None
        self._outer = 0

    def before_step(self) -> None:
        """The extra compute (a busy-wait), then the start of the step's measurement."""
        if self._period_start is None:
            self._period_start = self.clock()
        if self.slow_factor > 1.0 and self._step_time is not None:
            extra = (self.slow_factor - 1.0) * self._step_time
            start = self.clock()
            while self.clock() - start < extra:
                pass  # spin: the core stays busy, as with more compute
            self.busy_seconds += extra
        self._t0 = self.clock()

    def after_step(self, outer_steps: int) -> None:
        """Measure the step; after the outer step ``pause_at``, pause once.

        Args:
            outer_steps: the optimizer's ``outer_steps`` after the step.
        """
        now = self.clock()
        if outer_steps == self._outer:
            self._step_time = now - self._t0
            return
        assert self._period_start is not None  # before_step ran first
        period, self._outer = now - self._period_start, outer_steps
        if self.pause_at and outer_steps == self.pause_at:
            self.sleep(self.pause_periods * period)
            self.paused_seconds += self.pause_periods * period
            now = self.clock()
        self._period_start = now


def check_straggler(slow_factor: float, pause_at: int, pause_periods: float) -> None:
    """Raise a ``ValueError`` naming the flag for a bad setting.

    Args:
        slow_factor: ``--slow-factor``.
        pause_at: ``--pause-at``.
        pause_periods: ``--pause-periods``.
    """
    if not (isinstance(slow_factor, (int, float)) and math.isfinite(slow_factor)):
        raise ValueError(f"--slow-factor must be a finite number >= 1, got {slow_factor!r}")
    if slow_factor < 1.0:
        raise ValueError(f"--slow-factor must be >= 1 (1: not slowed), got {slow_factor}")
    if not isinstance(pause_at, int) or pause_at < 0:
        raise ValueError(f"--pause-at must be an outer step >= 0 (0: no pause), got {pause_at!r}")
    if not (isinstance(pause_periods, (int, float)) and math.isfinite(pause_periods)):
        raise ValueError(f"--pause-periods must be a finite number, got {pause_periods!r}")
    if pause_periods < 0 or (pause_at and pause_periods == 0):
        raise ValueError(
            f"--pause-periods must be > 0 with --pause-at {pause_at} (and >= 0), got "
            f"{pause_periods}"
        )


def add_straggler_args(parser: argparse.ArgumentParser) -> None:
    """The flags of one emulated unequal worker (the last rank by default).

    Args:
        parser: the parser (or argument group) to add them to.
    """
    g = parser.add_argument_group("emulated unequal workers (issue 37)")
    g.add_argument(
        "--slow-factor",
        type=float,
        default=1.0,
        help="the straggler's steps take this many times as long (a busy-wait of (factor - 1) "
        "times its measured step); 1: every worker alike",
    )
    g.add_argument(
        "--pause-at", type=int, default=0, help="the straggler pauses after this outer step (0: no)"
    )
    g.add_argument(
        "--pause-periods",
        type=float,
        default=0.0,
        help="the pause's length, in the straggler's last outer period",
    )
    g.add_argument(
        "--straggler-rank",
        type=int,
        default=-1,
        help="the slowed/paused worker's rank (-1: the last)",
    )


def straggler_flags(args: argparse.Namespace) -> list[str]:
    """The flags that pass ``args``' straggler on to a training script (none when unset).

    Args:
        args: parsed by a parser with :func:`add_straggler_args`.
    """
    check_straggler(args.slow_factor, args.pause_at, args.pause_periods)
    flags = ["--slow-factor", f"{args.slow_factor:g}"] if args.slow_factor != 1.0 else []
    if args.pause_at:
        flags += ["--pause-at", str(args.pause_at), "--pause-periods", f"{args.pause_periods:g}"]
    if flags and args.straggler_rank != -1:
        flags += ["--straggler-rank", str(args.straggler_rank)]
    return flags


def straggler_from_args(args: argparse.Namespace, rank: int, size: int) -> Straggler | None:
    """This worker's :class:`Straggler`, or None if it is not the straggler or nothing is set.

    Args:
        args: parsed by a parser with :func:`add_straggler_args`.
        rank: this worker's rank.
        size: the number of workers.
    """
    check_straggler(args.slow_factor, args.pause_at, args.pause_periods)
    if not -size <= args.straggler_rank < size:
        raise ValueError(
            f"--straggler-rank must be in [-{size}, {size - 1}] for {size} workers, got "
            f"{args.straggler_rank}"
        )
    if args.slow_factor == 1.0 and not args.pause_at:
        return None
    if rank != args.straggler_rank % size:
        return None
    return Straggler(args.slow_factor, args.pause_at, args.pause_periods)


def straggler_summary(straggler: Straggler | None) -> dict[str, dict[str, float]]:
    """The run summary's entry of this worker's straggler: ``{"straggler": {"busy_s",
    "paused_s"}}``, or ``{}`` on a worker that is not it.

    Args:
        straggler: from :func:`straggler_from_args`.
    """
    if straggler is None:
        return {}
    return {"straggler": {"busy_s": straggler.busy_seconds, "paused_s": straggler.paused_seconds}}
