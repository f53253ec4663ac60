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
    """Streaming SlowMo with the sparse codec (:func:`helpers.train_flushed`): 2 fragments,
    ``overlap=1``, eager ``"local"``, decaying error feedback. Shared with the in-process test,
    which runs it on thread workers. Returns the model's state and the anchor."""
    from helpers import train_flushed

    codec = SparseCodec(density=0.2, bits=2, chunk=16, ef_decay=0.9)
    return train_flushed(
        model, rank, communicator, overlap=1, fragments=2, eager="local", codec=codec,
        error_feedback=True,
    )  # fmt: skip


#: The codecs of :func:`pseudo_gradient_rounds`: the sparse one and a dense one (int8).
ROUND_CODECS = {
    "sparse": SparseCodec(density=0.2, bits=2, chunk=16, ef_decay=0.9),
    "int8": "int8",
}


def pseudo_gradient_rounds(comm, codec) -> dict:
    """Three outer steps of :class:`~hvd_slowmo.compression.averager.PseudoGradientAverage`
    with error feedback, over two fragments of three tensors (the first fragment's parameters
    not consecutive), each fragment with its own average (its own residual) on one shared codec
    thread, each started, polled and waited as an overlapped outer step does: on a transport
    with ``collectives_any_thread`` the codec's work runs on the codec thread. Shared with the
    in-process tests. Returns the parameters, the fragments' residuals (concatenated), the
    bytes sent and whether the codec thread ran."""
    from hvd_slowmo.compression.averager import PseudoGradientAverage
    from hvd_slowmo.compression.offload import CodecThread

    thread = CodecThread(comm.counter)
    split = ([0, 2], [1])
    averages = [PseudoGradientAverage(comm, codec, True, thread) for _ in split]
    g = torch.Generator().manual_seed(comm.rank)
    anchor = [torch.linspace(-1, 1, 40).view(5, 8), torch.ones(70), torch.zeros(3, 11)]
    before = comm.bytes_sent
    for step in range(3):
        for average, indices in zip(averages, split):
            params = [anchor[j] + 0.1 * torch.randn(anchor[j].shape, generator=g) for j in indices]
            mine = [anchor[j] for j in indices]
            pending = average.start(params, mine, f"rounds.{step}.{indices[0]}")
            deadline = time.monotonic() + 60
            while not pending.done():  # completes by polling, as an overlapped outer step
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {comm.rank}: step {step} never completed")
                time.sleep(0.001)
            pending.wait()
            for j, p in zip(indices, params):
                anchor[j] = p
    return {
        "params": [a.clone() for a in anchor],
        "residual": torch.cat([a.residual for a in averages]),
        "bytes": comm.bytes_sent - before,
        "offloaded": averages[0].thread is not None,
    }


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
    for transport, comm in comms.items():
        for name, codec in ROUND_CODECS.items():
            results[("rounds", transport, name)] = pseudo_gradient_rounds(comm, codec)
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
