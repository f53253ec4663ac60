"""The communicator interface that the algorithms talk to (SlowMo, arXiv 1910.00643).

Nothing outside :mod:`hvd_slowmo.comm` calls Horovod or MPI: the optimizer, the base algorithms
and the slow state are handed a :class:`Communicator`, so the same algorithm runs over Horovod
(:mod:`~hvd_slowmo.comm.horovod`), torch.distributed (:mod:`~hvd_slowmo.comm.torchdist`), MPI
neighbour collectives (:mod:`~hvd_slowmo.comm.mpi`) or in-process threads
(:mod:`~hvd_slowmo.comm.local`, for tests).

The public methods here hold what every transport shares: the one-worker shortcuts, the checks
on their arguments and the byte counting (:class:`ByteCounter`, one convention for every
transport). A transport implements the ``_``-prefixed hooks and
declares which optional operations it has (:attr:`Communicator.supports_sharding`,
:attr:`Communicator.supports_alltoall`, :attr:`Communicator.supports_exchange`).
"""

import abc
import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "ByteCounter",
    "Communicator",
    "PendingAverage",
    "PendingExchange",
    "PendingTensors",
    "filled",
    "shard_range",
    "shard_sizes",
]


def shard_sizes(numel: int, size: int) -> list[int]:
    """Elements per rank when a flat vector of ``numel`` is split over ``size`` ranks.

    The split of Horovod 0.28.1's reducescatter (``ReducescatterOp::ComputeOutputShapeForRank``):
    ``numel // size`` each, one more for ranks ``0 .. numel % size - 1``.

    Args:
        numel: the flat vector's length (>= 0).
        size: the number of ranks (>= 1).
    """
    if numel < 0 or size < 1:
        raise ValueError(
            f"shard_sizes: need numel >= 0 and size >= 1, got numel={numel}, size={size}"
        )
    base, extra = divmod(numel, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def shard_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """The half-open element range ``[start, end)`` of rank ``rank``'s shard (as
    :func:`shard_sizes` splits).

    Args:
        numel: the flat vector's length.
        rank: the rank, in ``[0, size)``.
        size: the number of ranks.
    """
    if not 0 <= rank < size:
        raise ValueError(f"shard_range: rank {rank} is outside [0, {size})")
    base, extra = divmod(numel, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def filled(slots: Sequence[Tensor | None]) -> list[Tensor]:
    """``slots``, a collective's results filled in one by one, checked to be all set.

    Args:
        slots: one result per slot, None where none arrived.
    """
    out = [t for t in slots if t is not None]
    if len(out) != len(slots):
        raise RuntimeError(f"a collective left {len(slots) - len(out)} of its results unset")
    return out


def joined(tensors: Sequence[Tensor]) -> Tensor:
    """The 1-D tensors end to end as one: a view where they already lie so in one storage (the
    packets a codec encodes into one buffer), else a new one (``torch.cat``). The view saves a
    copy and a new buffer's first touch of each page per collective: at a model's size, more
    than the codec's own arithmetic on a CPU.

    Args:
        tensors: 1-D tensors of one dtype and device (at least one).
    """
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (
            t.dim() != 1
            or t.stride(0) != 1
            or t.dtype != first.dtype
            or t.device != first.device
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or t.storage_offset() != offset
        ):
            return torch.cat(list(tensors))
        offset += t.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,))


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ByteCounter:
    """Payload bytes one rank has put on the wire: the one counter behind
    :attr:`Communicator.bytes_sent` (the convention per collective is documented there).

    Communicators that carry one optimizer's traffic share one counter (the node and
    cross-node levels of ``worker="node"``, a gossip base's MPI transport: see
    :func:`hvd_slowmo.comm.factory.worker_hierarchy` and
    :func:`~hvd_slowmo.comm.factory.gossip_transport`), so ``opt.bytes_sent`` reads one number.

    Attributes:
        total: the bytes counted so far.
    """

    def __init__(self) -> None:
        self.total = 0
        # The pause is per thread (a codec thread's collectives run beside the training
        # thread's, which may be inside ``uncounted()``), the total shared under a lock.
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def counting(self) -> bool:
        """False inside :meth:`paused` (on this thread)."""
        return getattr(self._local, "paused", 0) == 0

    def add(self, nbytes: float, always: bool = False) -> None:
        """Count ``nbytes`` (rounded down) unless paused on this thread.

        Args:
            nbytes: the bytes an operation puts on the wire.
            always: count even when paused (an operation whose start was counted, finished
                on another thread).
        """
        if always or self.counting:
            with self._lock:
                self.total += int(nbytes)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside the block nothing started on this thread is counted (nests)."""
        self._local.paused = getattr(self._local, "paused", 0) + 1
        try:
            yield
        finally:
            self._local.paused -= 1


class PendingExchange(abc.ABC):
    """A neighbour exchange in flight (see :meth:`Communicator.exchange_start`).

    Every handle of an operation in flight in this package has the same two verbs:
    ``done() -> bool`` (never blocks; may advance the operation; True once ``wait()`` would
    return at once) and ``wait()`` (blocks until complete, at most once; later calls return the
    same result).
    """

    @abc.abstractmethod
    def done(self) -> bool:
        """True once every expected message has arrived (never blocks)."""

    @abc.abstractmethod
    def wait(self) -> dict[int, Tensor]:
        """Block until complete; returns ``{source rank: received flat tensor}``."""


class PendingAverage:
    """An exact average that may still be in flight (see :meth:`Communicator.average_start`).

    Args:
        finish: completes the average in place (waits for it); None when it is already done.
        started: False when ``finish`` runs the whole collective (nothing is in flight yet).
        progress: advances the average without blocking and says whether ``finish`` would
            return at once (an average made of several collectives starts the next one there):
            what :meth:`done` asks; None: the transport cannot tell before waiting.

    Attributes:
        started: whether the collective is running (or done): False for a deferred average.
    """

    def __init__(
        self,
        finish: Callable[[], None] | None = None,
        started: bool = True,
        progress: Callable[[], bool] | None = None,
    ) -> None:
        self._finish = finish
        self._progress = progress
        self.started = started or finish is None

    def done(self) -> bool:
        """Never blocks: advance the average if it runs in stages (a compressed average starts
        its all-gather once its all-to-all is done), then say whether :meth:`wait` would return
        at once. False where the transport cannot tell before waiting. Call it between steps."""
        if self._finish is None:
            return True
        return self._progress is not None and self.started and self._progress()

    def wait(self) -> None:
        """Block until the tensors hold their averages (at most once; later calls return)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class PendingTensors:
    """Tensors that a collective in flight returns (see :meth:`Communicator.alltoall_flat_start`).

    Args:
        result: the finished tensors, or a function that waits for them.
        ready: never blocks; True once the function would return at once (None: unknown, say
            False until waited).
    """

    def __init__(
        self,
        result: list[Tensor] | Callable[[], list[Tensor]],
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self._finish = None if isinstance(result, list) else result
        self._result = result if isinstance(result, list) else None
        self._ready = ready

    def done(self) -> bool:
        """True once :meth:`wait` would not block."""
        return self._finish is None or (self._ready is not None and self._ready())

    def wait(self) -> list[Tensor]:
        """Block until the collective is complete and return its tensors (the same each call)."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        assert self._result is not None
        return self._result


class Communicator(abc.ABC):
    """Collective and point-to-point operations over the workers of one job.

    Attributes:
        rank: this worker's index in ``[0, size)``.
        size: the number of workers ``m``.
        bytes_sent: payload bytes this rank has put on the wire (:attr:`counter`'s total),
            counted when an operation starts, as a ring or direct algorithm sends them, with
            ``P`` the payload in bytes after the transport's own compression (a
            ``hvd.Compression.fp16`` payload counts 2 bytes an element), ``m`` the workers:

            * :meth:`average_` / :meth:`average_start` (allreduce): ``2 (m-1)/m * P``, ``P``
              the tensors' bytes (a ring's reduce-scatter plus all-gather);
            * :meth:`reduce_scatter_mean`: ``(m-1)/m * P``, ``P`` the flat tensors' bytes;
            * :meth:`allgather_flat`: ``(m-1)/m * P``, ``P`` the gathered result's bytes;
            * :meth:`alltoall_flat`: the bytes of the messages to the other workers;
            * :meth:`exchange_start`: the bytes of every message (one per destination);
            * :meth:`send_start`: the message's bytes (:meth:`recv_start` counts nothing);
            * object collectives (:meth:`allgather_object`, :meth:`broadcast_object`): not
              counted (control traffic); nothing is counted with one worker.

            Evaluation traffic is kept out with ``with comm.uncounted():``.
        counter: the :class:`ByteCounter` behind :attr:`bytes_sent`, shared with the other
            communicators of the same optimizer (:meth:`share_counter`).
        supports_sharding: :meth:`reduce_scatter_mean` and :meth:`allgather_flat` work
            (``shard_slow_state=True`` needs them).
        supports_alltoall: :meth:`alltoall_flat` and :meth:`allgather_flat` work (the
            compressed average, :mod:`hvd_slowmo.compression`, needs them).
        supports_exchange: :meth:`exchange_start` works (the gossip bases need it).
        supports_point_to_point: :meth:`send_start` and :meth:`recv_start` work, a message
            between two ranks that the others do not take part in (a straggler quorum needs
            them: :mod:`hvd_slowmo.exchange.quorum`).
        fuses_averages: the transport itself fuses averages started close together into one
            collective (Horovod's tensor fusion, every ``HOROVOD_CYCLE_TIME``), so the per-step
            gradient average starts each parameter's average as soon as its gradient is ready
            instead of waiting for a bucket of them (:mod:`hvd_slowmo.bases.gradient_buckets`).
        collectives_any_thread: collectives may be started from a second thread of this
            worker while its training thread starts others (the transport pairs them by name,
            or gives them an order of their own): a codec's average then runs on a thread of
            its own (:mod:`hvd_slowmo.compression.offload`).
        workers_share_process: the workers are threads of one process (thread workers,
            :mod:`hvd_slowmo.comm.local`), so they share autograd's device threads: the end of
            a backward pass, run there, must not wait for the other workers
            (:mod:`hvd_slowmo.bases.gradient_path`).
    """

    rank: int
    size: int
    supports_sharding: bool = False
    supports_alltoall: bool = False
    supports_exchange: bool = False
    supports_point_to_point: bool = False
    fuses_averages: bool = False
    collectives_any_thread: bool = False
    workers_share_process: bool = False
    _counter: ByteCounter | None = None

    # --- bytes on the wire ------------------------------------------------------------------
    @property
    def counter(self) -> ByteCounter:
        """The byte counter of this communicator (created on first use)."""
        if self._counter is None:
            self._counter = ByteCounter()
        return self._counter

    def share_counter(self, other: "Communicator") -> None:
        """Count this communicator's traffic in ``other``'s counter from now on (what was
        counted here before is not carried over).

        Args:
            other: the communicator whose counter to share.
        """
        self._counter = other.counter

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has put on the wire (the convention: the class docstring)."""
        return self.counter.total

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        self.counter.total = value

    def uncounted(self) -> contextlib.AbstractContextManager[None]:
        """``with comm.uncounted():`` the operations started inside are not counted in
        :attr:`bytes_sent` (nor in any communicator sharing its counter): for evaluation
        traffic such as :meth:`hvd_slowmo.DistributedOptimizer.use_consensus`."""
        return self.counter.paused()

    # --- the operations every communicator has -------------------------------------------
    def average_(self, tensors: Sequence[Tensor], name: str) -> None:
        """Replace each tensor, in place, by its exact average over all workers.

        Every worker must get bitwise identical results.

        Args:
            tensors: the tensors, in the same order and shapes on every worker.
            name: a label for the operation (used by Horovod's timeline).
        """
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return
        wire = self._average_(tensors, name)
        self.counter.add(2 * (self.size - 1) / self.size * wire)

    @abc.abstractmethod
    def _average_(self, tensors: list[Tensor], name: str) -> int:
        """:meth:`average_` for two or more workers and a non-empty list.

        Returns:
            The payload bytes handed to the transport (after any compression).
        """

    def average_start(self, tensors: Sequence[Tensor], name: str) -> PendingAverage:
        """Start :meth:`average_` without waiting for it: the tensors hold their averages once
        the returned handle's ``wait()`` returns, and must not be touched until then.

        Never waits for the other workers: every built-in transport hands the average to a
        background thread (Horovod's, torch.distributed's, the thread world's progress thread,
        the MPI communicator's averaging thread), so compute overlaps it and a gradient hook
        that starts it returns at once.

        Args:
            tensors: the tensors, in the same order and shapes on every worker.
            name: a label for the operation (Horovod matches collectives by it).
        """
        tensors = list(tensors)
        if self.size == 1 or not tensors:
            return PendingAverage()
        pending, wire = self._average_start(tensors, name)
        self.counter.add(2 * (self.size - 1) / self.size * wire)
        return pending

    def _average_start(self, tensors: list[Tensor], name: str) -> tuple[PendingAverage, int]:
        """:meth:`average_start` for two or more workers; returns (handle, payload bytes)."""
        return PendingAverage(), self._average_(tensors, name)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Gather one picklable object from every worker, in rank order.

        Args:
            obj: this worker's object.
        """
        return [obj] if self.size == 1 else self._allgather_object(obj)

    @abc.abstractmethod
    def _allgather_object(self, obj: Any) -> list[Any]:
        """:meth:`allgather_object` for two or more workers."""

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Return ``root_rank``'s object on every worker.

        Args:
            obj: the object (only the root's is used).
            root_rank: the worker whose object is sent (its rank in this communicator).
        """
        return obj if self.size == 1 else self._broadcast_object(obj, root_rank)

    @abc.abstractmethod
    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        """:meth:`broadcast_object` for two or more workers."""

    # --- sharding (supports_sharding) ----------------------------------------------------
    def reduce_scatter_mean(self, flats: Sequence[Tensor], name: str) -> list[Tensor]:
        """Average flat tensors over all workers and return this worker's shard of each average.

        Each 1-D tensor of ``n`` elements is split as :func:`shard_range` says (Horovod's
        reducescatter split). Used by ``shard_slow_state=True``.

        Args:
            flats: 1-D tensors, in the same order, dtypes and lengths on every worker.
            name: a label for the operation (used by Horovod's timeline).
        """
        flats = list(flats)
        if not flats:
            return []
        if self.size == 1:
            return [f.clone() for f in flats]
        out, wire = self._reduce_scatter_mean(flats, name)
        self.counter.add((self.size - 1) / self.size * wire)
        return out

    def _reduce_scatter_mean(self, flats: list[Tensor], name: str) -> tuple[list[Tensor], int]:
        """:meth:`reduce_scatter_mean` for two or more workers; returns (shards, payload bytes)."""
        raise NotImplementedError(f"{type(self).__name__} does not support reduce_scatter_mean")

    def allgather_flat(self, shards: Sequence[Tensor], name: str) -> list[Tensor]:
        """Concatenate every worker's 1-D shards in rank order (the inverse of
        :meth:`reduce_scatter_mean`).

        Every worker gets bitwise identical results.

        Args:
            shards: this worker's 1-D shard of each flat tensor (lengths may differ across workers).
            name: a label for the operation.
        """
        return self.allgather_flat_start(shards, name).wait()

    def allgather_flat_start(self, shards: Sequence[Tensor], name: str) -> PendingTensors:
        """Start :meth:`allgather_flat`; its ``wait()`` returns the concatenations. The shards
        must not change until then. Transports without background progress finish it here.

        Args:
            shards: this worker's 1-D shard of each flat tensor.
            name: a label for the operation.
        """
        shards = list(shards)
        if not shards:
            return PendingTensors([])
        if self.size == 1:
            return PendingTensors([s.clone() for s in shards])
        pending = self._allgather_flat_start(shards, name)
        counted = self.counter.counting  # the result's size is known at the end: count it then

        def finish() -> list[Tensor]:
            out = pending.wait()
            if counted:
                # Ring all-gather: each worker forwards everyone's shards but its successor's.
                self.counter.add((self.size - 1) / self.size * _nbytes(out), always=True)
            return out

        return PendingTensors(finish, pending.done)

    def _allgather_flat_start(self, shards: list[Tensor], name: str) -> PendingTensors:
        """:meth:`allgather_flat_start` for two or more workers and a non-empty list."""
        return PendingTensors(self._allgather_flat(shards, name))

    def _allgather_flat(self, shards: list[Tensor], name: str) -> list[Tensor]:
        """:meth:`allgather_flat` for two or more workers (transports that finish at once)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support allgather_flat: a communicator with "
            "supports_alltoall or supports_sharding implements _allgather_flat or "
            "_allgather_flat_start"
        )

    # --- all-to-all (supports_alltoall) --------------------------------------------------
    def alltoall_flat(
        self, sends: Sequence[Tensor], recv_numels: Sequence[int], name: str
    ) -> list[Tensor]:
        """Send ``sends[j]`` to worker ``j``; return what every worker sent this one, in rank order.

        Args:
            sends: one 1-D tensor per worker, this worker's own included, all of one dtype;
                lengths may differ.
            recv_numels: the length of the message from each worker (both sides know it in
                advance; MPI posts its receives with it); a mismatch raises.
            name: a label for the operation (Horovod matches collectives by it).
        """
        return self.alltoall_flat_start(sends, recv_numels, name).wait()

    def alltoall_flat_start(
        self, sends: Sequence[Tensor], recv_numels: Sequence[int], name: str
    ) -> PendingTensors:
        """Start :meth:`alltoall_flat`; its ``wait()`` returns the received tensors. The sends
        must not change until then. Transports without background progress finish it here.

        Args:
            sends: as for :meth:`alltoall_flat`.
            recv_numels: as for :meth:`alltoall_flat`.
            name: as for :meth:`alltoall_flat`.
        """
        sends = list(sends)
        recv_numels = [int(n) for n in recv_numels]
        if len(sends) != self.size or len(recv_numels) != self.size:
            raise ValueError(
                f"alltoall_flat: need one message and one receive length per worker "
                f"({self.size}), got {len(sends)} and {len(recv_numels)}"
            )
        if len({s.dtype for s in sends}) != 1 or any(s.dim() != 1 for s in sends):
            raise ValueError("alltoall_flat: the messages must be 1-D tensors of one dtype")
        if self.size == 1:
            return PendingTensors([sends[0].clone()])
        pending = self._alltoall_flat_start(sends, recv_numels, name)
        # Direct sends: everything but this worker's message to itself goes on the wire.
        self.counter.add(_nbytes([s for j, s in enumerate(sends) if j != self.rank]))

        def finish() -> list[Tensor]:
            out = pending.wait()
            got = [t.numel() for t in out]
            if got != recv_numels:
                raise RuntimeError(
                    f"alltoall_flat {name!r}: rank {self.rank} expected {recv_numels} elements "
                    f"from each rank, got {got} (the workers disagree on the message sizes)"
                )
            return out

        return PendingTensors(finish, pending.done)

    def _alltoall_flat_start(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> PendingTensors:
        """:meth:`alltoall_flat_start` for two or more workers, with checked arguments."""
        return PendingTensors(self._alltoall_flat(sends, recv_numels, name))

    def _alltoall_flat(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> list[Tensor]:
        """:meth:`alltoall_flat` for two or more workers (transports that finish at once)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support alltoall_flat: a communicator with "
            "supports_alltoall = True implements _alltoall_flat or _alltoall_flat_start"
        )

    # --- neighbour exchanges (supports_exchange) -----------------------------------------
    def exchange_start(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None = None,
    ) -> PendingExchange:
        """Start a neighbour exchange: send ``sends[dst]`` to each ``dst``, receive one message
        from each rank of ``recv_from``.

        All messages of one exchange are flat 1-D tensors of the same dtype and length.

        Args:
            sends: ``{destination rank: flat tensor}``, at least one; the tensors must not change
                until the exchange completes.
            recv_from: the ranks this worker receives one message from.
            tag: unique per exchange (the gossip bases use ``step * groups + group``),
                identical on every worker for one exchange.
            graph_key: identifies the global graph of this exchange, identical on every rank;
                transports that build per-graph state (MPI distributed-graph communicators)
                cache it under this key, the others ignore it.
        """
        if not sends:
            # Horovod's alltoall and MPI's neighbour collectives are entered by every rank with
            # a buffer of the message dtype; with nothing to send this rank would not know it.
            raise ValueError(
                f"{type(self).__name__}.exchange_start: sends is empty; every rank must "
                "send at least one message per exchange"
            )
        lengths = {t.numel() for t in sends.values()}
        if len(lengths) != 1:
            raise ValueError(
                "exchange_start: all messages of one exchange must have one length, "
                f"got {sorted(lengths)}"
            )
        pending = self._exchange_start(sends, recv_from, tag, graph_key)
        self.counter.add(_nbytes(list(sends.values())))
        return pending

    def _exchange_start(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None,
    ) -> PendingExchange:
        """:meth:`exchange_start` with checked arguments."""
        raise NotImplementedError(f"{type(self).__name__} does not support gossip exchanges")

    def exchange(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None = None,
    ) -> dict[int, Tensor]:
        """Blocking form of :meth:`exchange_start`."""
        return self.exchange_start(sends, recv_from, tag, graph_key).wait()

    # --- point to point (supports_point_to_point) ----------------------------------------
    def send_start(self, tensor: Tensor, dst: int, tag: int) -> PendingExchange:
        """Start sending ``tensor`` to rank ``dst`` alone (the other ranks take no part).

        Args:
            tensor: a contiguous tensor; it must not change until the handle is done.
            dst: the receiving rank (not this one).
            tag: pairs the message with the receiver's :meth:`recv_start` of the same tag.
        """
        self._check_peer("send_start", dst)
        pending = self._send_start(tensor, dst, tag)
        self.counter.add(_nbytes([tensor]))
        return pending

    def recv_start(self, like: Tensor, src: int, tag: int) -> PendingExchange:
        """Start receiving one message from rank ``src``; its handle's ``wait()`` returns
        ``{src: tensor}``.

        Args:
            like: a tensor of the message's shape and dtype (not written).
            src: the sending rank (not this one).
            tag: the sender's tag.
        """
        self._check_peer("recv_start", src)
        return self._recv_start(like, src, tag)

    def _check_peer(self, what: str, peer: int) -> None:
        if not self.supports_point_to_point:
            raise NotImplementedError(
                f"{type(self).__name__} has no point-to-point messages ({what}): use "
                "torch.distributed (torchrun) or thread workers"
            )
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(
                f"{what}: peer {peer} must be another rank in [0, {self.size}), not {self.rank}"
            )

    def _send_start(self, tensor: Tensor, dst: int, tag: int) -> PendingExchange:
        """:meth:`send_start` with checked arguments."""
        raise NotImplementedError

    def _recv_start(self, like: Tensor, src: int, tag: int) -> PendingExchange:
        """:meth:`recv_start` with checked arguments."""
        raise NotImplementedError
