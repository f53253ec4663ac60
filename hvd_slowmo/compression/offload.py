"""A background thread for the codec's work, so that an overlapped exact average hides it.

A compressed exact average (SlowMo's outer step, arXiv 1910.00643, with a codec) is arithmetic
around collectives: the pseudo-gradient ``anchor - parameters``, the error feedback, the encode,
then (after the wire) the decode, the sum, the requantize of a dense codec's reduced chunk and
the final decode. :class:`CodecThread` runs each average's whole sequence as one job on a thread
of the exchange's own, the jobs one after the other in the order they were submitted; the
training thread only submits (after its snapshot) and, at the landing, copies the results.
``overlap=d`` then hides the codec's CPU time as it hides the wire.

Which transports allow it is :attr:`hvd_slowmo.comm.base.Communicator.collectives_any_thread`:
the job's collectives are started from this thread while the training thread starts others, so
the transport must pair collectives by name (Horovod, the thread workers) or give them an order
of their own (the MPI communicator's all-to-all and all-gather lanes). The arithmetic is the same
operations on the same tensors as on the training thread, so the results are the same bits.
"""

import contextlib
import threading
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from ..comm.base import ByteCounter
from ..comm.serial import SerialRunner

__all__ = ["CodecJob", "CodecThread", "Scratch"]


class CodecJob:
    """One job of a :class:`CodecThread`: ``done()`` never blocks, ``wait()`` returns the job's
    result or raises its error.

    Args:
        fn: the work; its return value is the result.
    """

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn: Callable[[], Any] | None = fn
        self._finished = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the work (on the codec thread) and wake the waiter."""
        fn, self._fn = self._fn, None
        try:
            assert fn is not None
            self._result = fn()
        except BaseException as e:  # handed to the waiting caller
            self._error = e
        self._finished.set()

    def done(self) -> bool:
        """True once :meth:`wait` would return at once."""
        return self._finished.is_set()

    def wait(self) -> Any:
        """Block until the job has run; its result.

        The job's collectives have the transport's deadlines, so a job whose peers never come
        ends with their ``CollectiveTimeout``, raised here.

        Raises:
            BaseException: what the job raised, itself (a ``CollectiveTimeout`` stays one).
        """
        self._finished.wait()
        if self._error is not None:
            raise self._error
        return self._result


class Scratch:
    """Buffers for work that runs one piece at a time (a :class:`CodecThread`'s jobs, or
    the averages started on the training thread), one per role and device: each user takes a
    buffer and is done with it before the next one takes it, so every fragment's average shares
    one, of the largest fragment's size, instead of keeping one of its own (the buffers of all
    fragments together were a copy of the model per role)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def take(
        self, role: str, numel: int, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The first ``numel`` elements of the ``role`` buffer on ``device`` (made, or made
        larger, the first time a size needs it; its contents are whatever the last user left).

        Args:
            role: what the buffer is for (the pseudo-gradient, a sum, the packets sent).
            numel: the elements needed.
            device: where.
            dtype: the elements' type (float32; uint8 for packets).
        """
        key = (role, device, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The buffers kept (for :func:`hvd_slowmo.memory.held_bytes`)."""
        return list(self._buffers.values())


class CodecThread:
    """Runs jobs on one background thread, one after another, in submission order.

    One job at a time keeps the collectives of successive averages in one order on every
    worker (each job starts and finishes its own), and an average in flight never waits for a
    later one; on a shared link the wire is one after the other anyway.

    Args:
        counter: the byte counter of the jobs' communicator: a job submitted inside
            :meth:`~hvd_slowmo.comm.base.Communicator.uncounted` runs uncounted too (the pause
            is per thread).

    Attributes:
        scratch: the buffers its jobs share (:class:`Scratch`): one job at a time.
    """

    def __init__(self, counter: ByteCounter) -> None:
        self._counter = counter
        self._runner = SerialRunner("hvd_slowmo-codec")
        self.scratch = Scratch()

    def submit(
        self, fn: Callable[[], Any], devices: AbstractSet[torch.device] = frozenset()
    ) -> CodecJob:
        """Queue ``fn`` to run on the codec thread; never blocks.

        Args:
            fn: the work.
            devices: CUDA devices whose current streams hold the kernels that made ``fn``'s
                inputs: the job waits for them (an event on each) before it runs, and
                synchronizes its own work there before its result is handed over.
        """
        counting = self._counter.counting
        events = {}
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events[device] = event

        def work() -> Any:
            for device, event in events.items():
                torch.cuda.current_stream(device).wait_event(event)
            with contextlib.nullcontext() if counting else self._counter.paused():
                result = fn()
            for device in events:
                torch.cuda.current_stream(device).synchronize()
            return result

        job = CodecJob(work)
        self._runner.submit(job)
        return job
