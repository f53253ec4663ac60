"""The outer step's merge weighted by the work done (``merge="samples"``), and the scalars that
travel with the exact average (SlowMo, arXiv 1910.00643; the token-weighted merge of Decoupled
DiLoCo, arXiv 2604.21428).

Worker ``i`` reports ``w_i``, the samples it processed since its fragment's last boundary (one
per base step unless ``step(samples=n)`` says otherwise). The exact average becomes::

    avg = sum_i w_i s_i / sum_i w_i

in the same collective as the parameters: each worker multiplies its snapshot ``s_i`` by a ratio
``r_i = w_i / (scale * S)`` and appends a float64 *tally* ``[r_i, r_i != 1, r_i * lr_g ...,
seconds per step in the worker's own slot]`` to the tensors averaged; afterwards
``avg = mean_i(r_i s_i) / mean_i(r_i)``. ``S`` is the number of base steps the pseudo-gradient
covers where every worker takes the same number (count-based periods), else ``tau``; ``scale``
is the workers' mean ``w_i / S`` at the previous outer step that landed (1 at first; with
count-based periods, the mean samples per step), the same bits on every worker, so ``r_i = 1``
when the worker did as much as the workers did on average before.

**Exactness.** Where every ``r_i == 1`` (the second slot averages to 0) nothing is multiplied
or divided (``1 * s == s``), and the lrs of the slow step are each worker's own, as without a
merge: the result is the unweighted mean bit for bit. That is so whenever the workers take the
same steps and report the same samples per step as in the previous outer step (the default of one
sample per step: always, with count-based periods). Otherwise ``r_i s_i`` and the division round
once each (a few ulp from the real weighted mean), identically on every worker, so the workers
still end bitwise equal.

**The slow step's 1/lr.** Workers that took different numbers of steps have each stepped their
own learning rate schedule: the slow step's ``gamma`` is the weighted mean of the workers' lrs at
the boundary (per param group, from the same tally), the same on every worker. With
``alpha = 1, beta = 0`` the anchor is the weighted average whatever ``gamma`` is; with slow
momentum the buffer ``u`` sees ``(x0 - avg) / gamma`` as without a merge.

With time-based periods the second slot is always 1 (the workers took different numbers of
steps): the lrs are always merged.

Pure functions, one small object (:class:`Work`) and :func:`weighted_start`, the one collective,
which the plain exchange calls (:meth:`hvd_slowmo.exchange.PlainExchange.start`).
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .comm.base import Communicator, PendingAverage
from .divide import foreach_div_

__all__ = [
    "MERGES",
    "Merged",
    "Work",
    "check_samples",
    "make_tally",
    "read_tally",
    "weighted_start",
]

#: The outer step's merges (``merge=``): the plain mean, or weighted by the samples reported.
MERGES = ("mean", "samples")


def check_samples(samples: Any) -> float:
    """``step(samples=...)`` as a float: a finite number >= 0.

    Args:
        samples: the samples (or tokens) this base step processed.

    Raises:
        TypeError: not a number.
        ValueError: negative, NaN or infinite.
    """
    if isinstance(samples, bool) or not isinstance(samples, (int, float)):
        raise TypeError(
            f"step(samples=...) must be a number >= 0 (the samples or tokens of this step), "
            f"got {samples!r}"
        )
    if not math.isfinite(samples) or samples < 0:
        raise ValueError(
            f"step(samples=...) must be a finite number >= 0, got {samples!r}; pass the "
            "samples (or tokens) this step processed, e.g. samples=len(batch)"
        )
    return float(samples)


def make_tally(
    ratio: float, lrs: list[float], seconds: float | None, rank: int, size: int
) -> Tensor:
    """This worker's tally, averaged with its snapshot (float64).

    Args:
        ratio: ``r_i``, this worker's weight over the common unit (1.0: the plain mean).
        lrs: each param group's lr at the boundary.
        seconds: seconds per base step measured in the period (time-based periods: the workers
            took different numbers of steps, so the slow step always takes the mean lr), or
            None.
        rank: this worker's rank (its slot).
        size: the number of workers.
    """
    slots = [0.0] * (size if seconds is not None else 0)
    if seconds is not None:
        slots[rank] = seconds
    head = [ratio, 0.0 if ratio == 1.0 and seconds is None else 1.0]
    return torch.tensor(head + [ratio * lr for lr in lrs] + slots, dtype=torch.float64)


@dataclass
class Merged:
    """What an averaged tally says, the same on every worker.

    Attributes:
        ratio: ``mean_i r_i``.
        equal: every ``r_i == 1`` and the periods are count-based: the average is the plain
            mean bit for bit, and each worker keeps its own lrs.
        lrs: the weighted mean lr of each param group (None where ``equal``: each worker's own).
        seconds: each worker's seconds per step, in rank order (None: not measured).
    """

    ratio: float
    equal: bool
    lrs: list[float] | None
    seconds: list[float] | None


def read_tally(tally: Tensor, groups: int, size: int) -> Merged:
    """The merge that an averaged tally describes.

    Args:
        tally: :func:`make_tally`'s tensor, averaged over the workers.
        groups: the number of param groups in it.
        size: the number of workers.

    Raises:
        ValueError: every worker reported zero samples (there is nothing to weight by).
    """
    values = tally.tolist()
    ratio, unequal = values[0], values[1]
    if not ratio > 0.0:
        raise ValueError(
            "merge='samples': every worker reported 0 samples since the outer step's start "
            "(step(samples=0)); report the samples each step processed, or use merge='mean'"
        )
    lrs = None if unequal == 0.0 else [v / ratio for v in values[2 : 2 + groups]]
    rest = values[2 + groups :]
    # Only the worker's own slot is nonzero: the mean times the size is its value (to rounding,
    # the same bits on every worker).
    seconds = [v * size for v in rest] if rest else None
    return Merged(ratio=ratio, equal=unequal == 0.0, lrs=lrs, seconds=seconds)


@torch.no_grad()
def weighted_start(
    comm: Communicator, params: list[Tensor], extra: list[Tensor], tally: Tensor, name: str
) -> PendingAverage:
    """Start the weighted average of ``params`` (the plain one of ``extra`` and ``tally``) in
    one collective; ``wait()`` leaves ``params`` at ``sum r_i s_i / sum r_i``. Collective.

    Args:
        comm: the communicator over all workers.
        params: this worker's snapshot (empty: only ``extra`` and ``tally`` are averaged);
            scaled in place.
        extra: averaged plainly alongside (the model buffers).
        tally: :func:`make_tally`'s tensor (slot 0 is ``r_i``); averaged in place.
        name: the collective's name.
    """
    ratio = float(tally[0])
    if params and ratio != 1.0:
        torch._foreach_mul_(params, ratio)
    pending = comm.average_start(params + extra + [tally], name=name)

    def finish() -> None:
        pending.wait()
        mean, unequal = float(tally[0]), float(tally[1])
        if params and unequal != 0.0 and mean > 0.0:
            foreach_div_(params, mean)

    return PendingAverage(finish, progress=pending.done)


class Work:
    """What one fragment's next pseudo-gradient covers on this worker: the samples and base
    steps since its last boundary, and the common unit ``scale``.

    Args:
        timed: the periods are time-based (workers take different numbers of steps: the
            common step count ``S`` is then ``tau``).
        tau: the configuration's ``tau``.

    Attributes:
        samples_mark, steps_mark: the worker's cumulative samples and steps at the last
            boundary.
        scale: the mean samples per step of the last outer step that landed (1.0 at first).
    """

    def __init__(self, timed: bool, tau: int) -> None:
        self.timed, self.tau = timed, tau
        self.samples_mark, self.steps_mark, self.scale = 0.0, 0, 1.0

    def ratio(self, samples: float, steps: int) -> float:
        """``r_i`` at a boundary, and the marks move to it.

        Args:
            samples: the worker's cumulative samples.
            steps: the worker's cumulative base steps.
        """
        w, covered = samples - self.samples_mark, steps - self.steps_mark
        self.samples_mark, self.steps_mark = samples, steps
        common = self.tau if self.timed else covered
        return w / (self.scale * max(common, 1))

    def landed(self, merged: Merged) -> None:
        """The outer step landed: the unit follows the workers' mean."""
        if not merged.equal:
            self.scale *= merged.ratio

    def restart(self, samples: float, steps: int) -> None:
        """A restart from the anchor: the next pseudo-gradient starts now."""
        self.samples_mark, self.steps_mark = samples, steps

    def state_dict(self) -> list[float]:
        """``[samples_mark, steps_mark, scale]``."""
        return [self.samples_mark, float(self.steps_mark), self.scale]

    def load(self, saved: Any) -> bool:
        """Take back :meth:`state_dict`'s output; False (nothing changed) where it is not one.

        Args:
            saved: a saved ``[samples_mark, steps_mark, scale]``.
        """
        ok = (
            isinstance(saved, (list, tuple))
            and len(saved) == 3
            and all(isinstance(v, (int, float)) and math.isfinite(v) for v in saved)
            and saved[2] > 0
        )
        if ok:
            self.samples_mark, self.steps_mark, self.scale = (
                float(saved[0]),
                int(saved[1]),
                float(saved[2]),
            )
        return ok
