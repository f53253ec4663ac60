"""Past eight workers, on thread workers: the exchanges at 16, 32 and 64 workers (fp32, int8,
the sparse all-gather, the scaling sparse exchange reduced at owners, and hierarchical = exact
inside a node of 4, a codec across nodes) equal their hand-written references bit for bit on
every rank, and every worker's byte counter equals the planner's formula from the codecs' packet
sizes (hvd_slowmo.plan)."""

import pytest
import torch
from reference_compression import chunk_bounds, reference_compressed_mean, worker_vector
from reference_sparse import encode as reference_sparse_encode
from reference_sparse import sparse_mean as reference_sparse_mean
from reference_sparse import vector as sparse_vector

from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import SparseCodec, compressed_mean, hierarchical_mean, sparse_mean
from hvd_slowmo.compression.means import mean_start
from hvd_slowmo.plan import Cluster, Setting, exchange_traffic

N = 2000  # uneven over 3, 16, 32 and 64 workers' chunks; one sparse chunk, cut short
PER_NODE = 4
SPARSE = SparseCodec()  # the planner's sparse setting: 2% of 4096, 2 bits
# The scaling exchange with chunks of 64: 32 chunks of N, so 16 and 32 workers own one or two,
# and at 64 half the owners have none. The planner's (chunks of 4096) runs for the bytes.
OWNERS = SparseCodec(density=0.05, bits=2, chunk=64, ef_decay=0.9, exchange="owners")
OWNERS_PLANNED = SparseCodec(exchange="owners")


