"""An in-process communicator: ``m`` workers as threads of one process, for fast exact tests.

Every collective is started and returns at once: the worker hands its input to the world and
gets a handle. The workers' collectives are paired by kind and name, as Horovod pairs them,
and a background progress thread per world (as Horovod's background loop per process) runs
each one once every worker has started it; the handle's ``wait()`` blocks until it has run.
So a start never waits for another worker: a gradient hook that starts an average returns even
when the other workers' hooks run later on the same thread (autograd's one CUDA device thread
serves every thread worker of a process). Blocking collectives are a start and a wait.

Averages are summed in rank order, once, and every worker copies the same result, so all
workers get bitwise identical results, as with a real allreduce. A wait lasts at most the
world's ``timeout`` and then raises :class:`~hvd_slowmo.comm.deadline.CollectiveTimeout` naming
the workers that never started the collective.
"""

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from .base import Communicator, PendingAverage, PendingExchange, PendingTensors, shard_range
from .deadline import CollectiveTimeout, collective_timeout, timeout_message
from .serial import SerialRunner

__all__ = ["ThreadWorld", "ThreadCommunicator", "WorldAborted", "run_threads"]

Reduce = Callable[[list[Any]], list[Any]]


class WorldAborted(RuntimeError):
    """A worker of the world failed, so the collectives it will never join fail too."""


