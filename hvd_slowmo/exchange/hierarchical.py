"""The hierarchical exchange: exact inside a node, across nodes only a shard per rank.

SlowMo's exact average (arXiv 1910.00643, Algorithm 1, line 6) over ``M`` nodes of ``G`` ranks,
with the node's ranks holding either their own parameters (``worker="process"``) or identical
ones (``worker="node"``, or DDP inside an island: *replicated*). Each rank's flat vector ``v`` is
its parameters, or with a codec its pseudo-gradient ``anchor - parameters``:

1. **Inside the node**: local rank ``l`` takes shard ``l`` of ``v`` (split as
   :func:`~hvd_slowmo.comm.base.shard_range` splits over ``G``); replicated ranks hold it
   already, the others reduce-scatter their node's mean of it in fp32.
2. **Across nodes**: the ``M`` ranks of local rank ``l`` average their shards, with a plain
   average or the codec's own (dense all-to-all, sparse all-gather, owners), this rank's error
   feedback on its shard.
3. **Inside the node**: an fp32 all-gather of the averaged shards; with a codec every rank then
   sets its parameters to ``anchor - mean``.

Every rank of every node ends with the same bits. Each slow link carries ``G`` exchanges of
``n / G`` values among ``M`` ranks instead of ``G`` exchanges of ``n`` values among ``M G``: a
sparse all-gather, whose received bytes grow with the ranks it spans, receives ``G^2`` times
fewer; a dense codec encodes ``G`` times fewer values per rank. A ring allreduce of the plain
parameters moves about the same bytes across nodes either way (NCCL's rings are already
topology-aware), so the gain is for codecs.
"""

from typing import Any

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingAverage, shard_range
from ..comm.hierarchy import Hierarchy
from ..compression.codecs import Codec, as_codec, check_transport
from ..compression.means import mean_start
from ..compression.offload import CodecThread
from ..compression.sparse import SparseCodec
from ..slow_state import SlowState
from .base import EXACT_AVERAGE, Payload
from .plain import PlainExchange

__all__ = ["HierarchicalExchange"]


class HierarchicalExchange(PlainExchange):
    """The exact average through a node level and a cross-node level (module docstring).

    Args:
        comm: the communicator over every rank (the model buffers' plain average).
        hierarchy: this rank's node and its same-local-rank peers in the other nodes.
        slow_state: the fragment's slow state, whose anchor a codec's pseudo-gradients are
            measured from.
        codec: a codec or its spelling (:func:`~hvd_slowmo.compression.codecs.as_codec`), or
            None: the shards' plain average.
        error_feedback: keep this rank's residual over its shard (needs ``codec``).
        replicated: the node's ranks hold identical parameters (``worker="node"``, DDP
            islands): each takes its shard without a reduce-scatter.
        overlap: the optimizer's ``overlap``: from 1 on, the average runs on a thread of its
            own from the boundary on where every level's transport allows it
            (``collectives_any_thread``), else at the landing.

    Raises:
        ValueError: ``hierarchy.cross`` lacks the collectives of the codec's average.
    """

    name = "hierarchical"
    unsupported = {
        "fragments": "its shards and residual are laid over the whole model; pass fragments=1",
        "merge": "the weights must travel beside the shards, which its levels do not carry",
        "period": "the step times must travel beside the shards, which its levels do not carry",
    }

    def __init__(
        self,
        comm: Communicator,
        hierarchy: Hierarchy,
        slow_state: SlowState,
        codec: "str | SparseCodec | Codec | None",
        error_feedback: bool,
        replicated: bool,
        overlap: int = 0,
    ) -> None:
        self.codec: Codec | None = None if codec is None else as_codec(codec)
        if self.codec is not None:
            check_transport(hierarchy.cross, self.codec)
        super().__init__(comm)
        self.node, self.cross = hierarchy.node, hierarchy.cross
        self.slow_state = slow_state
        self.error_feedback = error_feedback and self.codec is not None
        self.replicated = replicated
        #: This rank's error-feedback residual over its shard (float32), or None.
        self.residual: Tensor | None = None
        levels = (comm, self.node, self.cross)
        background = overlap >= 1 and all(c.collectives_any_thread for c in levels)
        self._thread = CodecThread(comm.counter) if background and comm.size > 1 else None

    def start(self, payload: Payload, exact: bool) -> PendingAverage:
        if not exact or not payload.params:
            return super().start(payload, exact)
        params, extra = payload.params, payload.extra

        def run() -> None:
            self._average_(params)
            self.comm.average_(extra, EXACT_AVERAGE)

        if self._thread is None:  # at the landing: overlap hides none of it
            return PendingAverage(run, started=False)
        job = self._thread.submit(run, {t.device for t in [*params, *extra] if t.is_cuda})
        return PendingAverage(job.wait, progress=job.done)

    @torch.no_grad()
    def _average_(self, params: list[Tensor]) -> None:
        """Average ``params`` in place through the two levels (module docstring)."""
        flat = torch.cat([p.detach().float().reshape(-1) for p in params])
        anchor = None
        if self.codec is not None:
            # The fragment's anchor, in the optimizer's order (fragments=1: the whole model).
            assert self.slow_state.anchor is not None, "the anchor is captured at the first step"
            anchor = torch.cat([a.float().reshape(-1) for a in self.slow_state.anchor])
            torch.sub(anchor, flat, out=flat)  # the pseudo-gradient, in the same buffer
        name = "hvd_slowmo.hierarchical_average"
        start, end = shard_range(flat.numel(), self.node.rank, self.node.size)
        if self.replicated or self.node.size == 1:
            shard = flat[start:end]  # a view of this average's own buffer: nothing to copy
        else:
            (shard,) = self.node.reduce_scatter_mean([flat], f"{name}.node")
        if self.codec is None:
            self.cross.average_([shard], f"{name}.cross")
            mean = shard
        else:
            mean = mean_start(
                self.codec, self.cross, shard, f"{name}.cross", self._residual(shard)
            ).wait()
        (whole,) = self.node.allgather_flat([mean], f"{name}.gather")
        if anchor is not None:
            whole = anchor.sub_(whole)
        for p, v in zip(params, whole.split([p.numel() for p in params])):
            p.copy_(v.view_as(p))

    def _residual(self, shard: Tensor) -> Tensor | None:
        """This rank's residual over ``shard`` (made at the first average), or None."""
        if not self.error_feedback:
            return None
        if self.residual is None or self.residual.shape != shard.shape:
            self.residual = torch.zeros_like(shard)
        self.residual = self.residual.to(shard.device)  # a loaded one: on the CPU
        return self.residual

    def reset(self) -> None:
        # The residual was lost with the steps since the anchor.
        self.residual = None

    def _owner(self) -> dict[str, Any]:
        """What a saved residual must match to be this rank's own."""
        return {
            "codec": None if self.codec is None else self.codec.summary(),
            "node": [self.node.rank, self.node.size],
            "cross": [self.cross.rank, self.cross.size],
        }

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.residual is None else {**self._owner(), "residual": self.residual}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        residual = None if saved is None else saved.get("residual")
        own = saved is not None and all(saved.get(k) == v for k, v in self._owner().items())
        if isinstance(residual, Tensor) and own and self.error_feedback:
            self.residual = residual.detach().to(torch.float32).clone()
        else:
            self.residual = None  # another rank's, codec's or layout's: start from zero
