"""The compressed average under horovodrun; each rank writes ``OUT/rank{r}.pt``.

Launched by tests/test_compression_horovod.py::

    horovodrun -np 3 --gloo python tests/workers/compression_worker.py OUT
    horovodrun -np 3 --mpi  python tests/workers/compression_worker.py OUT
    torchrun --nproc-per-node 3 tests/workers/compression_worker.py OUT torch

For every codec, with and without error feedback, over the Horovod communicator (and, under an
MPI launch, the MPI communicator too; under torchrun, the torch.distributed communicator over
Gloo alone, whose ``all_to_all_single`` carries the first collective): ``{(transport, codec,
feedback): (average, residual, bytes sent)}`` for the inputs of
tests/reference_compression.py's ``worker_vector``. Transport ``"<engine>-polled"``: the average
started and polled to completion in the background
(:class:`~hvd_slowmo.compression.PendingMean`, as an overlapped outer step runs it);
``"<engine>-tiny"``: a vector shorter than the number of workers (empty chunks). Under
``"optimizer"``: the final model of :func:`train_compressed` (int8 with error feedback and
``overlap=2``, the asynchronous collectives polled between steps).
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from reference_compression import worker_vector

from hvd_slowmo.compression import CODECS, PendingMean, compressed_mean


def vector_length(m: int) -> int:
    """Uneven chunks (``n % m != 0`` for m > 1) whose blocks are cut short at chunk ends."""
    return 3 * 256 * m + 5 * m + 1


def train_compressed(model, rank: int, communicator=None):
    """SlowMo with int8 pseudo-gradients, error feedback and ``overlap=2``
    (:func:`helpers.train_flushed`). Shared with the in-process test, which runs it on thread
    workers."""
    from helpers import train_flushed

    return train_flushed(model, rank, communicator, overlap=2, codec="int8", error_feedback=True)


def communicators(engine: str) -> dict:
    """The transports of one launch, by name: ``"torch"`` alone under torchrun; ``"horovod"``
    (and ``"mpi"`` under an MPI controller) under horovodrun."""
    if engine == "torch":
        import torch.distributed as dist

        from hvd_slowmo.comm.torchdist import TorchDistCommunicator

        dist.init_process_group("gloo")
        return {"torch": TorchDistCommunicator()}
    import horovod.torch as hvd

    from hvd_slowmo.comm.horovod import HorovodCommunicator
    from hvd_slowmo.comm.mpi import MPICommunicator

    hvd.init()
    comms = {"horovod": HorovodCommunicator()}
    if hvd.mpi_enabled():
        comms["mpi"] = MPICommunicator.for_horovod(comms["horovod"])
    return comms


def main(out: str, engine: str) -> None:
    comms = communicators(engine)
    comm = next(iter(comms.values()))
    first, rank = next(iter(comms)), comm.rank
    n = vector_length(comm.size)
    results = {}
    for transport, each in comms.items():
        for codec in CODECS:
            for feedback in (False, True):
                residual = 0.1 * worker_vector(rank, n, seed=1) if feedback else None
                before = each.bytes_sent
                average = compressed_mean(
                    each, worker_vector(rank, n), codec, f"cmp.{codec}.{feedback}", residual
                )
                results[(transport, codec, feedback)] = (
                    average,
                    residual,
                    each.bytes_sent - before,
                )
    tiny = comm.size - 1  # fewer elements than workers: empty chunks and messages
    results[(f"{first}-tiny", "int8", False)] = (
        compressed_mean(comm, worker_vector(rank, tiny), "int8", "cmp.tiny"),
        None,
        0,
    )
    for codec in CODECS:
        before = comm.bytes_sent
        pending = PendingMean(comm, worker_vector(rank, n), codec, f"cmp.polled.{codec}")
        deadline = time.monotonic() + 60
        while not pending.done():  # both collectives complete without a blocking wait
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: {codec} never completed by polling")
            time.sleep(0.001)
        results[(f"{first}-polled", codec, False)] = (
            pending.wait(),
            None,
            comm.bytes_sent - before,
        )
    from reference import make_model

    # Under horovodrun the optimizer picks its own Horovod communicator, as a user's would.
    results["optimizer"] = train_compressed(make_model(), rank, comm if engine == "torch" else None)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "horovod")
