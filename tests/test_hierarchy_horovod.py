"""worker='node' for real: 4 processes as 2 emulated nodes under horovodrun --gloo.

`-H localhost:2,127.0.0.1:2` makes Horovod's Gloo launcher treat the two names as two hosts
(ranks 0,1 on cross_rank 0; ranks 2,3 on cross_rank 1), verified in the test itself. Under
--mpi OpenMPI sees one host, so this layout is only emulated with Gloo. One launch runs every
case in turn (one start-up of 4 processes instead of one per case); each case is checked before
the test fails, so one failure does not hide the others.
"""

import os

import pytest
import torch

from hierarchy_cases import CASES, flat_reference
from horovod_launch import horovodrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "hierarchy_worker.py")
pytestmark = pytest.mark.horovod


def _problems(res: list[dict], case: str) -> list[str]:
    """What is wrong with one case's records of the 4 ranks (empty: nothing)."""
    problems = []
    if [r["layout"] for r in res] != [(0, 0), (0, 1), (1, 0), (1, 1)]:
        problems.append(f"{case}: the emulated layout is not 2 nodes x 2")
    # Each communicator gathers over its own process set: the node's ranks, the peers across nodes.
    if [r["node_gather"] for r in res] != [[0, 1], [0, 1], [2, 3], [2, 3]]:
        problems.append(f"{case}: node gathers {[r['node_gather'] for r in res]}")
    if [r["cross_gather"] for r in res] != [[0, 2], [1, 3], [0, 2], [1, 3]]:
        problems.append(f"{case}: cross-node gathers {[r['cross_gather'] for r in res]}")
    want_exchange = "hierarchical" if case.endswith("hierarchical") else "plain"
    if [r["exchange"] for r in res] != [want_exchange] * 4:
        problems.append(f"{case}: ran the exchanges {[r['exchange'] for r in res]}")
    problems += [
        f"{case}: node {node} differs at step {k}"
        for node in ((0, 1), (2, 3))
        for k in range(7)
        if not all(map(torch.equal, res[node[0]]["steps"][k], res[node[1]]["steps"][k]))
    ]
    want = flat_reference(case)
    for n, node in enumerate(((0, 1), (2, 3))):
        try:
            for x, y in zip(res[node[0]]["steps"][-1], want[n]):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            problems.append(f"{case}: node {n} differs from the flat reference: {e}")
    return problems


def test_two_emulated_nodes(tmp_path):
    horovodrun(4, "gloo", [WORKER, str(tmp_path), ",".join(CASES)], hosts="localhost:2,127.0.0.1:2")
    problems = []
    for case in CASES:
        res = [torch.load(tmp_path / f"{case}.{r}.pt", weights_only=False) for r in range(4)]
        problems += _problems(res, case)
    assert not problems, problems
