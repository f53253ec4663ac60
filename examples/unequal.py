"""Unequal workers in the examples (issue 37): one emulated worker slowed by a factor, or paused
for some outer periods, while the others train as usual; and the optimizer's policies for them
(time-based periods, the weighted merge, the straggler quorum) as flags.

The slowdown is a busy-wait, not a repeated forward/backward: a repeated pass would change the
slowed worker's numbers (BatchNorm's running statistics, the data order, accumulated gradients),
so a slowed run would no longer train the same model as the plain one; a busy-wait keeps the
worker's arithmetic bit for bit what it was and holds its core as more compute would (a sleep would
hand the core to a co-located worker). Its length is ``factor - 1`` times the worker's own
measured step time, taken from the last step that ended no outer step (a step that ends one also
waits for the others, which is not this worker's compute). A pause is a sleep (a stalled host
does nothing) of ``periods`` times the seconds of the worker's last outer period.

With ``--emulated-step S`` nothing waits: every worker keeps an :class:`EmulatedClock` that a
base step moves by ``S`` (``S x factor`` on the slowed worker), the optimizer's time-based
periods read it, and the evaluations are dated in the cluster's emulated seconds
(:func:`emulated_seconds`). The step counts are then a function of the flags, not of the
machine's load, so a quality table (time to accuracy with one host slowed) can run on a shared
machine and be replayed; the real-time cost (goodput) is measured on the emulated cluster.

With unequal step counts (time-based periods, a quorum) a per-step lr schedule is read at the
cluster's progress, not at the worker's own step count (:func:`schedule_step`): a worker twice
as fast would otherwise decay its lr twice as early.
"""

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import hvd_slowmo

