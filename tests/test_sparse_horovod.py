"""The sparse average under horovodrun (Gloo at 2 and 3 ranks, MPI at 3) and torchrun (Gloo, 3
ranks): equal bit for bit to the hand-written reference, identical on every rank, the
reference's bytes on the wire; the optimizer (fragments, overlap, eager "local") equal to the
same run on thread workers."""

import os
import sys

import pytest
import torch
from reference_sparse import sparse_mean as reference_mean
from reference_sparse import vector

from horovod_launch import horovodrun
from reference import make_model
from torchrun_launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "sparse_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))  # the worker's CASES and train_sparse
LAUNCHES = [(2, "gloo"), (3, "gloo"), (3, "mpi")]


@pytest.mark.horovod
@pytest.mark.parametrize("np_,controller", LAUNCHES, ids=[f"np{n}-{c}" for n, c in LAUNCHES])
def test_equals_reference_on_every_rank(tmp_path, np_, controller):
    horovodrun(np_, controller, [WORKER, str(tmp_path)], timeout=480)
    want = {"horovod", "horovod-polled"} | ({"mpi"} if controller == "mpi" else set())
    check_launch(tmp_path, np_, want)


@pytest.mark.torchdist
@pytest.mark.timeout(900)
def test_torch_distributed_equals_reference_on_every_rank(tmp_path):
    torchrun(3, [WORKER, str(tmp_path), "torch"])
    check_launch(tmp_path, 3, {"torch", "torch-polled"})


def check_launch(tmp_path, np_: int, want_transports: set[str]) -> None:
    """Check the files of one launch of the worker."""
    from sparse_worker import CASES, train_sparse

    from hvd_slowmo.comm.local import run_threads

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(np_)]
    got = [r.pop("optimizer") for r in ranks]
    models = [make_model() for _ in range(np_)]
    want = run_threads(np_, lambda comm: train_sparse(models[comm.rank], comm.rank, comm))
    for rank, (g, w) in enumerate(zip(got, want)):
        for key in w:
            assert torch.equal(g[key], w[key]), f"optimizer run, rank {rank}: {key} differs"
            if key.startswith("anchor."):
                assert torch.equal(g[key], got[0][key]), f"rank {rank}: anchor differs"
    check_rounds(ranks, np_)
    transports = {key[0] for key in ranks[0]}
    assert transports == want_transports
    for (transport, case), (first, _, _) in ranks[0].items():
        n, density, bits, chunk, feedback, decay = CASES[case]
        vectors = [vector(r, n) for r in range(np_)]
        residuals = [0.1 * vector(r, n, seed=1) for r in range(np_)] if feedback else None
        want_mean, want_residuals, want_bytes = reference_mean(
            vectors, density, bits, chunk, residuals, decay
        )
        for rank, result in enumerate(ranks):
            average, residual, nbytes = result[(transport, case)]
            where = f"{transport} {case} rank {rank}"
            assert torch.equal(average, want_mean[rank]), f"{where}: differs from the reference"
            assert torch.equal(average, first), f"{where}: differs from rank 0"
            assert nbytes == want_bytes[rank], f"{where}: {nbytes} bytes, want {want_bytes}"
            if feedback:
                assert torch.equal(residual, want_residuals[rank]), f"{where}: residual"


def check_rounds(ranks: list[dict], np_: int) -> None:
    """The pseudo-gradient rounds of every transport (popped from ``ranks``): their codec's
    work ran on the codec thread (not under torchrun: torch.distributed has one collective
    order per process group), and they equal the same rounds on thread workers with the codec
    on the training thread, bit for bit."""
    from sparse_worker import ROUND_CODECS, pseudo_gradient_rounds

    from hvd_slowmo.comm.local import ThreadCommunicator, run_threads

    class Inline(ThreadCommunicator):
        collectives_any_thread = False

    keys = [k for k in ranks[0] if k[0] == "rounds"]
    assert keys, "the worker ran no rounds"
    for key in keys:
        _, transport, name = key
        codec = ROUND_CODECS[name]
        want = run_threads(
            np_, lambda comm, c=codec: pseudo_gradient_rounds(Inline(comm.world, comm.rank), c)
        )
        for rank, result in enumerate(ranks):
            got = result.pop(key)
            where = f"{transport} {name} rank {rank}"
            assert got["offloaded"] == (transport != "torch"), where
            assert not want[rank]["offloaded"]
            for a, b in zip(got["params"], want[rank]["params"]):
                assert torch.equal(a, b), f"{where}: parameters differ from the inline run"
            assert torch.equal(got["residual"], want[rank]["residual"]), f"{where}: residual"
            assert got["bytes"] == want[rank]["bytes"], f"{where}: bytes"
