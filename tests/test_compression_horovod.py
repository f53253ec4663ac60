"""The compressed average under horovodrun (Gloo, MPI): equal bit for bit to the hand-written
reference, identical on every rank, the reference's bytes on the wire."""

import os
import sys

import pytest
import torch
from reference_compression import reference_compressed_mean, worker_vector

from horovod_launch import horovodrun
from reference import make_model

WORKER = os.path.join(os.path.dirname(__file__), "workers", "compression_worker.py")
sys.path.insert(0, os.path.dirname(WORKER))  # the worker's train_compressed
pytestmark = pytest.mark.horovod
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


@pytest.mark.parametrize("np_,controller", LAUNCHES, ids=[f"np{n}-{c}" for n, c in LAUNCHES])
def test_equals_reference_on_every_rank(tmp_path, np_, controller):
    horovodrun(np_, controller, [WORKER, str(tmp_path)], timeout=480)
    check_launch(tmp_path, np_, controller)


def check_launch(out, np_: int, controller: str) -> None:
    """Check the files of one launch of the worker (``out``: its output folder)."""
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(np_)]
    check_optimizer_runs([r.pop("optimizer") for r in ranks])
    transports = {key[0] for key in ranks[0]}
    want_transports = {"horovod", "horovod-polled", "horovod-tiny"}
    assert transports == want_transports | ({"mpi"} if controller == "mpi" else set())
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
            if transport != "horovod-tiny":
                assert nbytes == want_bytes[rank], f"{where}: {nbytes} bytes, want {want_bytes}"
            if feedback:
                assert torch.equal(residual, want_residuals[rank]), f"{where}: residual"