__all__ = [
    "EmulatedClock",
    "Straggler",
    "add_straggler_args",
    "emulated_seconds",
    "outer_driven",
    "policy_options",
    "policy_summary",
    "schedule_step",
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


class EmulatedClock:
    """A worker's emulated seconds (``--emulated-step``): each base step adds its seconds times the
    worker's slow factor, and nothing waits. Called, it returns the seconds so far (the
    optimizer's ``clock``); it has :class:`Straggler`'s two hooks.

    Args:
        step_seconds: the emulated seconds of one base step of an unslowed worker (> 0).
        slow_factor: this worker's steps take this many times as long (>= 1).
    """

    def __init__(self, step_seconds: float, slow_factor: float = 1.0) -> None:
        check_straggler(slow_factor, 0, 0.0)
        if not (math.isfinite(step_seconds) and step_seconds > 0):
            raise ValueError(f"--emulated-step must be seconds > 0, got {step_seconds!r}")
        self.step_seconds, self.slow_factor = float(step_seconds), float(slow_factor)
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def before_step(self) -> None:
        """The step's emulated compute."""
        self.seconds += self.step_seconds * self.slow_factor

    def after_step(self, outer_steps: int) -> None:
        """Nothing: the step's time was added before it.

        Args:
            outer_steps: the optimizer's ``outer_steps`` after the step (unused).
        """


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
        "--emulated-step",
        type=float,
        default=0.0,
        help="emulated time instead of waiting: a base step takes these seconds (times "
        "--slow-factor on the straggler) on every worker's clock, which --period-seconds reads; "
        "the evaluations are dated in the cluster's emulated seconds (0: real time)",
    )
    g.add_argument(
        "--straggler-rank",
        type=int,
        default=-1,
        help="the slowed/paused worker's rank (-1: the last)",
    )
    p = parser.add_argument_group("the optimizer's policies for unequal workers (issue 37)")
    p.add_argument(
        "--period-seconds",
        default=None,
        help="time-based outer periods (e.g. 2s): after a first period of --tau steps, each "
        "worker takes the steps that fit (DistributedOptimizer(period_seconds=...))",
    )
    p.add_argument(
        "--merge",
        choices=("mean", "samples"),
        default="mean",
        help="the exact average: plain mean, or weighted by each worker's samples",
    )
    p.add_argument(
        "--quorum",
        type=int,
        default=0,
        help="straggler=Quorum(K): the outer step goes on with K workers and the grace (0: off)",
    )
    p.add_argument(
        "--grace",
        default="adaptive",
        help="the quorum's grace: seconds, or 'adaptive' (median + 3 MAD of recent delays)",
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
    if args.emulated_step:
        flags += ["--emulated-step", f"{args.emulated_step:g}"]
    if flags and args.straggler_rank != -1:
        flags += ["--straggler-rank", str(args.straggler_rank)]
    if args.period_seconds is not None:
        flags += ["--period-seconds", str(args.period_seconds)]
    if args.merge != "mean":
        flags += ["--merge", args.merge]
    if args.quorum:
        flags += ["--quorum", str(args.quorum), "--grace", str(args.grace)]
    return flags


def policy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``DistributedOptimizer`` arguments of the policy flags (none when unset).

    Args:
        args: parsed by a parser with :func:`add_straggler_args`.
    """
    out: dict[str, Any] = {}
    period, merge, quorum = _policies(args)
    if period is not None:
        out["period_seconds"] = period
    if merge != "mean":
        out["merge"] = merge
    if quorum:
        grace: float | str = args.grace
        if grace != "adaptive":
            try:
                grace = float(grace)
            except ValueError:
                raise ValueError(
                    f"--grace must be seconds or 'adaptive', got {args.grace!r}"
                ) from None
        out["straggler"] = hvd_slowmo.Quorum(quorum, grace=grace)
    return out


def _policies(args: argparse.Namespace) -> tuple[str | None, str, int]:
    """``(period_seconds, merge, quorum)`` of ``args`` (defaults where a script has no such
    flags)."""
    return (
        getattr(args, "period_seconds", None),
        getattr(args, "merge", "mean"),
        getattr(args, "quorum", 0),
    )


def policy_summary(args: argparse.Namespace, opt: Any, rank: int) -> dict[str, int]:
    """The run summary's entry of the quorum on rank 0: ``{"quorum_partial_steps": n}``, the
    outer steps closed without every worker; ``{}`` elsewhere or without a quorum.

    Args:
        args: the parsed flags.
        opt: the :class:`hvd_slowmo.DistributedOptimizer`.
        rank: this worker's rank.
    """
    if not _policies(args)[2] or rank != 0:
        return {}
    size = opt.comm.size
    return {"quorum_partial_steps": sum(len(m) < size for m in opt.exchanges[0].members)}


def outer_driven(args: argparse.Namespace) -> bool:
    """Whether the workers take unequal numbers of steps (time-based periods, or a quorum whose
    late workers skip outer steps), so that an epoch must end by outer steps, not by batches.

    Args:
        args: parsed by a parser with :func:`add_straggler_args`.
    """
    period, _, quorum = _policies(args)
    return period is not None or bool(quorum)


def straggler_from_args(
    args: argparse.Namespace, rank: int, size: int
) -> "Straggler | EmulatedClock | None":
    """This worker's :class:`Straggler`, or None if it is not the straggler or nothing is set;
    with ``--emulated-step``, every worker's :class:`EmulatedClock`.

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
    emulated = getattr(args, "emulated_step", 0.0)
    if emulated:
        if args.pause_at or _policies(args)[2]:
            raise ValueError(
                "--emulated-step emulates a slowed worker only: drop --pause-at and --quorum "
                "(a pause and the quorum's grace wait real seconds), or run in real time"
            )
        factor = args.slow_factor if rank == args.straggler_rank % size else 1.0
        return EmulatedClock(emulated, factor)
    if args.slow_factor == 1.0 and not args.pause_at:
        return None
    if rank != args.straggler_rank % size:
        return None
    return Straggler(args.slow_factor, args.pause_at, args.pause_periods)


def emulated_seconds(args: argparse.Namespace, opt: Any, size: int) -> float:
    """The cluster's emulated seconds at the current outer boundary (``--emulated-step``): every
    finished period lasts as long as its slowest worker's steps (the others wait for it at the
    exact average), the first period ``tau`` steps on every worker, the later ones by the
    optimizer's recorded plans (``opt.period.plans``) or ``tau`` steps with count-based periods.

    Args:
        args: parsed by a parser with :func:`add_straggler_args`.
        opt: the :class:`hvd_slowmo.DistributedOptimizer`.
        size: the number of workers.
    """
    unit = [args.emulated_step] * size
    unit[args.straggler_rank % size] *= args.slow_factor
    periods = opt.outer_steps
    if periods == 0:
        return 0.0
    if opt.period is None:
        return periods * opt.tau * max(unit)
    later = opt.period.plans[: periods - 1]  # plans[k]: the counts of period k + 2
    return opt.tau * max(unit) + sum(max(n * u for n, u in zip(p, unit)) for p in later)


def schedule_step(opt: Any, tau: int, taken: int) -> float:
    """Where a run with unequal step counts reads its per-step lr schedule: the cluster's progress
    in count-based steps, ``outer_steps x tau`` plus the share of this worker's planned steps
    taken since the last outer step. With ``tau`` planned steps it is the worker's own step count,
    so the schedule is the count-based one; a worker twice as fast moves half a step per step,
    and every worker reads the same lr at the boundary.

    Args:
        opt: the :class:`hvd_slowmo.DistributedOptimizer`.
        tau: the count-based period (``--tau``).
        taken: this worker's base steps since its last outer step.
    """
    planned = opt.period.steps if opt.period is not None else tau
    return opt.outer_steps * tau + tau * min(taken, planned) / planned


def straggler_summary(straggler: "Straggler | EmulatedClock | None") -> dict[str, dict[str, float]]:
    """The run summary's entry of this worker's straggler: ``{"straggler": {"busy_s",
    "paused_s"}}``, or ``{}`` on a worker that is not it (or with emulated time).

    Args:
        straggler: from :func:`straggler_from_args`.
    """
    if not isinstance(straggler, Straggler):
        return {}
    return {"straggler": {"busy_s": straggler.busy_seconds, "paused_s": straggler.paused_seconds}}