def groups(m: int, per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """Nodes of ``per_node`` consecutive ranks, and the ranks of each local rank by node."""
    nodes = [list(range(s, s + per_node)) for s in range(0, m, per_node)]
    return nodes, [[node[lr] for node in nodes] for lr in range(per_node)]


def inputs(kind: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(vector, error-feedback residual) of a worker: the references' own inputs."""
    if kind == "sparse":
        return sparse_vector(rank, N), 0.1 * sparse_vector(rank, N, seed=1)
    return worker_vector(rank, N), 0.1 * worker_vector(rank, N, seed=1)


def run_exchanges(m: int) -> list[dict]:
    nodes, peers = groups(m, PER_NODE)

    def fn(comm):
        out = {}
        x = worker_vector(comm.rank, N)
        before = comm.bytes_sent
        comm.average_([x], "fp32")
        out["fp32"] = (x, None, comm.bytes_sent - before)
        for kind, codec in (("int8", "int8"), ("sparse", SPARSE)):
            v, residual = inputs(kind, comm.rank)
            before = comm.bytes_sent
            mean = (sparse_mean if kind == "sparse" else compressed_mean)(
                comm, v, codec, kind, residual
            )
            out[kind] = (mean, residual, comm.bytes_sent - before)
        for key, codec in (("owners", OWNERS), ("sparse-owners", OWNERS_PLANNED)):
            v, residual = inputs("sparse", comm.rank)
            before = comm.bytes_sent
            mean = mean_start(codec, comm, v, key, residual).wait()
            out[key] = (mean, residual, comm.bytes_sent - before)
        node = comm.world.split(nodes)[comm.rank]
        cross = comm.world.split(peers)[comm.rank]
        for kind, codec in (("int8", "int8"), ("sparse", SPARSE)):
            v, residual = inputs(kind, comm.rank)
            start, end = chunk_bounds(N, PER_NODE)[node.rank]
            mine = residual[start:end].clone()
            before = node.bytes_sent + cross.bytes_sent
            mean = hierarchical_mean(node, cross, v, codec, f"hier.{kind}", mine)
            out[f"hier {kind}"] = (mean, mine, node.bytes_sent + cross.bytes_sent - before)
        return out

    return run_threads(m, fn, timeout=300)


def reference_owner_mean(m: int) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Written from the description of the scaling exchange, with OWNERS' settings: regions of
    whole chunks (the chunks split over the workers as the exact average's shards), each
    worker's packet of each region of its decayed residual plus vector, the owner's sum of the
    decoded entries in rank order divided by m, encoded again; the average, the residuals and
    each worker's bytes (the region packets to the other owners, (m-1)/m of the reduced ones)."""
    c = OWNERS.chunk
    chunks = [b - a for a, b in chunk_bounds(-(-N // c), m)]
    bounds, start = [], 0
    for count in chunks:
        end = min(N, start + count * c)
        bounds.append((start, end))
        start = end
    given = [inputs("sparse", r) for r in range(m)]
    contributions = [v + 0.9 * e for v, e in given]
    packets = [
        [reference_sparse_encode(x[a:b], 0.05, 2, c) for a, b in bounds] for x in contributions
    ]
    residuals = [x - torch.cat([d for _, d in row]) for x, row in zip(contributions, packets)]
    means, reduced = [], []
    for j, (a, b) in enumerate(bounds):
        total = torch.zeros(b - a)
        for i in range(m):
            decoded = packets[i][j][1]
            for p in range(b - a):
                if decoded[p] != 0:  # as the all-gather reference: adding 0 changes nothing
                    total[p] = total[p] + decoded[p]
        packet, decoded = reference_sparse_encode(total / m, 0.05, 2, c)
        means.append(decoded)
        reduced.append(packet.numel())
    sent = [
        sum(packets[i][j][0].numel() for j in range(m) if j != i) + int((m - 1) / m * sum(reduced))
        for i in range(m)
    ]
    return torch.cat(means), residuals, sent


def reference_hierarchical(m: int, kind: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Written from the description: each node's mean of each shard (its ranks' shards added in
    rank order, divided by the node's size), then the codec's reference mean across nodes of
    each shard with each rank's residual, then the shards concatenated."""
    nodes, _ = groups(m, PER_NODE)
    given = [inputs(kind, r) for r in range(m)]
    bounds = chunk_bounds(N, PER_NODE)
    shards, residuals = [], [None] * m
    for local, (a, b) in enumerate(bounds):
        node_means = []
        for node in nodes:
            total = given[node[0]][0][a:b].clone()
            for r in node[1:]:
                total += given[r][0][a:b]
            node_means.append(total / PER_NODE)
        carried = [given[node[local]][1][a:b].clone() for node in nodes]
        if kind == "sparse":
            means, lost, _ = reference_sparse_mean(node_means, 0.02, 2, 4096, carried)
        else:
            means, lost, _ = reference_compressed_mean(node_means, "int8", 256, carried)
        shards.append(means[0])
        for node, residual in zip(nodes, lost):
            residuals[node[local]] = residual
    return torch.cat(shards), residuals


@pytest.mark.parametrize("m", [16, 32, 64])
def test_exchanges_at_scale_equal_references_and_the_planned_bytes(m):
    results = run_exchanges(m)
    cluster = Cluster(m, PER_NODE)
    for key in ("fp32", "int8", "sparse", "sparse-owners", "owners", "hier int8", "hier sparse"):
        first = results[0][key][0]
        for rank, r in enumerate(results):
            assert torch.equal(r[key][0], first), f"{key}: rank {rank} differs from rank 0"
        if key == "owners":  # its codec is not the planner's: checked against the reference
            continue
        codec = key.split()[-1]
        planned = exchange_traffic(Setting(codec, key.startswith("hier")), N, cluster).sent
        sent = [r[key][2] for r in results]
        assert max(sent) == planned, f"{key}: counted {max(sent)}, planned {planned}"
    # fp32: the exact mean (the thread communicator sums in rank order).
    total = worker_vector(0, N)
    for r in range(1, m):
        total += worker_vector(r, N)
    assert torch.equal(results[0]["fp32"][0], total / m)
    flat = {
        "int8": reference_compressed_mean(
            [inputs("int8", r)[0] for r in range(m)], "int8", 256,
            [inputs("int8", r)[1] for r in range(m)],
        ),
        "sparse": reference_sparse_mean(
            [inputs("sparse", r)[0] for r in range(m)], 0.02, 2, 4096,
            [inputs("sparse", r)[1] for r in range(m)],
        ),
    }  # fmt: skip
    for kind, (means, residuals, nbytes) in flat.items():
        for rank, r in enumerate(results):
            assert torch.equal(r[kind][0], means[rank]), f"{kind}: rank {rank} vs reference"
            assert torch.equal(r[kind][1], residuals[rank]), f"{kind}: rank {rank} residual"
            assert r[kind][2] == nbytes[rank], f"{kind}: rank {rank} bytes"
    mean, residuals, nbytes = reference_owner_mean(m)
    for rank, r in enumerate(results):
        assert torch.equal(r["owners"][0], mean), f"owners: rank {rank} vs reference"
        assert torch.equal(r["owners"][1], residuals[rank]), f"owners: rank {rank} residual"
        assert r["owners"][2] == nbytes[rank], f"owners: rank {rank} bytes"
    # The scaling exchange's bytes stay about two packets of the vector: at most a few region
    # paddings above the all-gather form's at two workers, far below it at m.
    owners_sent = max(r["sparse-owners"][2] for r in results)
    assert owners_sent < 2 * max(r["sparse"][2] for r in results) / (m - 1) + 8 * m
    for kind in ("int8", "sparse"):
        mean, residuals = reference_hierarchical(m, kind)
        for rank, r in enumerate(results):
            assert torch.equal(r[f"hier {kind}"][0], mean), f"hier {kind}: rank {rank}"
            assert torch.equal(r[f"hier {kind}"][1], residuals[rank]), f"hier {kind} residual"


def test_hierarchical_mean_refuses_a_residual_of_another_length():
    def fn(comm):
        nodes, peers = groups(4, 2)
        node = comm.world.split(nodes)[comm.rank]
        cross = comm.world.split(peers)[comm.rank]
        with pytest.raises(ValueError, match="residual must be float32 of this rank's shard"):
            hierarchical_mean(node, cross, torch.zeros(10), "int8", "h", torch.zeros(10))
        return True

    assert all(run_threads(4, fn))
