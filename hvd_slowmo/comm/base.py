"""The communicator interface that the algorithms talk to.

The optimizer never calls Horovod or MPI directly: it is handed a :class:`Communicator`, so the
same algorithm runs over Horovod (:mod:`hvd_slowmo.comm.horovod`), MPI neighbour collectives
(:mod:`hvd_slowmo.comm.mpi`) or in-process threads (:mod:`hvd_slowmo.comm.local`, for tests).
"""
import abc
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence

from torch import Tensor

__all__ = ["Communicator", "PendingExchange"]


class PendingExchange(abc.ABC):
    """A neighbour exchange in flight (see :meth:`Communicator.exchange_start`)."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once every expected message has arrived (never blocks)."""

    @abc.abstractmethod
    def wait(self) -> Dict[int, Tensor]:
        """Block until complete; returns ``{source rank: received flat tensor}``."""


class Communicator(abc.ABC):
    """Collective and point-to-point operations over the workers of one job.

    Attributes:
        rank: this worker's index in ``[0, size)``.
        size: the number of workers ``m``.
        bytes_sent: payload bytes this worker has handed to the transport so far (allreduce
            payloads count at the ring volume ``2 (m-1)/m`` times their size).
    """

    rank: int
    size: int
    bytes_sent: int = 0

    @abc.abstractmethod
    def average_(self, tensors: Sequence[Tensor], name: str) -> None:
        """Replace each tensor, in place, by its exact average over all workers.

        Every worker must get bitwise identical results.

        Args:
            tensors: the tensors, in the same order and shapes on every worker.
            name: a label for the operation (used by Horovod's timeline).
        """

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> List[Any]:
        """Gather one picklable object from every worker, in rank order.

        Args:
            obj: this worker's object.
        """

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Return ``root_rank``'s object on every worker.

        Args:
            obj: the object (only the root's is used).
            root_rank: the worker whose object is sent.
        """

    def reduce_scatter_mean(self, flats: Sequence[Tensor], name: str) -> List[Tensor]:
        """Average flat tensors over all workers and return this worker's shard of each average.

        Each 1-D tensor of ``n`` elements is split as Horovod 0.28.1 splits a reducescatter:
        worker ``r`` gets ``[start, end)`` of :func:`hvd_slowmo.sharded.shard_range` (``n // m``
        elements, one more for ranks below ``n % m``). Used by ``shard_slow_state=True``.

        Args:
            flats: 1-D tensors, in the same order, dtypes and lengths on every worker.
            name: a label for the operation (used by Horovod's timeline).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support reduce_scatter_mean")

    def allgather_flat(self, shards: Sequence[Tensor], name: str) -> List[Tensor]:
        """Concatenate every worker's 1-D shards in rank order: the inverse of :meth:`reduce_scatter_mean`.

        Every worker gets bitwise identical results.

        Args:
            shards: this worker's 1-D shard of each flat tensor (lengths may differ across workers).
            name: a label for the operation.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support allgather_flat")

    def exchange_start(self, sends: Mapping[int, Tensor], recv_from: Sequence[int], tag: int,
                       graph_key: Optional[Hashable] = None) -> PendingExchange:
        """Start a neighbour exchange: send ``sends[dst]`` to each ``dst``, receive from ``recv_from``.

        All messages of one exchange are flat 1-D tensors of the same dtype and length.

        Args:
            sends: ``{destination rank: flat tensor}``; the tensors must not change until
                the exchange completes.
            recv_from: the ranks this worker receives one message from.
            tag: unique per exchange (the gossip bases use ``step * groups + group``),
                identical on every worker for one exchange.
            graph_key: identifies the global graph of this exchange, identical on every rank;
                transports that build per-graph state (MPI distributed-graph communicators)
                cache it under this key, the others ignore it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support gossip exchanges")

    def exchange(self, sends: Mapping[int, Tensor], recv_from: Sequence[int], tag: int,
                 graph_key: Optional[Hashable] = None) -> Dict[int, Tensor]:
        """Blocking form of :meth:`exchange_start`."""
        return self.exchange_start(sends, recv_from, tag, graph_key).wait()
