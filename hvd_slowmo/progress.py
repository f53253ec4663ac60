"""Where the workers are: equal step counts and finite parameters at each outer step.

SlowMo's outer steps (arXiv 1910.00643, Algorithm 1) are count-based: every worker must reach
each one after the same number of base steps, and one worker's NaN must not be averaged into the
others. Both are checked with one tiny collective per outer step (docs/reliability.md).
"""

import warnings
from typing import Any

import torch
from torch import Tensor

from .comm.base import Communicator
from .finite import all_finite

__all__ = [
    "PROGRESS",
    "all_finite",
    "finite_verdict",
    "gather_progress",
    "outer_step_note",
    "progress_probe",
    "read_progress",
    "uneven_message",
]


def gather_progress(
    comm: Communicator,
    at: str,
    finite: bool,
    num_steps: int,
    outer_steps: int,
    by: str = "num_steps",
) -> list[dict[str, Any]]:
    """Every worker's progress, in rank order. Collective.

    The same collective serves every call (Horovod matches collectives by name), so a worker in
    :meth:`~hvd_slowmo.DistributedOptimizer.finish` meets a worker still at an outer step instead
    of stalling. Normally it is one 4-element allreduce: every rank gets the same averages, so
    all take the same branch, and only when something is wrong do they pay for an allgather of
    the details.

    Args:
        comm: the communicator over all workers.
        at: ``"outer step"`` or ``"finish"``.
        finite: whether this worker's parameters are finite.
        num_steps: this worker's base steps so far.
        outer_steps: this worker's outer steps so far.
        by: the count compared (:func:`progress_probe`).

    Raises:
        RuntimeError: workers are at different places (one finishing, one at an outer step).
    """
    mine = {"at": at, "finite": finite, "num_steps": num_steps, "outer_steps": outer_steps}
    probe = progress_probe(mine, by)
    comm.average_([probe], name=PROGRESS)
    return read_progress(comm, probe, mine)


#: The name of the progress collective: every call site uses it, so they meet (see above).
PROGRESS = "hvd_slowmo.progress"


def progress_probe(mine: dict[str, Any], by: str = "num_steps") -> Tensor:
    """The 4 numbers :func:`gather_progress` averages: non-finite flag, finishing flag, step
    count and its square (an overlapped outer step averages it in the background).

    Args:
        mine: this worker's ``{"at", "finite", "num_steps", "outer_steps"}``.
        by: the count every worker must agree on: ``"num_steps"``, or ``"outer_steps"`` where
            the workers take different numbers of base steps (time-based periods).
    """
    n = float(mine[by])
    bad, finishing = (0.0 if mine["finite"] else 1.0), (1.0 if mine["at"] == "finish" else 0.0)
    return torch.tensor([bad, finishing, n, n * n], dtype=torch.float64)


def read_progress(comm: Communicator, probe: Tensor, mine: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`gather_progress`'s answer from the averaged probe (an allgather of the details
    only when something is wrong). Collective in that case.

    Args:
        comm: the communicator over all workers.
        probe: :func:`progress_probe`'s tensor, averaged over all workers.
        mine: this worker's progress, as given to :func:`progress_probe`.
    """
    at = mine["at"]
    any_bad, finishing, mean, mean_sq = probe.tolist()
    # All counts equal <=> mean(n^2) == mean(n)^2; exact in float64 while m * n^2 < 2^53.
    if any_bad == 0.0 and finishing in (0.0, 1.0) and mean_sq == mean * mean:
        return [mine] * comm.size
    everyone = comm.allgather_object(mine)
    if any(p["at"] != at for p in everyone):
        raise RuntimeError(uneven_message(everyone))
    return everyone


def uneven_message(everyone: list[dict[str, Any]]) -> str:
    """The error for workers that called ``step()`` different numbers of times.

    Args:
        everyone: :func:`gather_progress`'s result.
    """
    where = "; ".join(
        f"rank {r} at {p['at']} after {p['num_steps']} steps" for r, p in enumerate(everyone)
    )
    return (
        f"hvd_slowmo: workers called step() different numbers of times ({where}). SlowMo's outer "
        "steps need the same number of steps on every worker: give every rank the same number of "
        "batches (DistributedSampler(drop_last=True) with a DataLoader(drop_last=True), or "
        "hvd.elastic.ElasticSampler); hvd.join() cannot even out outer steps, which are not "
        "allreduces"
    )


def finite_verdict(
    everyone: list[dict[str, Any]], nonfinite: str, num_steps: int, outer_steps: int
) -> bool:
    """Act on every worker's finite flag: True if all are finite; False (after a warning) if
    not and ``nonfinite="skip"``.

    Args:
        everyone: :func:`gather_progress`'s result.
        nonfinite: ``"raise"`` or ``"skip"``.
        num_steps: this worker's base steps at the outer step.
        outer_steps: this worker's outer steps before it.

    Raises:
        FloatingPointError: on every worker, naming the ranks, with ``nonfinite="raise"``.
    """
    bad = [r for r, p in enumerate(everyone) if not p["finite"]]
    if not bad:
        return True
    where = (
        f"non-finite parameters (NaN/inf) on rank(s) {bad} after step {num_steps} "
        f"(outer step {outer_steps})"
    )
    if nonfinite == "raise":
        raise FloatingPointError(
            f"{where}; they were not averaged into the other workers. Lower the learning rate or "
            "clip gradients, or pass nonfinite='skip' to restart the outer step from the last "
            "anchor"
        )
    warnings.warn(
        f"{where}: outer step skipped, every worker restarts from the previous anchor", stacklevel=5
    )
    return False


def outer_step_note(
    error: BaseException, comm: Communicator, outer_steps: int, num_steps: int, base_name: str
) -> str:
    """The note added to an error raised in an outer step: where it happened, and for Horovod's
    error what it usually means.

    Args:
        error: the error.
        comm: the communicator over all workers.
        outer_steps: the outer step that failed.
        num_steps: the base steps taken.
        base_name: the base algorithm's name.
    """
    hint = (
        "; a worker died, froze (HOROVOD_GLOO_TIMEOUT_SECONDS), or stopped calling step() early "
        "(uneven data or hvd.join(): see DistributedOptimizer.finish)"
        if type(error).__name__ == "HorovodInternalError"
        else ""
    )
    return (
        f"hvd_slowmo: raised on rank {comm.rank} of {comm.size} at outer step {outer_steps} "
        f"(after step {num_steps}), base {base_name!r}{hint}"
    )
