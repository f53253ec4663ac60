"""One background thread that runs jobs in submission order, and ends before the interpreter does.

The thread workers' progress thread (:class:`~hvd_slowmo.comm.local.ThreadWorld`) and the codec
thread (:class:`~hvd_slowmo.compression.offload.CodecThread`) are both this: a queue served by
one daemon thread, started on demand, which ends after :data:`IDLE_SECONDS` without work (so
short-lived optimizers, as in the tests, leave no threads behind).

Why an exit hook: a daemon thread still inside a torch operation when the interpreter finalizes
is stopped with ``pthread_exit`` as soon as it asks for the GIL back, and that unwinds through
torch's C++ frames, which ``std::terminate`` the whole process ("terminate called without an
active exception", exit code 134) after the program had finished and passed. So an ``atexit``
hook wakes every runner, lets the jobs already queued run, and joins the threads (bounded by
:data:`EXIT_SECONDS`) before finalization starts; :func:`join_at_exit` adds other such threads
(torch.distributed's waits for Gloo sends).
"""

import atexit
import collections
import gc
import threading
import time
import weakref
from typing import Protocol

__all__ = ["EXIT_SECONDS", "IDLE_SECONDS", "Job", "SerialRunner", "join_at_exit"]

#: Seconds an idle runner's thread lives; the next job starts a new one.
IDLE_SECONDS = 1.0

#: Seconds the exit hook waits, in all, for the runners' threads to finish their queued jobs. A
#: job stuck longer (a collective whose peers never come) is left to the interpreter, as before.
EXIT_SECONDS = 30.0


class Job(Protocol):
    """What a :class:`SerialRunner` runs."""

    def run(self) -> None:
        """Do the work; must not raise (hand errors to the job's waiter instead)."""


_runners: "weakref.WeakSet[SerialRunner]" = weakref.WeakSet()
_threads: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_exiting = False


def join_at_exit(thread: threading.Thread) -> None:
    """Have the exit hook wait for ``thread`` too (a daemon thread that runs one bounded task,
    such as the wait for a transport's non-blocking sends).

    Args:
        thread: a started thread; forgotten once it has ended.
    """
    _threads.add(thread)


class SerialRunner:
    """Runs :class:`Job` objects one after another, in submission order, on one background thread.

    Args:
        name: the thread's name (shown by debuggers and ``threading.enumerate()``).
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        _runners.add(self)

    def submit(self, job: Job) -> None:
        """Queue ``job``; never blocks.

        Args:
            job: the work, run after every job submitted before it.
        """
        with self._cv:
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def drain(self) -> list[Job]:
        """Remove and return the jobs not yet started (to fail them instead)."""
        with self._cv:
            jobs = list(self._jobs)
            self._jobs.clear()
        return jobs

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._jobs and not _exiting:
                    self._cv.wait(IDLE_SECONDS)
                if not self._jobs:
                    self._thread = None  # submit() starts a new thread for the next job
                    return
                job = self._jobs.popleft()
            job.run()

    def _wake_for_exit(self) -> threading.Thread | None:
        with self._cv:
            self._cv.notify_all()
            return self._thread


@atexit.register
def _finish_before_exit() -> None:
    """Let every runner's queued jobs finish and its thread end, then free what only reference
    cycles still hold (optimizers, their pending collectives and the tensors those hold), all
    before finalization: a collective's handle freed during finalization releases its tensors
    from a transport's own thread (Gloo's), which then asks for the GIL and is stopped, and
    ``std::terminate`` aborts the finished process."""
    global _exiting
    _exiting = True
    threads = [t for t in (r._wake_for_exit() for r in list(_runners)) if t is not None]
    threads += list(_threads)
    deadline = time.monotonic() + EXIT_SECONDS
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    gc.collect()
