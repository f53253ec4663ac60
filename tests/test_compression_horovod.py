"""The compressed average under horovodrun (Gloo, MPI): equal bit for bit to the hand-written
reference, identical on every rank, the reference's bytes on the wire."""

import os

import pytest
import torch
from reference_compression import reference_compressed_mean
from test_compression import worker_vector

from horovod_launch import horovodrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "compression_worker.py")
pytestmark = pytest.mark.horovod
LAUNCHES = [(3, "gloo"), (3, "mpi")]


@pytest.mark.parametrize("np_,controller", LAUNCHES, ids=[f"np{n}-{c}" for n, c in LAUNCHES])
def test_equals_reference_on_every_rank(tmp_path, np_, controller):
    horovodrun(np_, controller, [WORKER, str(tmp_path)])
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(np_)]
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
