"""Gossip topologies and mixing matrices: pure functions, checked exhaustively for small worlds."""

import pytest
import torch

from hvd_slowmo.bases.topology import (
    GossipGraph,
    exponential_out_peers,
    metropolis_weights,
    num_exponential_phases,
    push_sum_weights,
)

SIZES = range(2, 9)


def test_exponential_graph_by_hand():
    # 8 workers: hops 1, 2, 4 cycling with the step (floor(log2 7) = 2).
    assert [exponential_out_peers(3, 8, k) for k in range(4)] == [[4], [5], [7], [4]]
    # 5 workers: floor(log2 4) = 2, so hops 1, 2, 4.
    assert [exponential_out_peers(4, 5, k) for k in range(3)] == [[0], [1], [3]]
    # 2 workers: one phase, one hop.
    assert num_exponential_phases(2) == 1 and exponential_out_peers(1, 2, 7) == [0]
    # Two peers per step take consecutive hop lengths.
    assert [exponential_out_peers(0, 8, k, 2) for k in range(3)] == [[1, 2], [4, 1], [2, 4]]


@pytest.mark.parametrize("size", SIZES, ids=lambda m: f"m{m}")
def test_exponential_in_peers_are_the_inverse(size):
    graph = GossipGraph("exponential", size)
    for k in range(2 * graph.period):
        for i in range(size):
            (hop,) = {(j - i) % size for j in graph.out_peers(i, k)}
            assert hop == 2 ** (k % num_exponential_phases(size))
            assert graph.in_peers(i, k) == ((i - hop) % size,)


def _cases():
    for size in SIZES:
        for name in ("exponential", "ring"):
            most = num_exponential_phases(size) if name == "exponential" else size - 1
            for p in sorted({1, 2, most}):
                if p <= most:
                    yield size, name, p


def _uncached(name, size, p, step):
    """The mixing matrix at ``step`` from a graph that has computed nothing before: its cache
    cannot answer, so the out-peer function itself runs at ``step``."""
    return GossipGraph(name, size, peers_per_step=p).mixing_matrix(step)


@pytest.mark.parametrize("size,name,p", list(_cases()), ids=lambda v: str(v))
def test_push_sum_matrix_is_column_stochastic_and_periodic(size, name, p):
    graph = GossipGraph(name, size, peers_per_step=p)
    union = torch.zeros(size, size)
    for k in range(graph.period):
        mat = graph.mixing_matrix(k)
        assert torch.allclose(mat.sum(0), torch.ones(size, dtype=torch.float64), atol=1e-15, rtol=0)
        assert (mat >= 0).all()
        # The graph repeats after `period` steps: computed afresh one and two periods later,
        # and as the cache (keyed by step % period) answers there.
        for later in (k + graph.period, k + 2 * graph.period):
            assert torch.equal(_uncached(name, size, p, later), mat), f"step {later} != step {k}"
            assert torch.equal(graph.mixing_matrix(later), _uncached(name, size, p, later))
        assert torch.allclose(
            torch.diagonal(mat), torch.full((size,), 1.0 / (p + 1), dtype=torch.float64)
        )
        union += (mat > 0).float()
    # Strongly connected over one period: (I + A)^(m-1) has no zero entry.
    reach = torch.linalg.matrix_power((union > 0).double(), size - 1)
    assert (reach > 0).all()


@pytest.mark.parametrize("size,name,p", list(_cases()), ids=lambda v: str(v))
def test_dpsgd_matrix_is_symmetric_doubly_stochastic(size, name, p):
    graph = GossipGraph(name, size, peers_per_step=p, undirected=True)
    for k in range(graph.period):
        mat = graph.mixing_matrix(k)
        assert torch.equal(mat, mat.T)
        assert torch.allclose(mat.sum(0), torch.ones(size, dtype=torch.float64), atol=1e-15, rtol=0)
        assert (mat >= 0).all()


