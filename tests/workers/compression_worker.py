"""The compressed average under horovodrun; each rank writes ``OUT/rank{r}.pt``.

Launched by tests/test_compression_horovod.py::

    horovodrun -np 3 --gloo python tests/workers/compression_worker.py OUT
    horovodrun -np 3 --mpi  python tests/workers/compression_worker.py OUT

For every codec, with and without error feedback, over the Horovod communicator (and, under an
MPI launch, the MPI communicator too): ``{(transport, codec, feedback): (average, residual,
bytes sent)}`` for the inputs of tests/reference_compression.py's ``worker_vector``. Transport
``"horovod-polled"``: the average started and polled to completion in the background
(:class:`~hvd_slowmo.compression.PendingMean`, as an overlapped outer step runs it);
``"horovod-tiny"``: a vector shorter than the number of workers (empty chunks). Under
``"optimizer"``: the final model of :func:`train_compressed` (int8 with error feedback and
``overlap=2``, Horovod's asynchronous collectives polled between steps).
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import horovod.torch as hvd
from reference_compression import worker_vector

from hvd_slowmo.comm.horovod import HorovodCommunicator
from hvd_slowmo.comm.mpi import MPICommunicator
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


def main(out: str) -> None:
    hvd.init()
    comms = {"horovod": HorovodCommunicator()}
    if hvd.mpi_enabled():
        comms["mpi"] = MPICommunicator.for_horovod(comms["horovod"])
    n = vector_length(hvd.size())
    results = {}
    for transport, comm in comms.items():
        for codec in CODECS:
            for feedback in (False, True):
                residual = 0.1 * worker_vector(hvd.rank(), n, seed=1) if feedback else None
                before = comm.bytes_sent
                average = compressed_mean(
                    comm, worker_vector(hvd.rank(), n), codec, f"cmp.{codec}.{feedback}", residual
                )
                results[(transport, codec, feedback)] = (
                    average,
                    residual,
                    comm.bytes_sent - before,
                )
    comm = comms["horovod"]
    tiny = hvd.size() - 1  # fewer elements than workers: empty chunks and messages
    results[("horovod-tiny", "int8", False)] = (
        compressed_mean(comm, worker_vector(hvd.rank(), tiny), "int8", "cmp.tiny"),
        None,
        0,
    )
    for codec in CODECS:
        before = comm.bytes_sent
        pending = PendingMean(comm, worker_vector(hvd.rank(), n), codec, f"cmp.polled.{codec}")
        deadline = time.monotonic() + 60
        while not pending.done():  # both collectives complete without a blocking wait
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {hvd.rank()}: {codec} never completed by polling")
            time.sleep(0.001)
        results[("horovod-polled", codec, False)] = (
            pending.wait(),
            None,
            comm.bytes_sent - before,
        )
    from reference import make_model

    results["optimizer"] = train_compressed(make_model(), hvd.rank())
    torch.save(results, os.path.join(out, f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
