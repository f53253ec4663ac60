"""Gossip topologies and mixing weights: pure functions of ``(rank, size, step)``.

Nothing here communicates or touches a device, so every graph and mixing matrix is tested
exhaustively in microseconds. Used by the gossip bases (SGP, OSGP, D-PSGD) of SlowMo
(arXiv 1910.00643, Appendix C).

Topologies are given as *out-peers*: ``out_peers(rank, size, step)`` lists the ranks that
``rank`` sends to at ``step``. Push-sum (SGP, OSGP) uses the directed graph as is; D-PSGD uses
its undirected version (``i ~ j`` when either sends to the other).
"""

import math
from collections.abc import Callable, Hashable, Sequence

import torch

from ..validation import check_int

__all__ = [
    "TopologyFn",
    "exponential_out_peers",
    "ring_out_peers",
    "TOPOLOGIES",
    "GossipGraph",
    "push_sum_weights",
    "metropolis_weights",
]

#: A custom topology: ``(rank, size, step) -> out-peers`` (distinct ranks other than ``rank``).
TopologyFn = Callable[[int, int, int], Sequence[int]]
#: One step's whole graph: the out-peers of every rank, in rank order.
Graph = tuple[tuple[int, ...], ...]


def num_exponential_phases(size: int) -> int:
    """Distinct hop lengths ``2^0 .. 2^floor(log2(size-1))`` of the exponential graph.

    Args:
        size: the number of workers (>= 2).
    """
    return int(math.floor(math.log2(size - 1))) + 1 if size >= 2 else 0


def exponential_out_peers(rank: int, size: int, step: int, peers_per_step: int = 1) -> list[int]:
    """Time-varying directed exponential graph of SGP (arXiv 1910.00643, Appendix C; Assran et al.
    2019).

    In rank order, ``rank`` sends to ``(rank + 2^j) mod size`` where ``j`` cycles over
    ``0 .. floor(log2(size-1))`` with the step; with ``peers_per_step = p`` it sends to ``p``
    consecutive hop lengths ``j = (step*p + q) mod phases``, ``q < p``.

    Args:
        rank: the sender.
        size: the number of workers.
        step: the global step.
        peers_per_step: out-peers per step (at most the number of phases).
    """
    phases = num_exponential_phases(size)
    return [
        (rank + 2 ** ((step * peers_per_step + q) % phases)) % size for q in range(peers_per_step)
    ]


def ring_out_peers(rank: int, size: int, step: int, peers_per_step: int = 1) -> list[int]:
    """Directed ring: ``rank`` sends to the next ``peers_per_step`` ranks (time-invariant).

    Args:
        rank: the sender.
        size: the number of workers.
        step: the global step (unused: the ring does not change).
        peers_per_step: out-peers per step (< size).
    """
    return [(rank + 1 + q) % size for q in range(peers_per_step)]


#: Built-in topologies: name -> (out-peer function, period in steps as a function of
#: ``(size, peers_per_step)``, the most peers per step it supports).
TOPOLOGIES: dict[
    str,
    tuple[
        Callable[[int, int, int, int], list[int]], Callable[[int, int], int], Callable[[int], int]
    ],
] = {
    "exponential": (
        exponential_out_peers,
        lambda size, p: num_exponential_phases(size) // math.gcd(num_exponential_phases(size), p),
        num_exponential_phases,
    ),
    "ring": (ring_out_peers, lambda size, p: 1, lambda size: size - 1),
}