def _settle(tensors: Sequence[Tensor]) -> None:
    """Wait for the CUDA kernels already queued on these tensors' current streams: the snapshot
    of a start (or a result) is then complete before another thread reads it on its own stream."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


class _Collective:
    """One collective of a world: every worker's input, then every worker's output.

    Args:
        seq: how many collectives of its kind and name each worker started before it.
        kind: which operation it is.
        reduce: maps the inputs, in rank order, to the outputs, in rank order; runs on the
            progress thread.
        size: the number of workers.
    """

    def __init__(self, seq: int, kind: str, reduce: Reduce, size: int) -> None:
        self.seq, self.kind, self.reduce = seq, kind, reduce
        self.inputs: list[Any] = [None] * size
        self.arrived = [False] * size
        self.outputs: list[Any] | None = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            if self.error is None:
                self.outputs = self.reduce(self.inputs)
        except BaseException as e:  # handed to every waiting worker
            self.error = e
        self.inputs = []  # the snapshots are no longer needed
        self.finished.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.finished.set()


class _Started:
    """A worker's handle on one collective of a :class:`ThreadWorld`.

    Args:
        world: the world.
        op: the collective.
        rank: the worker.
        what: the collective, for messages (e.g. ``"average 'grads.0'"``).
    """

    def __init__(self, world: "ThreadWorld", op: _Collective, rank: int, what: str) -> None:
        self._world, self._op, self._rank, self._what = world, op, rank, what

    def done(self) -> bool:
        """True once :meth:`wait` would not block."""
        return self._op.finished.is_set()

    def wait(self) -> Any:
        """This worker's output, once every worker has started the collective and it has run.

        Raises:
            CollectiveTimeout: it did not complete within the world's timeout.
        """
        op, timeout = self._op, self._world.timeout
        if not op.finished.wait(timeout):
            with self._world._cv:
                missing = [r for r, came in enumerate(op.arrived) if not came]
            raise CollectiveTimeout(
                timeout_message(
                    self._rank,
                    f"{self._what} (occurrence #{op.seq} of that name)",
                    timeout if timeout is not None else 0.0,
                    f"rank(s) {missing} never started it" if missing else "",
                )
            )
        if isinstance(op.error, WorldAborted):
            raise WorldAborted(f"rank {self._rank}: {self._what}: {op.error}")
        if op.error is not None:
            raise RuntimeError(f"rank {self._rank}: {self._what} failed: {op.error}") from op.error
        assert op.outputs is not None
        return op.outputs[self._rank]


class ThreadWorld:
    """Shared state of ``size`` thread workers.

    Args:
        size: the number of workers.
        timeout: seconds any worker waits for a collective or a gossip message before failing
            with a ``TimeoutError`` (a deadlock in a test then fails instead of hanging); None
            waits forever, ``"env"`` reads ``HVD_SLOWMO_COLLECTIVE_TIMEOUT``.
    """

    def __init__(self, size: int, timeout: float | str | None = 60.0) -> None:
        if size < 1:
            raise ValueError(f"ThreadWorld: size must be >= 1, got {size}")
        self.size = size
        self.timeout = collective_timeout(timeout)
        self._cv = threading.Condition()
        # Per worker: how many collectives of each (kind, name) it has started.
        self._counts: list[dict[tuple[str, str], int]] = [{} for _ in range(size)]
        # Started by some workers, not yet by all, by (kind, name, occurrence).
        self._open: dict[tuple[str, str, int], _Collective] = {}
        # Collectives every worker has started, run in that order by one progress thread.
        self._progress = SerialRunner("hvd_slowmo-thread-world")
        self._aborted: str | None = None
        self._mail: dict[tuple[int, int, int], Tensor] = {}
        self._mail_cv = threading.Condition()
        self._splits: dict[tuple[tuple[int, ...], ...], dict[int, ThreadCommunicator]] = {}

    def communicator(self, rank: int) -> "ThreadCommunicator":
        """The communicator of worker ``rank``."""
        return ThreadCommunicator(self, rank)

    def split(self, groups: Sequence[Sequence[int]]) -> dict[int, "ThreadCommunicator"]:
        """Sub-worlds, like process sets: ``groups`` partitions the ranks.

        Args:
            groups: lists of global ranks; each becomes a world whose ranks follow the list order.

        Returns:
            ``{global rank: its communicator inside its group}``; every worker thread that asks for
            the same grouping gets the same sub-worlds.
        """
        key = tuple(tuple(g) for g in groups)
        if sorted(r for g in key for r in g) != list(range(self.size)):
            raise ValueError(f"split: groups {groups} must partition ranks 0..{self.size - 1}")
        with self._mail_cv:
            if key not in self._splits:
                out: dict[int, ThreadCommunicator] = {}
                for g in key:
                    sub = ThreadWorld(len(g), self.timeout)
                    for local, rank in enumerate(g):
                        out[rank] = sub.communicator(local)
                self._splits[key] = out
            return self._splits[key]

    def abort(self, reason: str) -> None:
        """Fail every collective not yet run, and every later one, with :class:`WorldAborted`
        (a worker failed: the others must not wait for it until their deadline).

        Args:
            reason: what happened, for the others' messages.
        """
        with self._cv:
            self._aborted = reason
            pending = list(self._open.values()) + cast(list[_Collective], self._progress.drain())
            self._open.clear()
        for op in pending:
            op.fail(WorldAborted(reason))
        for sub in list(self._splits.values()):
            for world in {c.world for c in sub.values()}:
                world.abort(reason)

    def start(
        self, rank: int, kind: str, name: str, value: Any, reduce: Reduce, what: str
    ) -> _Started:
        """Hand this worker's input of a collective to the world; never blocks.

        Workers pair their collectives by kind and name, as Horovod does (the k-th ``average``
        named ``"x"`` of each worker is one collective), not by position: a caller may start
        the next stage of a collective when it sees the first one done (a compressed average's
        all-gather), which happens at different moments on different workers. The progress
        thread runs a collective once the last worker has started it.

        Args:
            rank: the worker.
            kind: the operation.
            name: its label (the same on every worker).
            value: this worker's input (a snapshot: it must not change afterwards).
            reduce: inputs in rank order -> outputs in rank order (the first worker's is used).
            what: the collective, for messages.
        """
        with self._cv:
            if self._aborted is not None:
                raise WorldAborted(f"rank {rank}: {what}: {self._aborted}")
            label = (kind, name)
            count = self._counts[rank].get(label, 0)
            self._counts[rank][label] = count + 1
            key = (kind, name, count)
            op = self._open.get(key)
            if op is None:
                op = self._open[key] = _Collective(count, kind, reduce, self.size)
            op.inputs[rank], op.arrived[rank] = value, True
            if all(op.arrived):
                del self._open[key]
                self._progress.submit(op)
        return _Started(self, op, rank, what)


class _ThreadExchange(PendingExchange):
    def __init__(self, world: ThreadWorld, rank: int, recv_from: Sequence[int], tag: int) -> None:
        self._world, self._rank, self._recv_from, self._tag = world, rank, list(recv_from), tag

    def done(self) -> bool:
        with self._world._mail_cv:
            return self._arrived()

    def wait(self) -> dict[int, Tensor]:
        w = self._world
        with w._mail_cv:
            if not w._mail_cv.wait_for(self._arrived, timeout=w.timeout):
                missing = [s for s in self._recv_from if (s, self._rank, self._tag) not in w._mail]
                raise TimeoutError(
                    f"rank {self._rank}: no gossip message from rank(s) {missing} "
                    f"for step {self._tag}"
                )
            return {src: w._mail.pop((src, self._rank, self._tag)) for src in self._recv_from}

    def _arrived(self) -> bool:  # caller holds the lock
        return all((src, self._rank, self._tag) in self._world._mail for src in self._recv_from)


# --- what the progress thread computes: inputs in rank order -> outputs in rank order ----------
def _mean(everyone: list[list[Tensor]]) -> list[list[Tensor]]:
    """Each tensor's sum in rank order divided by the number of workers: one result that every
    worker copies, so every worker gets the same bits."""
    size = len(everyone)
    means = []
    for i in range(len(everyone[0])):
        total = everyone[0][i].clone()
        for r in range(1, size):
            total += everyone[r][i]
        means.append(total / size)
    _settle(means)
    return [means] * size


def _shard_means(everyone: list[list[Tensor]]) -> list[list[Tensor]]:
    """Each worker's shard of :func:`_mean`'s result, summed and divided the same way (so a shard
    is bitwise the same elements of an average)."""
    size = len(everyone)
    out: list[list[Tensor]] = []
    for rank in range(size):
        mine = []
        for i, f in enumerate(everyone[0]):
            start, end = shard_range(f.numel(), rank, size)
            total = everyone[0][i][start:end].clone()
            for r in range(1, size):
                total += everyone[r][i][start:end]
            mine.append(total / size)
        out.append(mine)
    _settle([t for mine in out for t in mine])
    return out


def _concatenations(everyone: list[list[Tensor]]) -> list[list[Tensor]]:
    """Every worker's own copy of each shard list's concatenation in rank order."""
    size = len(everyone)
    out = [
        [torch.cat([everyone[r][i] for r in range(size)]) for i in range(len(everyone[0]))]
        for _ in range(size)
    ]
    _settle([t for mine in out for t in mine])
    return out


def _transpose(everyone: list[list[Tensor]]) -> list[list[Tensor]]:
    """All-to-all: worker ``j`` gets every worker's message to ``j``, in rank order."""
    return [[everyone[src][dst] for src in range(len(everyone))] for dst in range(len(everyone))]


def _same_list(everyone: list[Any]) -> list[list[Any]]:
    return [list(everyone) for _ in everyone]


def _snapshot(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Detached copies that the progress thread may read while the caller goes on."""
    out = [t.detach().clone() for t in tensors]
    _settle(out)
    return out


class ThreadCommunicator(Communicator):
    """Worker ``rank`` of a :class:`ThreadWorld`.

    Args:
        world: the shared world.
        rank: this worker's rank.
    """

    supports_sharding = True
    supports_alltoall = True
    supports_exchange = True
    supports_point_to_point = True
    collectives_any_thread = True  # paired by kind and name
    workers_share_process = True

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size

    def _start(self, kind: str, value: Any, reduce: Reduce, name: str = "") -> _Started:
        what = f"{kind} {name!r}" if name else kind
        return self.world.start(self.rank, kind, name, value, reduce, what)

    def _start_average(self, tensors: list[Tensor], name: str) -> PendingAverage:
        # Not _average_start itself: subclasses in the tests override that one and call
        # _average_, which must not come back to their override.
        started = self._start("average", _snapshot(tensors), _mean, name)

        def finish() -> None:
            # Copied on the caller's thread (and its CUDA stream): the tensors keep their values
            # until wait(), and the result lands in the caller's stream order.
            for t, mean in zip(tensors, started.wait()):
                t.copy_(mean)

        return PendingAverage(finish, progress=started.done)

    def _average_start(self, tensors: list[Tensor], name: str) -> tuple[PendingAverage, int]:
        wire = sum(t.numel() * t.element_size() for t in tensors)
        return self._start_average(tensors, name), wire

    def _average_(self, tensors: list[Tensor], name: str) -> int:
        self._start_average(tensors, name).wait()
        return sum(t.numel() * t.element_size() for t in tensors)

    def _allgather_object(self, obj: Any) -> list[Any]:
        return self._start("allgather_object", obj, _same_list).wait()

    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        return self._start("broadcast_object", obj, _same_list).wait()[root_rank]

    def _reduce_scatter_mean(self, flats: list[Tensor], name: str) -> tuple[list[Tensor], int]:
        out = self._start("reduce_scatter", _snapshot(flats), _shard_means, name).wait()
        return out, sum(f.numel() * f.element_size() for f in flats)

    def _allgather_flat_start(self, shards: list[Tensor], name: str) -> PendingTensors:
        started = self._start("allgather", _snapshot(shards), _concatenations, name)
        return PendingTensors(started.wait, started.done)

    def _alltoall_flat_start(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> PendingTensors:
        started = self._start("alltoall", _snapshot(sends), _transpose, name)
        return PendingTensors(started.wait, started.done)

    def _exchange_start(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None,
    ) -> PendingExchange:
        w = self.world
        with w._mail_cv:
            for dst, t in sends.items():
                w._mail[(self.rank, dst, tag)] = t.detach().clone()
            w._mail_cv.notify_all()
        return _ThreadExchange(w, self.rank, recv_from, tag)

    def _send_start(self, tensor: Tensor, dst: int, tag: int) -> PendingExchange:
        # The mailbox takes a copy: the message is delivered (done) once it is posted.
        return self._exchange_start({dst: tensor}, [], -1 - tag, None)

    def _recv_start(self, like: Tensor, src: int, tag: int) -> PendingExchange:
        # Negative tags: a point-to-point message never meets a gossip exchange's.
        return _ThreadExchange(self.world, self.rank, [src], -1 - tag)


def run_threads(
    size: int, fn: Callable[[ThreadCommunicator], Any], timeout: float | None = 60.0
) -> list[Any]:
    """Run ``fn(communicator)`` on ``size`` thread workers and return their results in rank order.

    The first exception raised by any worker is re-raised here (the others' collectives fail
    with :class:`WorldAborted` instead of waiting for it).

    Args:
        size: the number of workers.
        fn: the per-worker function.
        timeout: seconds before a stuck collective fails (None: never).
    """
    world = ThreadWorld(size, timeout)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def target(rank: int) -> None:
        torch.set_num_threads(1)
        try:
            results[rank] = fn(world.communicator(rank))
        except BaseException as e:  # re-raised in the caller's thread below
            errors[rank] = e
            world.abort(f"rank {rank} raised {type(e).__name__}: {e}")

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(None if timeout is None else timeout * 4)
    first = next(
        (e for e in errors if e is not None and not isinstance(e, WorldAborted)),
        None,
    )
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    if any(t.is_alive() for t in threads):
        raise TimeoutError("run_threads: a worker thread did not finish")
    return results
