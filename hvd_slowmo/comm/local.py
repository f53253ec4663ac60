"""An in-process communicator: ``m`` workers as threads of one process, for fast exact tests.

Averages are summed in rank order by every worker, so all workers get bitwise identical
results, as with a real allreduce.
"""

import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .base import Communicator, PendingExchange, shard_range

__all__ = ["ThreadWorld", "ThreadCommunicator", "run_threads"]


class ThreadWorld:
    """Shared state of ``size`` thread workers.

    Args:
        size: the number of workers.
        timeout: seconds any worker waits for the others before failing (a deadlock in a test
            then fails instead of hanging).
    """

    def __init__(self, size: int, timeout: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"ThreadWorld: size must be >= 1, got {size}")
        self.size = size
        self.timeout = timeout
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list[Any] = [None] * size
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

    def _gather(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return out


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


class ThreadCommunicator(Communicator):
    """Worker ``rank`` of a :class:`ThreadWorld`.

    Args:
        world: the shared world.
        rank: this worker's rank.
    """

    supports_sharding = True
    supports_alltoall = True
    supports_exchange = True

    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size

    def _average_(self, tensors: list[Tensor], name: str) -> int:
        everyone = self.world._gather(self.rank, [t.detach().clone() for t in tensors])
        for i, t in enumerate(tensors):
            total = everyone[0][i].clone()
            for r in range(1, self.size):
                total += everyone[r][i]
            t.copy_(total / self.size)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _allgather_object(self, obj: Any) -> list[Any]:
        return self.world._gather(self.rank, obj)

    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        return self.world._gather(self.rank, obj)[root_rank]

    def _reduce_scatter_mean(self, flats: list[Tensor], name: str) -> tuple[list[Tensor], int]:
        everyone = self.world._gather(self.rank, [f.detach().clone() for f in flats])
        out = []
        for i, f in enumerate(flats):
            start, end = shard_range(f.numel(), self.rank, self.size)
            # Summed in rank order and divided as in average_, so a shard is bitwise the same
            # elements of average_'s result.
            total = everyone[0][i][start:end].clone()
            for r in range(1, self.size):
                total += everyone[r][i][start:end]
            out.append(total / self.size)
        return out, sum(f.numel() * f.element_size() for f in flats)

    def _allgather_flat(self, shards: list[Tensor], name: str) -> list[Tensor]:
        everyone = self.world._gather(self.rank, [s.detach().clone() for s in shards])
        return [torch.cat([everyone[r][i] for r in range(self.size)]) for i in range(len(shards))]

    def _alltoall_flat(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> list[Tensor]:
        everyone = self.world._gather(self.rank, [s.detach().clone() for s in sends])
        return [everyone[src][self.rank] for src in range(self.size)]

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


def run_threads(
    size: int, fn: Callable[[ThreadCommunicator], Any], timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(communicator)`` on ``size`` thread workers and return their results in rank order.

    The first exception raised by any worker is re-raised here.

    Args:
        size: the number of workers.
        fn: the per-worker function.
        timeout: seconds before a stuck collective fails.
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
            world._barrier.abort()

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 4)
    first = next(
        (e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
        None,
    )
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    if any(t.is_alive() for t in threads):
        raise TimeoutError("run_threads: a worker thread did not finish")
    return results
