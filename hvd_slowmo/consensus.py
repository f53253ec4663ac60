"""The workers' consensus model: the average of their parameters, de-biased for push-sum bases
(SGP, OSGP keep ``z = x / w``; the consensus is ``sum_i x_i / sum_i w_i``). What an evaluation of
"the" model uses between exact averages (arXiv 1910.00643 evaluates the averaged model)."""

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .bases.base import BaseAlgorithm
from .comm.base import Communicator
from .islands import local
from .outer_step import OuterLoop

__all__ = ["ConsensusView", "consensus_average", "swapped_in"]


@torch.no_grad()
def consensus_average(
    comm: Communicator, params: list[Tensor], weight: float, buffers: list[Tensor]
) -> tuple[list[Tensor], list[Tensor]]:
    """Copies of the consensus parameters and of the averaged model buffers, bitwise identical
    on every worker. Collective: one allreduce in float64, ``comm.uncounted()`` (evaluation
    traffic is not training traffic).

    Args:
        comm: the communicator over all workers.
        params: this worker's (de-biased) parameters.
        weight: this worker's push-sum weight ``w`` (1 for bases without one).
        buffers: this worker's floating-point model buffers (plainly averaged).

    Returns:
        ``(parameters, buffers)``: new tensors, of the inputs' shapes and dtypes.
    """
    tensors = params + buffers
    if not tensors:
        return [], []
    device = tensors[0].device
    flat = torch.cat(
        [p.detach().reshape(-1).to(torch.float64) * weight for p in params]
        + [torch.full((1,), weight, dtype=torch.float64, device=device)]
        + [b.detach().reshape(-1).to(torch.float64) for b in buffers]
    )
    with comm.uncounted():
        comm.average_([flat], name="hvd_slowmo.consensus")
    n = sum(p.numel() for p in params)
    # mean(x) / mean(w) = sum(x) / sum(w): the push-sum consensus value.
    values = torch.cat([flat[:n] / flat[n], flat[n + 1 :]])
    out, offset = [], 0
    for t in tensors:
        out.append(values[offset : offset + t.numel()].view_as(t).to(t.dtype).clone())
        offset += t.numel()
    return out[: len(params)], out[len(params) :]


@contextlib.contextmanager
def swapped_in(live: list[Tensor], values: Callable[[], list[Tensor]]) -> Iterator[None]:
    """Inside the block ``live`` holds ``values()``; afterwards its own values again, bitwise.

    Args:
        live: the tensors to overwrite (parameters and model buffers).
        values: computes the replacement (called once, on entry), one tensor per ``live`` one.
    """
    with torch.no_grad():
        saved = [t.detach().clone() for t in live]
        for t, v in zip(live, values()):
            t.detach().copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for t, s in zip(live, saved):
                t.detach().copy_(s)


class ConsensusView:
    """The consensus side of :class:`hvd_slowmo.DistributedOptimizer`: whether the workers hold
    the same model now, and their consensus model (what an evaluation of "the" model uses).

    A mixin: the optimizer provides the attributes annotated here.
    """

    comm: Communicator
    params: list[Tensor]
    model_buffers: list[Tensor]
    outer: OuterLoop
    average: bool

    if TYPE_CHECKING:  # provided by the optimizer (read-only: rebuilt with the workers)

        @property
        def base(self) -> BaseAlgorithm: ...

    def at_consensus(self) -> bool:
        """Whether every worker holds the same model now (no communication): always with
        AR-SGD (gradients are averaged every step); with the other bases before the first step
        and right after an exact average has landed, i.e. at an outer-step boundary without an
        average in flight (never for a gossip base run with ``average=False``, nor with
        ``fragments > 1``: each fragment is averaged at its own boundary)."""
        pos = self.outer.position
        if self.comm.size == 1 or pos.num_steps == 0 or not self.base.needs_exact_average:
            return True
        whole = len(self.outer.fragments) == 1
        return pos.inner_step == 0 and self.average and self.outer.in_flight is None and whole

    def consensus(self) -> tuple[list[Tensor], list[Tensor]]:
        """Copies of the workers' consensus parameters (their average, de-biased for push-sum
        bases; gossip messages still in flight are not counted) and of the averaged model
        buffers, in the optimizer's order; this worker's own tensors when
        :meth:`at_consensus`. With ``worker=Islands(...)`` each parameter is this rank's shard
        (averaged with the ranks holding it in the other islands). Collective unless at
        consensus; the live model is not changed, and the traffic is not counted in
        :attr:`bytes_sent`."""
        params = [local(p).detach() for p in self.params]
        if self.at_consensus():
            return [p.clone() for p in params], [b.detach().clone() for b in self.model_buffers]
        return consensus_average(
            self.comm, params, float(self.base.consensus_weight), self.model_buffers
        )

    @contextlib.contextmanager
    def use_consensus(self) -> Iterator[bool]:
        """Inside the block the parameters and model buffers hold :meth:`consensus` (e.g. to
        evaluate the averaged model); afterwards this worker's own values again, bitwise, so
        training continues undisturbed. Collective unless at consensus.

        Yields:
            True when they already held it (nothing was changed).
        """
        if self.at_consensus():
            yield True
            return
        live = [local(p) for p in self.params] + self.model_buffers  # a shard's own tensor
        with swapped_in(live, lambda: sum(self.consensus(), [])):
            yield False
