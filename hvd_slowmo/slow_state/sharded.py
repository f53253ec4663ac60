"""The sharded slow state (ZeRO-1 style) of SlowMo's outer step (arXiv 1910.00643, Algorithm 1,
lines 6-8).

Unsharded, every worker keeps the whole anchor ``x_{t,0}`` and slow buffer ``u_t``: twice the
parameters. Sharded, the parameters of each (param group, dtype, device) are viewed as one flat
vector (a *bucket*), each bucket is cut into ``m`` contiguous shards, and worker ``r`` keeps only
shard ``r`` of the anchor and of the slow buffer: ``2/m`` times the parameters. The outer step is

1. reduce-scatter of the flat parameters with a mean: worker ``r`` gets shard ``r`` of ``x_avg``;
2. the slow update of that shard alone (heavy-ball, Nesterov, or a custom torch optimizer built
   over the anchor shards): the update is per element, so it is the same arithmetic as unsharded;
3. all-gather of the new anchor shards into the parameters, which are then bitwise identical on
   every worker (each element was computed once, by its owner).

Reduce-scatter plus all-gather move the same volume as one ring allreduce, ``2 (m-1)/m`` times
the payload. Transient memory during the outer step only: a flat copy of the parameters, the
transport's buffers (Horovod's alltoall receive buffer, or its reducescatter fusion buffer: about
the parameters' size) and the gathered anchor (the parameters' size), so the peak is about 2x the
parameters above the persistent state for a moment; the persistent state is ``2/m`` x.

With streaming (``fragments=P``) each fragment owns one sharded slow state over its own
parameters, so a fragment's outer step reduce-scatters, updates and all-gathers its own buckets
only.

Shards follow Horovod 0.28.1's reducescatter split (:func:`hvd_slowmo.comm.base.shard_range`):
``n // m`` elements each, and one more for ranks ``0 .. n % m - 1``.
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..comm.base import Communicator, shard_range
from ..config import SlowMoConfig
from ..timing import PhaseTimer
from .base import LoadedSlowState, ParamGroups, SlowState

__all__ = ["Bucket", "ShardedSlowState", "make_buckets"]


@dataclass(frozen=True)
class Bucket:
    """Parameters flattened together: one param group, one dtype, one device.

    Attributes:
        group: the param group's index (its ``lr`` scales the slow update).
        indices: the parameters' positions in the fragment (its parameters in the
            optimizer's order).
        numel: total elements of the flat vector.
        start: this rank's shard start in the flat vector.
        end: this rank's shard end (exclusive).
    """

    group: int
    indices: tuple[int, ...]
    numel: int
    start: int
    end: int


def make_buckets(groups: Sequence[Sequence[Tensor]], rank: int, size: int) -> list[Bucket]:
    """Partition a fragment's parameters into buckets (per group, then per dtype and device, in
    order of first appearance) and give each this rank's shard range. Pure: reads only shapes,
    dtypes, devices.

    Args:
        groups: the fragment's parameters of each param group (empty for a group without any),
            in the optimizer's order.
        rank: this rank.
        size: the number of ranks.
    """
    buckets: list[Bucket] = []
    index = 0
    for g, params in enumerate(groups):
        by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        numel: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in params:
            key = (p.dtype, p.device)
            by_kind.setdefault(key, []).append(index)
            numel[key] = numel.get(key, 0) + p.numel()
            index += 1
        for key, indices in by_kind.items():
            start, end = shard_range(numel[key], rank, size)
            buckets.append(Bucket(g, tuple(indices), numel[key], start, end))
    return buckets


def _flatten(params: Sequence[Tensor], bucket: Bucket) -> Tensor:
    return torch.cat([params[i].reshape(-1) for i in bucket.indices])


def _unflatten_into_(params: Sequence[Tensor], bucket: Bucket, flat: Tensor) -> None:
    targets = [params[i] for i in bucket.indices]
    pieces = torch.split(flat, [t.numel() for t in targets])
    torch._foreach_copy_(targets, [piece.view(t.shape) for piece, t in zip(pieces, targets)])


def _by_group(params: list[Tensor], groups: list[int]) -> list[list[Tensor]]:
    """The parameters of each param group, up to the last group with any."""
    out: list[list[Tensor]] = [[] for _ in range(max(groups, default=-1) + 1)]
    for p, g in zip(params, groups):
        out[g].append(p)
    return out


class ShardedSlowState(SlowState):
    """This rank's shards of a fragment's anchor and slow state (one shard per bucket), and the
    sharded outer step.

    A custom outer optimizer is built over the anchor shards (one tensor per bucket), so it
    must be per-element (SGD, Adam, ...): one that uses per-tensor norms (LARS, LAMB) would see
    bucket shards instead of parameters.

    Args:
        comm: the communicator of the exact average; it must support sharding
            (``reduce_scatter_mean`` and ``allgather_flat``).
        config: the optimizer's configuration.
        timer: the optimizer's phase timer (the all-gather of the new anchor is averaging time).

    Raises:
        TypeError: ``comm`` does not support sharding.
    """

    per_rank = True
    layout = "sharded"
    setting, alternative = "shard_slow_state=True", "shard_slow_state=False"
    unsupported: ClassVar[dict[str, str]] = {
        "eager": "the provisional slow step reads each parameter's anchor and slow buffer, and "
        "each rank holds only its shard of them",
        "codec": "the compressed average sends pseudo-gradients, which need the whole anchor on "
        "every worker",
        "merge": "the weight's tally would land in one rank's shard of the reduce-scatter",
        "period": "the step times' tally would land in one rank's shard of the reduce-scatter",
        "hierarchy": "its reduce-scatter over every rank is its own exchange; drop one of "
        "shard_slow_state and hierarchical",
    }

    def __init__(self, comm: Communicator, config: SlowMoConfig, timer: PhaseTimer) -> None:
        if not comm.supports_sharding:
            raise TypeError(
                "shard_slow_state=True needs a communicator with reduce_scatter_mean() "
                f"and allgather_flat(); {type(comm).__name__} has none (supports_sharding "
                "is False): use the Horovod or thread communicator"
            )
        super().__init__(comm, config, timer)
        self.buckets: list[Bucket] | None = None  # set at capture (the first step)

    def _layout(self, params: list[Tensor], groups: list[int]) -> list[Bucket]:
        return make_buckets(_by_group(params, groups), self.comm.rank, self.comm.size)

    @torch.no_grad()
    def capture_(self, params: list[Tensor], groups: list[int]) -> None:
        if self.captured:
            return
        buckets = self._layout(params, groups)
        self.buckets = buckets
        self._start(
            [_flatten(params, b)[b.start : b.end].clone() for b in buckets],
            [b.group for b in buckets],
        )

    @torch.no_grad()
    def add_(self, params: list[Tensor], groups: list[int]) -> None:
        if not self.captured:
            return  # captured with every group at the first step
        assert self.buckets is not None
        buckets = self._layout(params, groups)
        new = buckets[len(self.buckets) :]  # the new group's: the last group's buckets come last
        self.buckets = buckets
        self._extend([_flatten(params, b)[b.start : b.end].clone() for b in new], groups[-1])

    @torch.no_grad()
    def average_(self, params: list[Tensor], extra: list[Tensor], exact: bool) -> None:
        """The exact average as this layout needs it (:class:`hvd_slowmo.exchange.ShardedExchange`
        calls it): a reduce-scatter of each bucket, this rank's shard of the average written into
        its range of ``params`` (the other ranges keep this worker's values), and an allreduce of
        the model buffers. Collective.

        The shard lives in ``params`` (the outer step's ``sent``), not in this object: a state
        saved between the average and the landing carries it, and :meth:`update_` reads it from
        there in the same process or a new one.

        Args:
            params: the fragment's parameters (detached); this rank's ranges are overwritten
                with the average.
            extra: other tensors averaged in place (floating-point model buffers).
            exact: whether the parameters need averaging (False: they are identical on every
                rank, like AR-SGD's: each rank's range already is the average).
        """
        assert self.buckets is not None, "the anchor is captured at the first step"
        if extra:
            self.comm.average_(extra, name="hvd_slowmo.exact_average")
        if not exact:
            return
        flats = [_flatten(params, b) for b in self.buckets]
        shards = self.comm.reduce_scatter_mean(flats, name="hvd_slowmo.sharded_average")
        for flat, shard, b in zip(flats, shards, self.buckets):
            flat[b.start : b.end] = shard
            _unflatten_into_(params, b, flat)

    @torch.no_grad()
    def update_(self, params: list[Tensor], param_groups: ParamGroups) -> None:
        assert self.buckets is not None
        averages = [_flatten(params, b)[b.start : b.end] for b in self.buckets]
        self._slow_update_(averages, param_groups)
        del averages
        with self.timer("average"):  # communication, though inside the slow update
            self._gather_anchor_into_(params)

    @torch.no_grad()
    def restore_(self, params: list[Tensor]) -> None:
        self._gather_anchor_into_(params)  # all-gathers the fragment's full anchor

    def _gather_anchor_into_(self, params: Sequence[Tensor]) -> None:
        assert self.buckets is not None and self.anchor is not None, (
            "the anchor is captured at the first step"
        )
        full = self.comm.allgather_flat(list(self.anchor), name="hvd_slowmo.sharded_anchor")
        for b, flat in zip(self.buckets, full):
            if flat.numel() != b.numel:
                raise RuntimeError(
                    f"sharded anchor: gathered {flat.numel()} elements for a bucket of {b.numel}"
                )
            _unflatten_into_(params, b, flat)

    def check_world(self, old_world: tuple[int, int], why: str) -> None:
        if old_world != (self.comm.rank, self.comm.size):
            raise RuntimeError(
                f"hvd_slowmo: {why}: this worker changed from rank {old_world[0]} of "
                f"{old_world[1]} to rank {self.comm.rank} of {self.comm.size}, but "
                "shard_slow_state=True splits the anchor and slow buffer by rank and "
                "cannot reshard them; use shard_slow_state=False for elastic training"
            )

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shards and the layout they belong to (rank, size, shard ranges)."""
        return {
            "layout": self.layout,
            "rank": self.comm.rank,
            "size": self.comm.size,
            "buckets": None if self.buckets is None else [asdict(b) for b in self.buckets],
            "anchor_shards": None if self.anchor is None else list(self.anchor),
            "slow_buffer_shards": None if self.slow_buffer is None else list(self.slow_buffer),
            "outer_optimizer": None
            if self.outer_optimizer is None
            else self.outer_optimizer.state_dict(),
        }

    def prepare_load(
        self,
        saved: dict[str, Any],
        params: list[Tensor],
        groups: list[int],
        position: dict[str, Any],
        names: list[str],
    ) -> LoadedSlowState:
        state, inner_step = saved, position["inner_step"]
        if state.get("layout") != self.layout:
            raise ValueError(
                "load_state_dict: the state has no shard of the slow state (it was saved "
                "with shard_slow_state=False); load it with shard_slow_state=False"
            )
        if state.get("size") != self.comm.size:
            raise ValueError(
                f"load_state_dict: the sharded slow state was saved by {state.get('size')} "
                f"workers, this job has {self.comm.size}; a sharded state cannot be "
                f"resharded: resume with {state.get('size')} workers"
            )
        if state.get("rank") != self.comm.rank:
            raise ValueError(
                f"load_state_dict: this is rank {state.get('rank')}'s shard, loaded on rank "
                f"{self.comm.rank}; with shard_slow_state=True every rank loads the state it saved"
            )
        if state.get("buckets") is None:
            if inner_step > 0:
                raise ValueError(
                    "load_state_dict: the sharded state has no anchor but was saved "
                    "inside an outer step"
                )
            return LoadedSlowState(anchor=None)
        layout = self._layout(params, groups)
        if [asdict(b) for b in layout] != [
            dict(b, indices=tuple(b["indices"])) for b in state["buckets"]
        ]:
            raise ValueError(
                "load_state_dict: the saved shard layout (param groups, dtypes, sizes) "
                "differs from this optimizer's: the state comes from another model or "
                "param groups"
            )
        anchor = self._load_shards(state.get("anchor_shards"), layout, params, "anchor_shards")
        buffer = None
        if not self.config.custom_outer:
            buffer = self._load_shards(
                state.get("slow_buffer_shards"), layout, params, "slow_buffer_shards"
            )
        slow, outer = self._load_slow(buffer, state.get("outer_optimizer"), anchor)
        return LoadedSlowState(
            anchor=anchor,
            slow_buffer=slow,
            outer_optimizer=outer,
            groups=[b.group for b in layout],
            layout=layout,
        )

    @staticmethod
    def _load_shards(
        saved: Any, layout: list[Bucket], params: list[Tensor], key: str
    ) -> list[Tensor]:
        if not isinstance(saved, list) or len(saved) != len(layout):
            raise ValueError(
                f"load_state_dict: '{key}' is missing or has the wrong number of shards"
            )
        out = []
        for b, t in zip(layout, saved):
            if not isinstance(t, Tensor) or tuple(t.shape) != (b.end - b.start,):
                raise ValueError(
                    f"load_state_dict: a shard of '{key}' has shape "
                    f"{getattr(t, 'shape', None)}, expected ({b.end - b.start},): a damaged state"
                )
            ref = params[b.indices[0]]
            out.append(t.detach().to(ref.device, ref.dtype).clone())
        return out

    def commit_load(self, loaded: LoadedSlowState) -> None:
        super().commit_load(loaded)
        self.buckets = loaded.layout