def test_ring_dpsgd_weights_by_hand():
    mat = GossipGraph("ring", 4, undirected=True).mixing_matrix(0)
    third = 1.0 / 3
    expected = torch.tensor(
        [
            [third, third, 0, third],
            [third, third, third, 0],
            [0, third, third, third],
            [third, 0, third, third],
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(mat, expected, atol=1e-15, rtol=0)
    # Two workers: one neighbour, a 1/2 pairwise exchange.
    assert torch.equal(
        GossipGraph("ring", 2, undirected=True).mixing_matrix(0),
        torch.full((2, 2), 0.5, dtype=torch.float64),
    )


def test_metropolis_weights_on_an_irregular_graph():
    # A path 0 - 1 - 2: degrees 1, 2, 1.
    nbrs = [(1,), (0, 2), (1,)]
    assert metropolis_weights(0, nbrs) == (1 - 1 / 3, {1: 1 / 3})
    self_w, w = metropolis_weights(1, nbrs)
    assert w == {0: 1 / 3, 2: 1 / 3} and abs(self_w - 1 / 3) < 1e-15
    assert push_sum_weights([3, 5]) == (1 / 3, 1 / 3)


def test_custom_topology_is_used_and_symmetrized_for_dpsgd():
    def star_then_ring(rank, size, step):  # a valid time-varying custom graph
        return [(rank + 1) % size] if step % 2 else [0 if rank else 1]

    g = GossipGraph(star_then_ring, 4)
    assert g.graph(0) == ((1,), (0,), (0,), (0,)) and g.in_peers(0, 0) == (1, 2, 3)
    assert g.graph(1) == ((1,), (2,), (3,), (0,))
    u = GossipGraph(star_then_ring, 4, undirected=True)
    assert u.graph(0) == ((1, 2, 3), (0,), (0,), (0,))
    mat = u.mixing_matrix(0)
    assert torch.equal(mat, mat.T) and torch.allclose(
        mat.sum(1), torch.ones(4, dtype=torch.float64)
    )


@pytest.mark.parametrize("bad", ["hypercube", 3], ids=["unknown-name", "not-callable"])
def test_bad_topology_names(bad):
    with pytest.raises((ValueError, TypeError), match="topology must be"):
        GossipGraph(bad, 4)


def test_not_strongly_connected_custom_topology_is_refused():
    def two_islands(rank, size, step):
        return [rank ^ 1]  # 0<->1 and 2<->3, never across

    with pytest.raises(ValueError, match="not strongly connected"):
        GossipGraph(two_islands, 4)
    with pytest.raises(ValueError, match="not strongly connected"):
        GossipGraph(two_islands, 4, undirected=True)

    def one_way_chain(rank, size, step):
        return [rank + 1] if rank + 1 < size else [rank - 1]  # nobody reaches back to rank 0 from 2

    with pytest.raises(ValueError, match="not strongly connected"):
        GossipGraph(one_way_chain, 3)


@pytest.mark.parametrize(
    "peers", [[0], [5], [1, 1], []], ids=["self", "out-of-range", "duplicate", "empty"]
)
def test_invalid_custom_peers_are_refused(peers):
    with pytest.raises(ValueError, match="out-peers"):
        GossipGraph(lambda rank, size, step: peers if rank == 0 else [0], 4)


@pytest.mark.parametrize(
    "p,err",
    [(0, ValueError), (3, ValueError), (True, TypeError), (1.0, TypeError)],
    ids=["zero", "too-many", "bool", "float"],
)
def test_bad_peers_per_step(p, err):
    with pytest.raises(err, match="peers_per_step"):
        GossipGraph("exponential", 4, peers_per_step=p)  # 4 workers: hops 1, 2 only


def test_custom_graph_is_computed_once_per_step():
    calls = []

    def spy(rank, size, step):
        calls.append(step)
        return [(rank + 1) % size]

    g = GossipGraph(spy, 3)
    calls.clear()
    for k in (0, 0, 1, 1, 1):
        g.graph(k)
        g.in_peers(0, k)
    assert calls == [0, 0, 0, 1, 1, 1]  # each rank's out-peers, once per new step
