"""AR-SGD's bucketed gradient average under horovodrun --gloo, against the hand-written
reference of tests/grad_average_run.py: accumulation, clipping, unused parameters,
``zero_grad(set_to_none=False)``, fp16 compression and ``worker="node"``.

With 2 ranks a sum has one order, so Horovod's average equals the reference bitwise. With 3,
Gloo's ring sums each element in an order set by its offset in the fused buffer, so buckets may
round differently from one grouped average: the ranks still agree bitwise, and the result is
within rounding of the reference.
"""

import os

import grad_average_run as run
import pytest
import torch

from horovod_launch import horovodrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "grad_bucket_worker.py")
pytestmark = pytest.mark.horovod


def load(tmp_path, np_):
    return [torch.load(tmp_path / f"buckets.{r}.pt", weights_only=False) for r in range(np_)]


def compare(got, want, exact, what):
    for key in ("grads", "params"):
        for k, (a, b) in enumerate(zip(got[key], want[key])):
            for i, (x, y) in enumerate(zip(a, b)):
                if exact:
                    assert torch.equal(x, y), f"{what}: {key} {i} at step {k} differs"
                else:
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=what)


def assert_ranks_equal(ranks, key):
    for r, res in enumerate(ranks[1:], 1):
        compare(res[key], ranks[0][key], True, f"{key}: rank {r} vs rank 0")


@pytest.mark.parametrize("np_", [2, 3])
def test_buckets_equal_the_reference(tmp_path, np_):
    horovodrun(np_, "gloo", [WORKER, str(tmp_path)], timeout=480)
    ranks = load(tmp_path, np_)
    for case in run.CASES:
        want = run.reference(case, np_)
        for key in (case, (case, "one bucket"), (case, "default")):
            assert_ranks_equal(ranks, key)
            compare(ranks[0][key], want, np_ == 2, f"{key}")
        assert ranks[0][(case, "default buckets")] == len(list(run.Net().parameters()))
    assert_ranks_equal(ranks, ("plain", "fp16"))
    fp16 = ranks[0][("plain", "fp16")]
    for a, b in zip(fp16["params"][-1], run.reference("plain", np_)["params"][-1]):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)  # half-precision gradients


def test_node_workers(tmp_path):
    horovodrun(
        4, "gloo", [WORKER, str(tmp_path), "node"], hosts="localhost:2,127.0.0.1:2", timeout=480
    )
    ranks = load(tmp_path, 4)
    assert [r["layout"] for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for case in run.NODE_CASES:
        assert_ranks_equal(ranks, case)
        # Two ranks per level: each sum has one order, so this is bitwise too.
        compare(ranks[0][case], run.reference(case, 4, nodes=[[0, 1], [2, 3]]), True, case)
