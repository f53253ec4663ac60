"""The hierarchical compressed average: exact inside a node, a codec across nodes.

For ``P`` workers in ``M`` nodes of ``G`` (SlowMo's exact average, arXiv 1910.00643, sent as a
codec's packets only where the links are slow), each worker with a flat float32 vector ``v``:

1. **Inside the node**, an exact fp32 reduce-scatter: local rank ``l`` gets shard ``l`` (as
   :func:`~hvd_slowmo.comm.base.shard_range` splits the vector over ``G``) of its node's mean.
2. **Across nodes**, the ranks of local rank ``l`` (one per node) average their shards with the
   codec's own average (:func:`~hvd_slowmo.compression.means.mean_start`: the dense
   codecs' all-to-all and all-gather, or the sparse all-gather), with this rank's error
   feedback on its shard: the same bits on every node.
3. **Inside the node**, an fp32 all-gather of the averaged shards: every worker of every node
   holds the same vector, bit for bit.

Each node's link carries ``G`` exchanges of ``n / G`` values among ``M`` nodes: about the bytes
of one worker's exchange of the whole vector among ``M`` workers, instead of ``G`` workers'
among ``P``. The mean is the workers' mean up to the codec's rounding: the nodes' means are
averaged, each of ``G`` workers.
"""

from torch import Tensor

from ..comm.base import Communicator, shard_sizes
from .codecs import Codec, as_codec, check_transport, check_vector
from .means import mean_start

__all__ = ["hierarchical_mean"]


def hierarchical_mean(
    node: Communicator,
    cross: Communicator,
    flat: Tensor,
    codec: "str | Codec",
    name: str,
    residual: Tensor | None = None,
) -> Tensor:
    """The average over every worker of ``flat``: exact inside ``node``, ``codec`` across
    ``cross``; identical bits on every worker. Collective on both communicators.

    Args:
        node: this worker's node (every worker of a node calls with the same ``node`` group).
        cross: the workers of the other nodes with this worker's local rank (``node.rank``),
            one per node, in node order.
        flat: this worker's 1-D float32 vector; the same length on every worker.
        codec: a :class:`~hvd_slowmo.compression.codecs.Codec` or its spelling.
        name: a label for the collectives.
        residual: this worker's error-feedback residual over its shard (1-D float32 of
            ``shard_sizes(flat.numel(), node.size)[node.rank]`` elements), updated in place;
            None: no error feedback.

    Returns:
        A new 1-D float32 tensor: the average.

    Raises:
        ValueError: a vector that is not 1-D float32, a residual of another length, or a
            ``cross`` without the collectives of a compressed average.
    """
    codec = as_codec(codec)
    check_vector(flat, None, "hierarchical_mean")
    mine = shard_sizes(flat.numel(), node.size)[node.rank]
    if residual is not None and tuple(residual.shape) != (mine,):
        raise ValueError(
            f"hierarchical_mean: residual must be float32 of this rank's shard, {mine} elements "
            f"(local rank {node.rank} of {node.size}), got shape {tuple(residual.shape)}"
        )
    check_transport(cross, codec)
    (shard,) = node.reduce_scatter_mean([flat], f"{name}.node")
    mean = mean_start(codec, cross, shard, f"{name}.cross", residual).wait()
    (whole,) = node.allgather_flat([mean], f"{name}.gather")
    return whole
