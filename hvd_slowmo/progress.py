"""Workers agree on their progress: equal step counts and finite parameters at each outer step.

SlowMo's outer steps (arXiv 1910.00643, Algorithm 1) are count-based: every worker must reach
each one after the same number of base steps, and one worker's NaN must not be averaged into the
others. Both are checked with one tiny collective per outer step (docs/reliability.md).
"""

from typing import Any

import torch

from .comm.base import Communicator

__all__ = ["gather_progress", "uneven_message"]


def gather_progress(comm: Communicator, at: str, finite: bool, num_steps: int,
                    outer_steps: int) -> list[dict[str, Any]]:
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

    Raises:
        RuntimeError: workers are at different places (one finishing, one at an outer step).
    """
    mine = {"at": at, "finite": finite, "num_steps": num_steps, "outer_steps": outer_steps}
    n = float(num_steps)
    probe = torch.tensor([0.0 if finite else 1.0, 1.0 if at == "finish" else 0.0, n, n * n],
                         dtype=torch.float64)
    comm.average_([probe], name="hvd_slowmo.progress")
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
    where = "; ".join(f"rank {r} at {p['at']} after {p['num_steps']} steps" for r, p in enumerate(everyone))
    return (f"hvd_slowmo: workers called step() different numbers of times ({where}). SlowMo's outer "
            "steps need the same number of steps on every worker: give every rank the same number of "
            "batches (DistributedSampler(drop_last=True) with a DataLoader(drop_last=True), or "
            "hvd.elastic.ElasticSampler); hvd.join() cannot even out outer steps, which are not allreduces")
