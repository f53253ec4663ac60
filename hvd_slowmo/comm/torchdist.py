"""The communicator over ``torch.distributed``: for processes started by ``torchrun`` (or any
launcher) after ``torch.distributed.init_process_group`` (SlowMo: arXiv 1910.00643).

Gloo carries CPU tensors and NCCL CUDA tensors (``init_process_group("cpu:gloo,cuda:nccl")``
gives both); the collectives run on the process group passed in (default: the whole job), so a
``torch.distributed.new_group`` sub-group works as well (``worker="node"``).

* exact average: one ``all_reduce`` (sum) per dtype and device over a flat copy, then a division
  by ``m`` on every rank. Gloo's and NCCL's ring allreduce reduce each element on one rank and
  hand that rank's bits to all, so the results are bitwise identical everywhere (checked by the
  tests); the summation order depends on the element's position in the ring, so for ``m >= 3``
  the bits may differ from Horovod's (whose fusion buffer lays the tensors out differently).
* reduce-scatter / all-gather (``shard_slow_state=True``), for the uneven split of
  :func:`~hvd_slowmo.comm.base.shard_range`: ``all_to_all_single`` with per-rank splits, then a
  sum in rank order and a division (the split Gloo's and NCCL's ``reduce_scatter`` do not take;
  the same volume as a reduce-scatter, and the same arithmetic as Horovod's CPU default); the
  gather pads every rank's shards to the longest and trims.
* gossip: point-to-point ``isend``/``irecv`` (one ``batch_isend_irecv`` per exchange, which NCCL
  needs to pair sends with receives). Gloo's send/receive handles only learn they are complete
  inside ``wait()``, so for CPU tensors a daemon thread waits for them and ``done()`` reads its
  flag: the gossip bases' deadlines (``gossip_timeout``) then work as under Horovod.

A failed or timed-out collective (the process group's ``timeout``) is re-raised with this
rank's number and the operation's name.
"""

import contextlib
import datetime
import pickle
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..divide import div_
from .base import Communicator, PendingAverage, PendingExchange, filled, joined, shard_range
from .deadline import collective_timeout
from .serial import join_at_exit

__all__ = ["FP16", "TorchDistCommunicator", "broadcast_parameters", "torch_distributed_ready"]


def torch_distributed_ready() -> bool:
    """True when ``torch.distributed`` has a default process group."""
    return dist.is_available() and dist.is_initialized()


class FP16:
    """fp16 compression of the parameters' allreduce (as ``hvd.Compression.fp16``): the payload
    travels as float16, the result is cast back. Pass it as ``compression=FP16``; the codec
    ``codec="fp16"`` compresses the pseudo-gradient of the outer exchange instead
    (:mod:`hvd_slowmo.compression`)."""

    @staticmethod
    def compress(t: Tensor) -> tuple[Tensor, torch.dtype]:
        return t.to(torch.float16), t.dtype

    @staticmethod
    def decompress(t: Tensor, ctx: torch.dtype) -> Tensor:
        return t.to(ctx)


def _compression(value: Any) -> Any:
    """The compressor of ``value``: None (no compression), ``"none"``, ``"fp16"``, or an object
    with ``compress``/``decompress`` such as ``hvd.Compression.fp16``."""
    if value is None or value == "none":
        return None
    if value == "fp16":
        return FP16
    if callable(getattr(value, "compress", None)) and callable(getattr(value, "decompress", None)):
        return value
    raise TypeError(f"compression must be None, 'none', 'fp16' or a hvd.Compression, got {value!r}")


def _rethrow(rank: int, what: str, error: BaseException) -> None:
    """Re-raise a backend error with the rank and the operation (a Gloo timeout names neither)."""
    raise RuntimeError(
        f"hvd_slowmo over torch.distributed: rank {rank}: {what} failed: {error} (a peer may "
        "have died or stalled; the process group's timeout is set by "
        "init_process_group(timeout=...))"
    ) from error


