"""Hierarchical SlowMo: a node (e.g. a DGX with 8 GPUs) is one SlowMo worker.

As in the paper's ImageNet and WMT runs: inside a node, gradients are averaged every step
(NCCL over NVLink on GPUs); the base algorithm's communication (Local SGD's nothing, gossip,
AR-SGD's allreduce) runs *between* nodes, among the ranks that share a local rank; the exact
average and the slow update run on every rank. Ranks of one node hold identical parameters at
every step, so averaging among same-local-rank peers equals averaging whole nodes, and every
inter-node link carries ``local_size`` independent streams at once.

``Hierarchy`` holds the two communicators; :func:`node_groups` is the pure map from the host
layout to the groups; :func:`hvd_slowmo.comm.factory.horovod_node_hierarchy` builds the two
communicators from Horovod process sets (arXiv 1910.00643, Section 5 and Appendix A).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from .base import Communicator

__all__ = ["Hierarchy", "node_groups"]


@dataclass
class Hierarchy:
    """The two levels of a hierarchical run, from this rank's point of view.

    Attributes:
        node: this rank's node: gradients are averaged over it at every step.
        cross: the ranks of other nodes with this rank's local rank: the base algorithm runs over
            it, so its ``size`` is the number of SlowMo workers (nodes).
    """

    node: Communicator
    cross: Communicator


def node_groups(layout: Sequence[tuple[int, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Group global ranks into nodes and into same-local-rank peer groups.

    Args:
        layout: ``(node index, local rank)`` of every global rank, in global rank order
            (``hvd.cross_rank()``, ``hvd.local_rank()`` under horovodrun).

    Returns:
        ``(nodes, peers)``: ``nodes[n]`` lists node ``n``'s ranks by local rank; ``peers[l]``
        lists the ranks with local rank ``l`` by node.

    Raises:
        ValueError: nodes with different numbers of processes (every node must be one worker of
            the same shape) or a duplicated (node, local rank) pair.
    """
    by_node: dict[int, dict[int, int]] = {}
    for rank, (node, local) in enumerate(layout):
        slots = by_node.setdefault(node, {})
        if local in slots:
            raise ValueError(
                f"ranks {slots[local]} and {rank} both claim node {node}, local rank {local}"
            )
        slots[local] = rank
    sizes = {n: len(s) for n, s in by_node.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(
            f"worker='node' needs the same number of processes on every node, got {sizes} "
            "(node: processes); launch the same -np per host"
        )
    local_size = next(iter(sizes.values()))
    for n, slots in by_node.items():
        if sorted(slots) != list(range(local_size)):
            raise ValueError(
                f"node {n} has local ranks {sorted(slots)}, expected 0..{local_size - 1}"
            )
    nodes = [[by_node[n][local] for local in range(local_size)] for n in sorted(by_node)]
    peers = [[by_node[n][local] for n in sorted(by_node)] for local in range(local_size)]
    return nodes, peers
