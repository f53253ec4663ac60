"""Gossip over MPI neighbour collectives (mpi4py), for MPI launches (``horovodrun --mpi``,
``mpirun``).

Each global graph of a time-varying topology gets one distributed-graph communicator, created
once (collectively, on every rank at the same exchange) and cached under the graph's key; an
exchange is one non-blocking ``MPI_Ineighbor_alltoallv`` on flat contiguous buffers, which
MPI progresses while the caller polls ``MPI_Test`` (so a wait can have a deadline).

Under Horovod this shares Horovod's MPI world (a duplicate of ``COMM_WORLD``); it needs
``MPI_THREAD_MULTIPLE`` because Horovod's background thread calls MPI at the same time. Never
use it under a Gloo launch: mpi4py would then see a world of one process.

CUDA tensors: with a CUDA-aware MPI pass ``cuda_aware=True``; otherwise each message is staged
through pinned host buffers. Neither path is tested: no test runs this communicator on CUDA
tensors (scripts/gpu_check.sh runs tests/test_cuda.py, which uses the thread and Horovod
communicators).

Every collective starts without blocking (``MPI_Ialltoallv``, ``MPI_Iallgatherv``, ...) and
its handle's wait polls ``MPI_Test`` until the deadline (``timeout``, or the environment variable
``HVD_SLOWMO_COLLECTIVE_TIMEOUT``: :mod:`~hvd_slowmo.comm.deadline`), then raises
:class:`~hvd_slowmo.comm.deadline.CollectiveTimeout` naming the rank and the collective. A
collective in two stages (an all-gather's lengths then its data) starts its second stage on a
second communicator once its first stage is complete here, the second stages in the order the
collectives of that kind started: MPI pairs the collectives of one communicator by their order,
which is then the same on every rank. The average is the exception: one thread runs it with
the blocking ``MPI_Reduce`` and ``MPI_Bcast`` of before, to keep its bits (see
``MPICommunicator._averaging_loop``). Only the creation of a distributed-graph communicator
(once per graph, cached) blocks without a deadline: MPI has no non-blocking form of it.
"""

import pickle
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .base import Communicator, PendingAverage, PendingExchange, PendingTensors, joined
from .deadline import CollectiveTimeout, collective_timeout, timeout_message, wait_until

__all__ = ["MPICommunicator"]

#: The lanes of two-stage collectives (see MPICommunicator.__init__).
OBJECTS, GATHER = "objects", "allgather"
#: Distributed-graph communicators kept per MPICommunicator; the oldest is freed beyond this
#: (every rank sees the same key sequence, so every rank frees the same one at the same call).
MAX_CACHED_GRAPHS = 64


def _offsets(counts: list[int]) -> list[int]:
    """Displacements of consecutive blocks of ``counts`` elements."""
    out = [0]
    for c in counts[:-1]:
        out.append(out[-1] + c)
    return out


def _np() -> Any:
    import numpy  # imported lazily: a torch-only install (threads, gossip over Horovod) has none

    return numpy


def _mpi() -> Any:
    from mpi4py import MPI  # imported lazily: under Gloo, importing it creates a one-process world

    return MPI


class _NeighborExchange(PendingExchange):
    """One ``Ineighbor_alltoallv`` in flight; holds its buffers until it completes."""

    def __init__(
        self,
        request: Any,
        sources: list[int],
        recv: Tensor,
        chunk: int,
        send: Tensor,
        device: torch.device | None,
        rank: int,
        timeout: float | None,
    ) -> None:
        self._request, self._sources, self._recv, self._chunk = request, sources, recv, chunk
        self._rank, self._timeout = rank, timeout
        self._send: Tensor | None = send  # MPI reads it until completion: keep it alive
        self._device = device  # set when the receive buffer is a host staging copy
        self._result: dict[int, Tensor] | None = None

    def done(self) -> bool:
        # MPI_Test also drives MPI's progress engine for this request.
        return self._result is not None or bool(self._request.Test())

    def wait(self) -> dict[int, Tensor]:
        if self._result is None:
            wait_until(
                self.done,
                self._timeout,
                lambda: timeout_message(
                    self._rank,
                    f"the neighbour exchange with rank(s) {self._sources}",
                    self._timeout or 0.0,
                ),
            )
            self._send = None
            recv = self._recv if self._device is None else self._recv.to(self._device)
            self._result = {
                src: recv[i * self._chunk : (i + 1) * self._chunk]
                for i, src in enumerate(self._sources)
            }
        return self._result


