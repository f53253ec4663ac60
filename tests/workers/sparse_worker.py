"""The sparse average under horovodrun; each rank writes ``OUT/rank{r}.pt``.

Launched by tests/test_sparse_horovod.py::

    horovodrun -np 3 --gloo python tests/workers/sparse_worker.py OUT
    torchrun --nproc-per-node 3 tests/workers/sparse_worker.py OUT torch

For every case of ``CASES`` over the Horovod communicator (and, under an MPI launch, the MPI
communicator too; under torchrun, the torch.distributed communicator over Gloo alone):
``{(transport, case): (average, residual, bytes sent)}`` for the inputs of
tests/test_sparse.py's ``vector``; transport ``"horovod-polled"``: the average started and
polled to completion (:class:`~hvd_slowmo.compression.PendingSparseMean`, as an overlapped
outer step runs it). Under ``"optimizer"``: :func:`train_sparse`'s final model and anchor.
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from reference_sparse import vector

from hvd_slowmo.compression import PendingSparseMean, SparseCodec, sparse_mean

#: name -> (n, density, bits, chunk, error feedback, decay): chunks cut short, 12-bit positions
CASES = {
    "b2-c64": (1001, 0.05, 2, 64, False, 1.0),
    "b2-c4096-feedback": (9001, 0.02, 2, 4096, True, 0.95),
    "b4-c100-feedback": (777, 0.1, 4, 100, True, 1.0),
    "b8-c7": (300, 0.3, 8, 7, False, 1.0),
}


def codec_of(case: str) -> SparseCodec:
    _, density, bits, chunk, _, decay = CASES[case]
    return SparseCodec(density=density, bits=bits, chunk=chunk, ef_decay=decay)


def train_sparse(model, rank: int, communicator=None):
    """Streaming SlowMo with the sparse codec: 2 fragments, ``overlap=1``, eager ``"local"``,
    decaying error feedback, 14 steps, flushed (no model buffers averaged: an allreduce of Gloo
    rounds differently from the threads). Shared with the in-process test, which runs it on
    thread workers. Returns the model's state and the anchor."""
    from hvd_slowmo import DistributedOptimizer

    from reference import loss_at, lr_at

    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        communicator=communicator,
        tau=4,
        overlap=1,
        fragments=2,
        eager="local",
        slow_momentum=0.5,
        compression=SparseCodec(density=0.2, bits=2, chunk=16, ef_decay=0.9),
        error_feedback=True,
    )
    for k in range(14):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()
    opt.flush()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({f"anchor.{i}": a.clone() for i, a in enumerate(opt.slow_state.anchor)})
    return state


def main(out: str, engine: str) -> None:
    if engine == "torch":
        import torch.distributed as dist

        from hvd_slowmo.comm.torchdist import TorchDistCommunicator

        dist.init_process_group("gloo")
        comms = {"torch": TorchDistCommunicator()}
        polled = "torch-polled"
    else:
        import horovod.torch as hvd

        from hvd_slowmo.comm.horovod import HorovodCommunicator
        from hvd_slowmo.comm.mpi import MPICommunicator

        hvd.init()
        comms = {"horovod": HorovodCommunicator()}
        if hvd.mpi_enabled():
            comms["mpi"] = MPICommunicator.for_horovod(comms["horovod"])
        polled = "horovod-polled"
    first = next(iter(comms.values()))
    rank = first.rank
    results = {}
    for transport, comm in comms.items():
        for case, (n, *_, feedback, _) in CASES.items():
            residual = 0.1 * vector(rank, n, seed=1) if feedback else None
            before = comm.bytes_sent
            average = sparse_mean(comm, vector(rank, n), codec_of(case), f"sparse.{case}", residual)
            results[(transport, case)] = (average, residual, comm.bytes_sent - before)
    comm = first
    for case, (n, *_, feedback, _) in CASES.items():
        residual = 0.1 * vector(rank, n, seed=1) if feedback else None
        before = comm.bytes_sent
        x = vector(rank, n)
        pending = PendingSparseMean(comm, x, codec_of(case), f"sparse.polled.{case}", residual)
        deadline = time.monotonic() + 60
        while not pending.done():  # completes without a blocking wait
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: {case} never completed by polling")
            time.sleep(0.001)
        results[(polled, case)] = (pending.wait(), residual, comm.bytes_sent - before)
    from reference import make_model

    results["optimizer"] = train_sparse(make_model(), rank, first)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "horovod")
