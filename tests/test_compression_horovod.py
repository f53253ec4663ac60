"""The compressed average under horovodrun (Gloo, MPI) and torchrun (torch.distributed over
Gloo: its all-to-all path): equal bit for bit to the hand-written reference, identical on every
rank, the reference's bytes on the wire; the optimizer's run equal to the thread workers'."""

import os
import sys

import pytest
import torch
from reference_compression import reference_compressed_mean, worker_vector

from horovod_launch import horovodrun
from reference import make_model
from torchrun_launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "compression_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))  # the worker's train_compressed
LAUNCHES = [(3, "gloo"), (3, "mpi")]


def check_optimizer_runs(got: list) -> None:
    """The Horovod run (overlapped, polled) equals the same run on thread workers, bit for bit."""
    from compression_worker import train_compressed

    from hvd_slowmo.comm.local import run_threads

    models = [make_model() for _ in got]
    want = run_threads(len(got), lambda comm: train_compressed(models[comm.rank], comm.rank, comm))
    for rank, (g, w) in enumerate(zip(got, want)):
        for key in w:
            assert torch.equal(g[key], w[key]), f"optimizer run, rank {rank}: {key} differs"


@pytest.mark.horovod
@pytest.mark.parametrize("np_,controller", LAUNCHES, ids=[f"np{n}-{c}" for n, c in LAUNCHES])
def test_equals_reference_on_every_rank(tmp_path, np_, controller):
    horovodrun(np_, controller, [WORKER, str(tmp_path)], timeout=480)
    want = {"horovod", "horovod-polled", "horovod-tiny"}
    check_launch(tmp_path, np_, want | ({"mpi"} if controller == "mpi" else set()))


@pytest.mark.torchdist
@pytest.mark.timeout(600)
def test_torch_distributed_equals_reference_on_every_rank(tmp_path):
    """Every codec's all-to-all and all-gather over torch.distributed at 3 ranks (uneven chunks,
    with and without error feedback, polled, empty chunks) against the hand-written reference,
    and the optimizer's int8 run (error feedback, ``overlap=2``) against the thread workers'."""
    torchrun(3, [WORKER, str(tmp_path), "torch"], timeout=480)
    check_launch(tmp_path, 3, {"torch", "torch-polled", "torch-tiny"})


def check_launch(out, np_: int, want_transports: set[str]) -> None:
    """Check the files of one launch of the worker (``out``: its output folder)."""
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(np_)]
    check_optimizer_runs([r.pop("optimizer") for r in ranks])
    transports = {key[0] for key in ranks[0]}
    assert transports == want_transports
    for (transport, codec, feedback), (first, _, _) in ranks[0].items():
        n = first.numel()
        assert n % np_, "the chunks should be uneven"
        vectors = [worker_vector(r, n) for r in range(np_)]
        residuals = [0.1 * worker_vector(r, n, seed=1) for r in range(np_)] if feedback else None
        want, want_residuals, want_bytes = reference_compressed_mean(vectors, codec, 256, residuals)
        for rank, got in enumerate(ranks):
            average, residual, nbytes = got[(transport, codec, feedback)]
            where = f"{transport} {codec} feedback={feedback} rank {rank}"
            assert torch.equal(average, want[rank]), f"{where}: differs from the reference"
            assert torch.equal(average, first), f"{where}: differs from rank 0"
            if not transport.endswith("-tiny"):
                assert nbytes == want_bytes[rank], f"{where}: {nbytes} bytes, want {want_bytes}"
            if feedback:
                assert torch.equal(residual, want_residuals[rank]), f"{where}: residual"