def _complete(requests: list[Any]) -> bool:
    """Whether every request is complete (``MPI_Test`` on each also drives MPI's progress)."""
    return all(r.Test() for r in requests)


class _Collective:
    """One non-blocking collective in flight, in one or two stages.

    Args:
        what: the collective, for messages (e.g. ``"average 'x'"``).
        first: the requests started at once.
        second: starts the second stage's requests (called once the first stage is complete
            here, in the order the collectives of its lane started); None: one stage.
        finish: the result, once every request is complete.
        lane: the kind of a two-stage collective (:data:`OBJECTS` or :data:`GATHER`).
    """

    def __init__(
        self,
        what: str,
        first: list[Any],
        second: Callable[[], list[Any]] | None,
        finish: Callable[[], Any],
        lane: str = "",
    ) -> None:
        self.what, self.first, self.start_second, self.finish = what, first, second, finish
        self.lane = lane
        self.second: list[Any] | None = [] if second is None else None


class _Average:
    """One average for the averaging thread: the host copies it reduces in place."""

    def __init__(self, what: str, hosts: list[Tensor]) -> None:
        self.what, self.hosts = what, [h.contiguous() for h in hosts]
        self.error: BaseException | None = None
        self.finished = threading.Event()


class MPICommunicator(Communicator):
    """Collectives and neighbour exchanges over an MPI communicator.

    Args:
        comm: an ``mpi4py`` communicator (default ``COMM_WORLD``); it is duplicated, so this
            object's traffic never matches anyone else's.
        cuda_aware: the MPI library accepts CUDA device buffers (else they are staged on the host).
        timeout: seconds a wait for a collective or an exchange lasts before it raises
            :class:`~hvd_slowmo.comm.deadline.CollectiveTimeout`; None waits forever;
            ``"env"`` (default) reads ``HVD_SLOWMO_COLLECTIVE_TIMEOUT`` (unset: forever).

    Raises:
        RuntimeError: MPI was initialized without ``MPI_THREAD_MULTIPLE``.
    """

    supports_alltoall = True
    supports_exchange = True
    # The all-to-alls and the all-gathers have communicators of their own, so a codec thread
    # starting them (in its own order, the same on every rank) crosses no other collective.
    collectives_any_thread = True

    def __init__(
        self, comm: Any = None, cuda_aware: bool = False, timeout: float | str | None = "env"
    ) -> None:
        MPI = _mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "MPI gossip needs MPI_THREAD_MULTIPLE (Horovod's background thread uses MPI "
                "concurrently); unset HOROVOD_MPI_THREADS_DISABLE or use gossip_transport='horovod'"
            )
        self.timeout = collective_timeout(timeout)
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        # Each kind of two-stage collective has its own communicators, for its first stage and
        # for its second stages: a caller may start an all-gather when it sees an all-to-all done
        # (a compressed average), at different moments on different ranks, so only the
        # collectives of one kind are started in the same order everywhere.
        self._first = {OBJECTS: self._comm, GATHER: self._comm.Dup()}
        self._late = {lane: self._comm.Dup() for lane in (OBJECTS, GATHER)}
        # The all-to-alls: one stage, in start order, apart from the object collectives.
        self._alltoall_comm = self._comm.Dup()
        self._queues: dict[str, deque[_Collective]] = {OBJECTS: deque(), GATHER: deque()}
        # Starting a collective and queueing its second stage is one step, whichever thread
        # starts it (a gradient hook may run on autograd's thread).
        self._lock = threading.RLock()
        # The averages, run in start order by one thread (see _averaging_loop).
        self._average_comm = self._comm.Dup()
        self._averages: queue.SimpleQueue[_Average] = queue.SimpleQueue()
        self._averager: threading.Thread | None = None
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self.cuda_aware = cuda_aware
        self._graphs: OrderedDict[Hashable, Any] = OrderedDict()
        self._types: dict[int, Any] = {}

    @classmethod
    def for_horovod(cls, hvd_comm: Communicator) -> "MPICommunicator":
        """The MPI world under a Horovod communicator, checked to have the same ranks.

        Args:
            hvd_comm: a :class:`~hvd_slowmo.comm.horovod.HorovodCommunicator` of an MPI launch.

        Raises:
            ValueError: Horovod runs over a process set smaller than the MPI world, or its
                ranks are numbered differently.
        """
        mpi = cls()
        if (mpi.rank, mpi.size) != (hvd_comm.rank, hvd_comm.size):
            raise ValueError(
                f"MPI gossip: MPI rank/size {mpi.rank}/{mpi.size} differ from Horovod's "
                f"{hvd_comm.rank}/{hvd_comm.size} (a Horovod process set?); "
                "use gossip_transport='horovod'"
            )
        return mpi

    # --- non-blocking collectives: start, progress, wait with a deadline ---------------------
    def _launch(self, op: _Collective) -> _Collective:
        """Queue ``op``'s second stage (caller holds the lock, having started its first)."""
        if op.start_second is not None:
            self._queues[op.lane].append(op)
        self._advance()
        return op

    def _advance(self) -> None:
        """Start the second stages whose first stages are complete here, in start order; never
        blocks. Every rank then starts them in one order, whatever its timing."""
        with self._lock:
            for queue_ in self._queues.values():
                while queue_ and _complete(queue_[0].first):
                    op = queue_.popleft()
                    assert op.start_second is not None
                    op.second = op.start_second()

    def _done(self, op: _Collective) -> bool:
        self._advance()
        return op.second is not None and _complete(op.first) and _complete(op.second)

    def _wait(self, op: _Collective) -> Any:
        """``op``'s result once complete; raises ``CollectiveTimeout`` past the deadline."""
        wait_until(
            lambda: self._done(op),
            self.timeout,
            lambda: timeout_message(
                self.rank,
                op.what,
                self.timeout or 0.0,
                "its first stage is still open"
                if op.second is None
                else "the data of its second stage did not arrive",
            ),
        )
        return op.finish()

    def _start_average(self, tensors: list[Tensor], name: str) -> PendingAverage:
        job = _Average(f"average {name!r}", [t.detach().to("cpu", copy=True) for t in tensors])
        with self._lock:
            if self._averager is None:
                self._averager = threading.Thread(
                    target=self._averaging_loop, name="hvd_slowmo-mpi-average", daemon=True
                )
                self._averager.start()
            self._averages.put(job)

        def finish() -> None:
            if not job.finished.wait(self.timeout):
                raise CollectiveTimeout(
                    timeout_message(
                        self.rank, job.what, self.timeout or 0.0, "MPI_Reduce/MPI_Bcast still runs"
                    )
                )
            if job.error is not None:
                raise RuntimeError(
                    f"hvd_slowmo: rank {self.rank}: {job.what} failed: {job.error}"
                ) from job.error
            for t, host in zip(tensors, job.hosts):
                t.copy_(host.div_(self.size))

        return PendingAverage(finish, progress=job.finished.is_set)

    def _averaging_loop(self) -> None:
        """Run the averages with blocking MPI calls, in the order they were started.

        Not ``MPI_Ireduce``: Open MPI's non-blocking reduce (libnbc) sums three or more ranks in
        another order than its blocking ``MPI_Reduce``, so the averages' bits would change
        (measured with Open MPI 4.1.4 at -np 3 and 4). The blocking calls on this thread keep the
        bits and still never block the caller: a start returns at once, as under Horovod,
        whose background thread does the same.
        """
        MPI = _mpi()
        root = self.rank == 0
        while True:
            job = self._averages.get()
            try:
                for host in job.hosts:
                    # Reduce at one root then broadcast: every rank gets the root's bits exactly
                    # (an allreduce may round differently on different ranks).
                    buf = host.view(-1).numpy()
                    self._average_comm.Reduce(
                        MPI.IN_PLACE if root else buf, buf if root else None, op=MPI.SUM, root=0
                    )
                    self._average_comm.Bcast(buf, root=0)
            except BaseException as e:  # handed to the waiting caller
                job.error = e
            job.finished.set()

    def _average_start(self, tensors: list[Tensor], name: str) -> tuple[PendingAverage, int]:
        wire = sum(t.numel() * t.element_size() for t in tensors)
        return self._start_average(tensors, name), wire

    def _average_(self, tensors: list[Tensor], name: str) -> int:
        pending, wire = self._average_start(tensors, name)
        pending.wait()
        return wire

    def _allgather_object(self, obj: Any) -> list[Any]:
        np = _np()
        data = np.frombuffer(bytearray(pickle.dumps(obj)), dtype=np.uint8)
        lengths = np.zeros(self.size, dtype=np.int64)
        recv: list[Any] = []
        with self._lock:
            mine = np.array([data.size], dtype=np.int64)
            first = [self._first[OBJECTS].Iallgather(mine, lengths)]

            def second() -> list[Any]:
                counts = lengths.tolist()
                recv.append(np.empty(sum(counts), dtype=np.uint8))
                late = self._late[OBJECTS]
                return [late.Iallgatherv(data, [recv[0], (counts, _offsets(counts))])]

            def finish() -> list[Any]:
                ends = np.cumsum(lengths).tolist()
                starts = [0] + ends[:-1]
                return [pickle.loads(recv[0][a:b].tobytes()) for a, b in zip(starts, ends)]

            op = self._launch(_Collective("allgather_object", first, second, finish, OBJECTS))
        return self._wait(op)

    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        np = _np()
        mine = self.rank == root_rank
        data = np.frombuffer(bytearray(pickle.dumps(obj)), dtype=np.uint8) if mine else None
        length = np.array([0 if data is None else data.size], dtype=np.int64)
        recv: list[Any] = []
        with self._lock:
            first = [self._first[OBJECTS].Ibcast(length, root=root_rank)]

            def second() -> list[Any]:
                recv.append(data if data is not None else np.empty(int(length[0]), np.uint8))
                return [self._late[OBJECTS].Ibcast(recv[0], root=root_rank)]

            def finish() -> Any:
                return obj if mine else pickle.loads(recv[0].tobytes())

            op = self._launch(_Collective("broadcast_object", first, second, finish, OBJECTS))
        return self._wait(op)

    def _alltoall_flat_start(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> PendingTensors:
        # Staged through host memory like the average (a GPU's packets: a copy small next to the
        # wire time); a CPU's packets of one buffer are sent where they lie.
        send = joined([s.detach().to("cpu") for s in sends])
        recv = torch.empty(sum(recv_numels), dtype=send.dtype)
        etype = self._elem_type(send.element_size())
        counts = [s.numel() for s in sends]
        with self._lock:
            request = self._alltoall_comm.Ialltoallv(
                [self._buffer(send), (counts, _offsets(counts)), etype],
                [self._buffer(recv), (recv_numels, _offsets(recv_numels)), etype],
            )

            def finish() -> list[Tensor]:
                return [t.to(sends[0].device) for t in recv.split(recv_numels)]

            # send stays referenced by finish's closure until the exchange completes.
            op = self._launch(
                _Collective(f"alltoall {name!r}", [request], None, lambda: (send, finish())[1])
            )
        return PendingTensors(lambda: self._wait(op), lambda: self._done(op))

    def _allgather_flat_start(self, shards: list[Tensor], name: str) -> PendingTensors:
        np = _np()
        hosts = [s.detach().to("cpu").contiguous() for s in shards]
        # Every rank's length of every shard first (rows: ranks), then each shard's data.
        lengths = np.zeros((self.size, len(hosts)), dtype=np.int64)
        recvs: list[Tensor] = []
        with self._lock:
            mine = np.array([h.numel() for h in hosts], dtype=np.int64)
            first = [self._first[GATHER].Iallgather(mine, lengths)]

            def second() -> list[Any]:
                requests = []
                for i, host in enumerate(hosts):
                    counts = lengths[:, i].tolist()
                    recv = torch.empty(sum(counts), dtype=host.dtype)
                    etype = self._elem_type(host.element_size())
                    requests.append(
                        self._late[GATHER].Iallgatherv(
                            [self._buffer(host), etype],
                            [self._buffer(recv), (counts, _offsets(counts)), etype],
                        )
                    )
                    recvs.append(recv)
                return requests

            def finish() -> list[Tensor]:
                return [r.to(s.device) for r, s in zip(recvs, shards)]

            op = self._launch(_Collective(f"allgather {name!r}", first, second, finish, GATHER))
        return PendingTensors(lambda: self._wait(op), lambda: self._done(op))

    # --- gossip ------------------------------------------------------------------------------
    def _graph_comm(
        self, sources: tuple[int, ...], dests: tuple[int, ...], key: Hashable | None
    ) -> Any:
        if key is not None and key in self._graphs:
            self._graphs.move_to_end(key)
            return self._graphs[key]
        # Collective over the world: every rank reaches this at the same exchange because all
        # ranks see the same key sequence (the key names the global graph, not this rank's part).
        g = self._comm.Create_dist_graph_adjacent(list(sources), list(dests), reorder=False)
        if key is None:
            return g
        self._graphs[key] = g
        if len(self._graphs) > MAX_CACHED_GRAPHS:
            self._graphs.popitem(last=False)[1].Free()
        return g

    def _elem_type(self, itemsize: int) -> Any:
        # One MPI element per tensor element (counts stay below 2^31 for large models, and
        # bfloat16/float16 need no MPI type of their own).
        if itemsize not in self._types:
            self._types[itemsize] = _mpi().BYTE.Create_contiguous(itemsize).Commit()
        return self._types[itemsize]

    def _exchange_start(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None,
    ) -> PendingExchange:
        dests = tuple(sorted(sends))
        sources = tuple(sorted(recv_from))
        chunk = next(iter(sends.values())).numel()
        parts = [sends[d].detach().reshape(-1) for d in dests]
        send = parts[0] if len(parts) == 1 else torch.cat(parts)
        device = None
        if send.is_cuda and not self.cuda_aware:
            device = send.device
            staged = torch.empty(send.numel(), dtype=send.dtype, pin_memory=True)
            staged.copy_(send)  # synchronous: the device buffer may be reused after this returns
            send = staged
        elif send.is_cuda:
            # MPI reads device memory directly, outside torch's stream order: finish the packing
            # kernels first.
            torch.cuda.current_stream(send.device).synchronize()
        recv = torch.empty(
            len(sources) * chunk,
            dtype=send.dtype,
            device=send.device,
            pin_memory=device is not None,
        )
        etype = self._elem_type(send.element_size())
        graph = self._graph_comm(sources, dests, graph_key)
        request = graph.Ineighbor_alltoallv(
            [
                self._buffer(send),
                ([chunk] * len(dests), [i * chunk for i in range(len(dests))]),
                etype,
            ],
            [
                self._buffer(recv),
                ([chunk] * len(sources), [i * chunk for i in range(len(sources))]),
                etype,
            ],
        )
        return _NeighborExchange(
            request, list(sources), recv, chunk, send, device, self.rank, self.timeout
        )

    @staticmethod
    def _buffer(t: Tensor) -> Any:
        if t.is_cuda:
            return t  # CUDA-aware MPI: mpi4py reads __cuda_array_interface__ / DLPack
        return t.view(torch.uint8).numpy()