def _flat_groups(tensors: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Tensor indices by (device, dtype): one flat buffer, hence one collective, per key."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


class _P2PExchange(PendingExchange):
    """One exchange's sends and receives in flight."""

    def __init__(
        self,
        works: list[Any],
        recvs: dict[int, Tensor],
        sends: list[Tensor],
        rank: int,
        what: str,
    ) -> None:
        self._works, self._recvs, self._rank, self._what = works, recvs, rank, what
        self._sends: list[Tensor] | None = sends  # read by the backend until completion
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._waiter: threading.Thread | None = None
        if not any(t.is_cuda for t in recvs.values()):
            # Gloo's send/recv works report is_completed() only after wait(): wait off-thread.
            self._waiter = threading.Thread(target=self._wait_all, daemon=True)
            self._waiter.start()
            join_at_exit(self._waiter)  # a wait still in torch at exit would abort the process

    def _wait_all(self) -> None:
        try:
            for w in self._works:
                w.wait()
        except BaseException as e:  # handed to the caller's thread by wait()
            self._error = e
        self._finished.set()

    def done(self) -> bool:
        if self._waiter is not None:
            return self._finished.is_set()
        return all(w.is_completed() for w in self._works)  # NCCL: reads CUDA events

    def wait(self) -> dict[int, Tensor]:
        try:
            if self._waiter is not None:
                self._finished.wait()
            else:
                for w in self._works:
                    w.wait()
        except RuntimeError as e:
            _rethrow(self._rank, self._what, e)
        if self._error is not None:
            _rethrow(self._rank, self._what, self._error)
        self._sends = None
        return self._recvs


class TorchDistCommunicator(Communicator):
    """``torch.distributed`` collectives over one process group.

    Args:
        group: the process group (default: the default group, every rank of the job).
        compression: ``"fp16"`` (or ``hvd.Compression.fp16``) sends the exact average's payload as
            float16 and casts the result back to each tensor's dtype; float64 tensors are never
            compressed (they carry exact counts). None or ``"none"``: no compression.
        timeout: seconds a wait for an average lasts (``Work.wait(timeout)``) before it raises
            a ``RuntimeError`` naming this rank and the average; None: the process group's own
            timeout (``init_process_group(timeout=...)``, which bounds every collective);
            ``"env"`` (default): from ``HVD_SLOWMO_COLLECTIVE_TIMEOUT`` (unset: None).

    Raises:
        RuntimeError: no default process group (call ``torch.distributed.init_process_group``).
    """

    supports_sharding = True
    supports_alltoall = True
    supports_exchange = True
    supports_point_to_point = True

    def __init__(
        self, group: Any = None, compression: Any = None, timeout: float | str | None = "env"
    ) -> None:
        if not torch_distributed_ready():
            raise RuntimeError(
                "TorchDistCommunicator needs torch.distributed initialized: launch with torchrun "
                "and call torch.distributed.init_process_group() first"
            )
        self.compression = _compression(compression)
        self.timeout = collective_timeout(timeout)
        # Work.wait's timeout: zero means the process group's own.
        self._wait_timeout = datetime.timedelta(seconds=self.timeout or 0)
        self.group = group
        #: Global rank of every rank of the group, in group-rank order.
        self.members: list[int] = (
            list(range(dist.get_world_size()))
            if group is None
            else dist.get_process_group_ranks(group)
        )
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_rank = dist.get_rank()

    @contextlib.contextmanager
    def _named(self, what: str) -> Iterator[None]:
        """Re-raise a backend error with this rank's number and ``what`` failed."""
        try:
            yield
        except RuntimeError as e:
            _rethrow(self.global_rank, what, e)

    # --- exact average ---------------------------------------------------------------------
    def _average_(self, tensors: list[Tensor], name: str) -> int:
        pending, wire = self._average_start(tensors, name)
        pending.wait()
        return wire

    def _average_start(self, tensors: list[Tensor], name: str) -> tuple[PendingAverage, int]:
        # One flat buffer per (device, dtype): one collective each, as Horovod's fusion buffer.
        started = []
        wire = 0
        for idx in _flat_groups(tensors).values():
            dtype = tensors[idx[0]].dtype
            flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
            squeeze = self.compression is not None and dtype != torch.float64
            payload, ctx = self.compression.compress(flat) if squeeze else (flat, None)
            with self._named(f"average {name!r}"):
                work = dist.all_reduce(payload, group=self.group, async_op=True)
            started.append((idx, payload, ctx, squeeze, work))
            wire += payload.numel() * payload.element_size()

        def finish() -> None:
            for idx, payload, ctx, squeeze, work in started:
                with self._named(f"average {name!r}"):
                    work.wait(self._wait_timeout)
                total = self.compression.decompress(payload, ctx) if squeeze else payload
                mean = div_(total, self.size)
                views = mean.split([tensors[i].numel() for i in idx])
                for i, v in zip(idx, views):
                    tensors[i].copy_(v.view_as(tensors[i]))

        return PendingAverage(finish), wire

    # --- objects -------------------------------------------------------------------------
    # Pickled bytes in uint8 tensors, by hand: torch's all_gather_object/broadcast_object_list
    # convert through numpy, which torch does not depend on (a torch-only install has none).
    def _byte_device(self) -> torch.device:
        if dist.get_backend(self.group) == "nccl":  # a CUDA-only group carries CUDA tensors
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _allgather_object(self, obj: Any) -> list[Any]:
        device = self._byte_device()
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], device=device)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        with self._named("allgather_object"):
            dist.all_gather(sizes, size, group=self.group)
            lengths = [int(n) for n in torch.cat(sizes).tolist()]
            padded = torch.cat([data, data.new_zeros(max(lengths) - data.numel())])
            gathered = [torch.empty_like(padded) for _ in range(self.size)]
            dist.all_gather(gathered, padded, group=self.group)
        return [pickle.loads(bytes(g[:n].tolist())) for g, n in zip(gathered, lengths)]

    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        device = self._byte_device()
        src = self.members[root_rank]  # torch names the root by its global rank
        mine = self.rank == root_rank
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if mine else None
        size = torch.tensor([data.numel() if data is not None else 0], device=device)
        with self._named("broadcast_object"):
            dist.broadcast(size, src=src, group=self.group)
            buf = (
                data.to(device)
                if data is not None
                else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            )
            dist.broadcast(buf, src=src, group=self.group)
        return obj if mine else pickle.loads(bytes(buf.tolist()))

    # --- sharding ------------------------------------------------------------------------
    def _reduce_scatter_mean(self, flats: list[Tensor], name: str) -> tuple[list[Tensor], int]:
        m = self.size
        ranges = [[shard_range(f.numel(), r, m) for r in range(m)] for f in flats]
        out: list[Tensor | None] = [None] * len(flats)
        wire = 0
        for idx in _flat_groups(flats).values():
            # Destination-major: every rank's shard of every flat of this dtype, rank 0 first.
            send = torch.cat(
                [
                    flats[i].detach()[ranges[i][r][0] : ranges[i][r][1]]
                    for r in range(m)
                    for i in idx
                ]
            )
            per_dest = [sum(ranges[i][r][1] - ranges[i][r][0] for i in idx) for r in range(m)]
            mine = [ranges[i][self.rank][1] - ranges[i][self.rank][0] for i in idx]
            recv = send.new_empty(m * sum(mine))
            with self._named(f"reduce_scatter {name!r}"):
                dist.all_to_all_single(
                    recv,
                    send,
                    output_split_sizes=[sum(mine)] * m,
                    input_split_sizes=per_dest,
                    group=self.group,
                )
            wire += send.numel() * send.element_size()
            for chunk in recv.view(m, sum(mine)):  # rank order
                for i, part in zip(idx, chunk.split(mine)):
                    # Summed in rank order and divided: the same on every rank, as Horovod's
                    # alltoall reduce-scatter and the thread communicator.
                    acc = out[i]  # None before the first source's chunk
                    out[i] = part.clone() if acc is None else acc.add_(part)
        return [div_(t, m) for t in filled(out)], wire

    def _allgather_flat(self, shards: list[Tensor], name: str) -> list[Tensor]:
        m = self.size
        # The lengths travel on the shards' device: the backend that carries them carries these.
        lengths = torch.tensor([s.numel() for s in shards], device=shards[0].device)
        everyone = [torch.empty_like(lengths) for _ in range(m)]
        with self._named(f"allgather {name!r}"):
            dist.all_gather(everyone, lengths, self.group)
        counts = torch.stack(everyone).cpu()  # [rank, shard]
        out: list[Tensor | None] = [None] * len(shards)
        for idx in _flat_groups(shards).values():
            dtype, size = shards[idx[0]].dtype, shards[idx[0]].element_size()
            per_rank = counts[:, idx].sum(1).tolist()
            longest = max(per_rank)
            # As bytes: every dtype travels (a compressed average gathers int8 or fp8 codes).
            packed = torch.cat([shards[i].detach() for i in idx]).view(torch.uint8)
            padded = torch.cat([packed, packed.new_zeros(longest * size - packed.numel())])
            gathered = [torch.empty_like(padded) for _ in range(m)]
            with self._named(f"allgather {name!r}"):
                dist.all_gather(gathered, padded, self.group)
            pieces: list[list[Tensor]] = [[] for _ in idx]
            for r in range(m):
                values = gathered[r][: per_rank[r] * size].view(dtype)
                for j, part in enumerate(values.split(counts[r, idx].tolist())):
                    pieces[j].append(part)
            for j, i in enumerate(idx):
                out[i] = torch.cat(pieces[j])
        return filled(out)

    # --- all-to-all (a compressed average) -------------------------------------------------
    def _alltoall_flat(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> list[Tensor]:
        dtype, size = sends[0].dtype, sends[0].element_size()
        # As bytes: every dtype travels (int8 and fp8 codes, bf16), on every backend.
        send = joined([s.detach().reshape(-1) for s in sends]).view(torch.uint8)
        recv = send.new_empty(sum(recv_numels) * size)
        with self._named(f"alltoall {name!r}"):
            dist.all_to_all_single(
                recv,
                send,
                output_split_sizes=[n * size for n in recv_numels],
                input_split_sizes=[s.numel() * size for s in sends],
                group=self.group,
            )
        return list(recv.view(dtype).split(recv_numels))

    # --- gossip --------------------------------------------------------------------------
    def _exchange_start(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None,
    ) -> PendingExchange:
        first = next(iter(sends.values()))
        chunk = first.numel()
        # Peers are ranks of this group; torch's point-to-point names global ranks.
        ops = [
            dist.P2POp(dist.isend, sends[d], self.members[d], self.group, tag)
            for d in sorted(sends)
        ]
        recvs = {s: first.new_empty(chunk) for s in sorted(recv_from)}
        ops += [
            dist.P2POp(dist.irecv, buf, self.members[s], self.group, tag)
            for s, buf in recvs.items()
        ]
        with self._named(f"gossip exchange {tag}"):
            works = dist.batch_isend_irecv(ops)
        return _P2PExchange(
            works, recvs, list(sends.values()), self.global_rank, f"gossip exchange {tag}"
        )

    # --- point to point ------------------------------------------------------------------
    def _send_start(self, tensor: Tensor, dst: int, tag: int) -> PendingExchange:
        what = f"message to rank {dst} (tag {tag})"
        with self._named(what):
            work = dist.isend(tensor, self.members[dst], group=self.group, tag=tag)
        return _P2PExchange([work], {}, [tensor], self.global_rank, what)

    def _recv_start(self, like: Tensor, src: int, tag: int) -> PendingExchange:
        what = f"message from rank {src} (tag {tag})"
        buf = torch.empty_like(like)
        with self._named(what):
            work = dist.irecv(buf, self.members[src], group=self.group, tag=tag)
        return _P2PExchange([work], {src: buf}, [], self.global_rank, what)


def broadcast_parameters(
    tensors: Mapping[str, Tensor] | Sequence[Tensor], root_rank: int = 0, group: Any = None
) -> None:
    """Give every rank ``root_rank``'s values of ``tensors``, in place (the torch.distributed
    counterpart of ``hvd.broadcast_parameters``). Collective.

    Args:
        tensors: a ``state_dict()`` or a sequence of tensors, the same on every rank.
        root_rank: the rank whose values are sent (its rank in ``group``).
        group: the process group (default: every rank).
    """
    values = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
    src = root_rank if group is None else dist.get_global_rank(group, root_rank)
    with torch.no_grad():
        for t in values:
            dist.broadcast(t, src=src, group=group)
