"""worker='node' for real: 4 processes as 2 emulated nodes under horovodrun --gloo.

`-H localhost:2,127.0.0.1:2` makes Horovod's Gloo launcher treat the two names as two hosts
(ranks 0,1 on cross_rank 0; ranks 2,3 on cross_rank 1), verified in the test itself. Under
--mpi OpenMPI sees one host, so this layout is only emulated with Gloo.
"""

import os

import pytest
import torch

from hierarchy_cases import flat_reference
from horovod_launch import horovodrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "hierarchy_worker.py")
pytestmark = pytest.mark.horovod


@pytest.mark.parametrize(
    "case", ["localsgd-slowmo", "sgp-slowmo", "allreduce", "localsgd-hierarchical"]
)
def test_two_emulated_nodes(tmp_path, case):
    horovodrun(4, "gloo", [WORKER, str(tmp_path), case], hosts="localhost:2,127.0.0.1:2")
    res = [torch.load(tmp_path / f"{case}.{r}.pt", weights_only=False) for r in range(4)]
    assert [r["layout"] for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)], (
        "the emulated layout is not 2 nodes x 2"
    )
    # Each communicator gathers over its own process set: the node's ranks, the peers across nodes.
    assert [r["node_gather"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["cross_gather"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    want_exchange = "hierarchical" if case.endswith("hierarchical") else "plain"
    assert [r["exchange"] for r in res] == [want_exchange] * 4
    for node in ((0, 1), (2, 3)):
        for k in range(7):
            a, b = res[node[0]]["steps"][k], res[node[1]]["steps"][k]
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"node {node} differs at step {k}"
    want = flat_reference(case)
    for n, node in enumerate(((0, 1), (2, 3))):
        for x, y in zip(res[node[0]]["steps"][-1], want[n]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