def _strongly_connected(size: int, edges: Sequence[tuple[int, int]]) -> bool:
    """Whether the directed graph on ``0..size-1`` is strongly connected (all reached from 0 and
    reaching 0)."""
    fwd: list[list[int]] = [[] for _ in range(size)]
    bwd: list[list[int]] = [[] for _ in range(size)]
    for a, b in edges:
        fwd[a].append(b)
        bwd[b].append(a)
    for adj in (fwd, bwd):
        seen, stack = {0}, [0]
        while stack:
            for nxt in adj[stack.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        if len(seen) != size:
            return False
    return True


def push_sum_weights(out_peers: Sequence[int]) -> tuple[float, float]:
    """Uniform column-stochastic push-sum weights of a sender with these out-peers.

    The sender keeps ``1/(d+1)`` of its numerator and weight and sends ``1/(d+1)`` to each of its
    ``d`` out-peers, so every column of the mixing matrix sums to 1 and total mass is conserved.

    Args:
        out_peers: the sender's out-peers at this step.

    Returns:
        ``(self_share, share_per_peer)``.
    """
    share = 1.0 / (len(out_peers) + 1)
    return share, share


def metropolis_weights(
    rank: int, neighbors: Sequence[Sequence[int]]
) -> tuple[float, dict[int, float]]:
    """Metropolis-Hastings weights of an undirected graph: symmetric and doubly stochastic.

    ``P_ij = 1 / (1 + max(d_i, d_j))`` for neighbours, ``P_ii = 1 - sum_j P_ij``. On a regular
    graph (ring, exponential) this is uniform: ``1/(d+1)`` each (1/3 self and per neighbour
    on a ring).

    Args:
        rank: the row ``i``.
        neighbors: every rank's undirected neighbours.

    Returns:
        ``(P_ii, {j: P_ij})``.
    """
    d_i = len(neighbors[rank])
    out = {j: 1.0 / (1 + max(d_i, len(neighbors[j]))) for j in neighbors[rank]}
    return 1.0 - sum(out.values()), out


class GossipGraph:
    """A time-varying graph over ``size`` workers, validated once, cached per phase.

    Args:
        topology: ``"exponential"``, ``"ring"``, or a callable ``(rank, size, step) -> out-peers``.
        size: the number of workers.
        peers_per_step: out-peers per step for the built-in topologies.
        undirected: D-PSGD: use the undirected version of the graph.

    Raises:
        ValueError: a bad ``peers_per_step``, a custom topology that returns invalid peers, or
            one that is not strongly connected over its first ``size`` steps (union of edges).
        TypeError: a topology that is neither a known name nor callable, a ``peers_per_step``
            that is not an integer.
    """

    def __init__(
        self,
        topology: str | TopologyFn,
        size: int,
        peers_per_step: int = 1,
        undirected: bool = False,
    ) -> None:
        check_int(
            "peers_per_step", peers_per_step, 1, "the out-peers each worker sends to per step"
        )
        self.size = size
        self.peers_per_step = peers_per_step
        self.undirected = undirected
        self._cache: dict[int, Graph] = {}
        self.period: int | None
        if isinstance(topology, str):
            if topology not in TOPOLOGIES:
                raise ValueError(
                    f"topology must be one of {sorted(TOPOLOGIES)} or a callable "
                    f"(rank, size, step) -> out-peers, got {topology!r}"
                )
            fn, period, max_peers = TOPOLOGIES[topology]
            if peers_per_step > max_peers(size):
                raise ValueError(
                    f"peers_per_step={peers_per_step} exceeds the {max_peers(size)} distinct "
                    f"peer(s) a {topology!r} graph has per step with {size} workers; lower it"
                )
            self.name = topology
            self._fn: TopologyFn = lambda r, m, k: fn(r, m, k, peers_per_step)
            self.period = period(size, peers_per_step)
        elif callable(topology):
            if peers_per_step != 1:
                raise ValueError(
                    "peers_per_step applies to the built-in topologies; a custom topology "
                    "returns its own out-peers: leave peers_per_step=1"
                )
            self.name = getattr(topology, "__name__", "custom")
            self._fn = topology
            self.period = None  # unknown: graphs are cached per step instead of per phase
            window = [self.graph(k) for k in range(size)]
            edges = {(i, j) for g in window for i, outs in enumerate(g) for j in outs}
            if undirected:
                edges |= {(j, i) for i, j in edges}
            if not _strongly_connected(size, sorted(edges)):
                raise ValueError(
                    f"topology {self.name!r} is not strongly connected over its first {size} "
                    "steps (the union of their edges): some worker would never hear from "
                    "another; add edges (e.g. use 'exponential')"
                )
        else:
            raise TypeError(
                f"topology must be 'exponential', 'ring' or a callable (rank, size, step) -> "
                f"out-peers, got {type(topology).__name__}"
            )

    def graph(self, step: int) -> Graph:
        """Every rank's out-peers at ``step`` (sorted); identical on every rank.

        Args:
            step: the global step.
        """
        key = step % self.period if self.period else step
        g = self._cache.get(key)
        if g is None:
            g = tuple(self._checked_peers(r, step) for r in range(self.size))
            if self.undirected:
                nbrs: list[set] = [set(outs) for outs in g]
                for i, outs in enumerate(g):
                    for j in outs:
                        nbrs[j].add(i)
                g = tuple(tuple(sorted(n)) for n in nbrs)
            if self.period:
                self._cache[key] = g
            else:
                # Custom topologies: keep only the current step (steps advance monotonically).
                self._cache = {key: g}
        return g

    def _checked_peers(self, rank: int, step: int) -> tuple[int, ...]:
        peers = self._fn(rank, self.size, step)
        try:
            out = tuple(sorted(int(p) for p in peers))
        except (TypeError, ValueError):
            raise ValueError(
                f"topology {self.name!r} returned {peers!r} for rank {rank} at step {step}; "
                "it must return a sequence of ranks"
            ) from None
        if (
            not out
            or len(set(out)) != len(out)
            or rank in out
            or not all(0 <= p < self.size for p in out)
        ):
            raise ValueError(
                f"topology {self.name!r} returned out-peers {list(out)} for rank {rank} at step "
                f"{step}; they must be distinct ranks in [0, {self.size}) other than the rank "
                "itself, at least one"
            )
        return out

    def key(self, step: int) -> Hashable:
        """A key identifying the global graph at ``step`` (same on every rank; for caching
        per-graph transport state such as MPI distributed-graph communicators).

        Args:
            step: the global step.
        """
        return self.graph(step)

    def out_peers(self, rank: int, step: int) -> tuple[int, ...]:
        """Ranks that ``rank`` sends to (its neighbours when undirected).

        Args:
            rank: the sender.
            step: the global step.
        """
        return self.graph(step)[rank]

    def in_peers(self, rank: int, step: int) -> tuple[int, ...]:
        """Ranks that send to ``rank`` at ``step`` (sorted).

        Args:
            rank: the receiver.
            step: the global step.
        """
        g = self.graph(step)
        return tuple(j for j in range(self.size) if rank in g[j])

    def mixing_matrix(self, step: int) -> torch.Tensor:
        """The ``size x size`` mixing matrix ``P_k`` (float64), with ``X_{k+1} = X_{k+1/2} P_k^T``
        for parameters stacked as columns: ``P[i, j]`` is what ``i`` takes from ``j``.

        Column-stochastic push-sum weights for a directed graph, symmetric doubly-stochastic
        Metropolis weights for an undirected one.

        Args:
            step: the global step.
        """
        g = self.graph(step)
        p = torch.zeros(self.size, self.size, dtype=torch.float64)
        for j in range(self.size):
            if self.undirected:
                self_w, w = metropolis_weights(j, g)
                p[j, j] = self_w
                for i, wij in w.items():
                    p[j, i] = wij
            else:
                keep, share = push_sum_weights(g[j])
                p[j, j] = keep
                for i in g[j]:
                    p[i, j] = share
        return p
