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
"""

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .base import Communicator, PendingExchange

__all__ = ["MPICommunicator"]

#: Distributed-graph communicators kept per MPICommunicator; the oldest is freed beyond this
#: (every rank sees the same key sequence, so every rank frees the same one at the same call).
MAX_CACHED_GRAPHS = 64


def _offsets(counts: list[int]) -> list[int]:
    """Displacements of consecutive blocks of ``counts`` elements."""
    out = [0]
    for c in counts[:-1]:
        out.append(out[-1] + c)
    return out


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
    ) -> None:
        self._request, self._sources, self._recv, self._chunk = request, sources, recv, chunk
        self._send: Tensor | None = send  # MPI reads it until completion: keep it alive
        self._device = device  # set when the receive buffer is a host staging copy
        self._result: dict[int, Tensor] | None = None

    def done(self) -> bool:
        # MPI_Test also drives MPI's progress engine for this request.
        return self._result is not None or bool(self._request.Test())

    def wait(self) -> dict[int, Tensor]:
        if self._result is None:
            self._request.Wait()
            self._send = None
            recv = self._recv if self._device is None else self._recv.to(self._device)
            self._result = {
                src: recv[i * self._chunk : (i + 1) * self._chunk]
                for i, src in enumerate(self._sources)
            }
        return self._result


class MPICommunicator(Communicator):
    """Collectives and neighbour exchanges over an MPI communicator.

    Args:
        comm: an ``mpi4py`` communicator (default ``COMM_WORLD``); it is duplicated, so this
            object's traffic never matches anyone else's.
        cuda_aware: the MPI library accepts CUDA device buffers (else they are staged on the host).

    Raises:
        RuntimeError: MPI was initialized without ``MPI_THREAD_MULTIPLE``.
    """

    supports_alltoall = True
    supports_exchange = True

    def __init__(self, comm: Any = None, cuda_aware: bool = False) -> None:
        MPI = _mpi()
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError(
                "MPI gossip needs MPI_THREAD_MULTIPLE (Horovod's background thread uses MPI "
                "concurrently); unset HOROVOD_MPI_THREADS_DISABLE or use gossip_transport='horovod'"
            )
        self._comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
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

    # --- collectives (for completeness of the interface; the gossip bases only exchange) ------
    def _average_(self, tensors: list[Tensor], name: str) -> int:
        MPI = _mpi()
        for t in tensors:
            # Reduce at one root then broadcast: every rank gets the root's bits exactly (an
            # allreduce may round differently on different ranks).
            host = t.detach().to("cpu", copy=True).contiguous()
            buf = host.view(-1).numpy()
            self._comm.Reduce(
                MPI.IN_PLACE if self.rank == 0 else buf,
                buf if self.rank == 0 else None,
                op=MPI.SUM,
                root=0,
            )
            self._comm.Bcast(buf, root=0)
            t.copy_(host.div_(self.size))
        return sum(t.numel() * t.element_size() for t in tensors)

    def _allgather_object(self, obj: Any) -> list[Any]:
        return self._comm.allgather(obj)

    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        return self._comm.bcast(obj, root=root_rank)

    def _alltoall_flat(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> list[Tensor]:
        # Staged through host memory like _average_: a collective of the outer step, where the
        # copy is small next to the wire time.
        send = torch.cat([s.detach().to("cpu") for s in sends])
        recv = torch.empty(sum(recv_numels), dtype=send.dtype)
        etype = self._elem_type(send.element_size())
        counts = [s.numel() for s in sends]
        self._comm.Alltoallv(
            [self._buffer(send), (counts, _offsets(counts)), etype],
            [self._buffer(recv), (recv_numels, _offsets(recv_numels)), etype],
        )
        return [t.to(sends[0].device) for t in recv.split(recv_numels)]

    def _allgather_flat(self, shards: list[Tensor], name: str) -> list[Tensor]:
        out = []
        for shard in shards:
            host = shard.detach().to("cpu").contiguous()
            counts = self._comm.allgather(host.numel())
            recv = torch.empty(sum(counts), dtype=host.dtype)
            etype = self._elem_type(host.element_size())
            self._comm.Allgatherv(
                [self._buffer(host), etype], [self._buffer(recv), (counts, _offsets(counts)), etype]
            )
            out.append(recv.to(shard.device))
        return out

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
        return _NeighborExchange(request, list(sources), recv, chunk, send, device)

    @staticmethod
    def _buffer(t: Tensor) -> Any:
        if t.is_cuda:
            return t  # CUDA-aware MPI: mpi4py reads __cuda_array_interface__ / DLPack
        return t.view(torch.uint8).numpy()
