"""Islands: SlowMo between groups of ranks that train one model together inside them.

A user past a billion parameters does not replicate the model on every GPU: inside a node (or a
rack) the ranks shard it with FSDP2 (``fully_shard``) or replicate it with DDP, and only the
links *between* those groups are slow. Each such group is an *island*, and one island is one
SlowMo worker (arXiv 1910.00643): inside it the user's own data-parallel training runs every
step; across islands the outer step runs every ``tau`` steps.

The layout is a 2-D ``DeviceMesh``: one dimension across islands (``across``, e.g.
``"islands"``) and one inside them (FSDP's shard dimension, or DDP's). The outer step works on
each rank's *local* tensors (``DTensor.to_local()``) and exchanges them with the ranks that hold
the same shard in the other islands: the mesh's ``across`` group. So the anchor, the slow buffer
or outer optimizer state, the codec's residual and the eager shares are sharded like the model
(``1/S`` of the unsharded state for ``S`` shards), and an unsharded (DDP) island is the same code
with ``S = 1``. Every rank of an island runs the same outer schedule (the settings are compared
over the whole job), so the island's shards move together.

:func:`local` and :class:`LocalViews` are the only places where a distributed tensor becomes a
local one: every tensor the outer step reads or writes goes through them, and plain tensors pass
through unchanged (bit for bit the same run as before islands existed).
"""

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import torch
from torch import Tensor

__all__ = ["Islands", "LocalViews", "is_distributed_tensor", "local"]

#: The bases that run between islands. Local SGD/Adam(W) is the base the islands were made for
#: (nothing is communicated between outer steps); AR-SGD across FSDP islands is what FSDP2's own
#: HSDP already does (``fully_shard`` on a 2-D mesh), and the gossip bases are not tested on
#: shards.
ISLAND_BASES = ("localsgd",)


_DTENSOR: list[type] = []  # the DTensor class, imported once (the outer step asks per tensor)


def is_distributed_tensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (FSDP2, tensor parallel)."""
    if type(t) is Tensor or type(t) is torch.nn.Parameter or not isinstance(t, Tensor):
        return False  # the common case, decided without an import
    if not _DTENSOR:
        if not torch.distributed.is_available():
            return False
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return isinstance(t, _DTENSOR[0])


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: a DTensor's local shard (the tensor FSDP2 keeps, so writing
    into it changes the parameter), any other tensor itself.

    Args:
        t: a parameter, a gradient or an optimizer buffer.
    """
    if is_distributed_tensor(t):
        # Outside autograd to_local() hands back the DTensor's own local tensor (no copy, the
        # same object every call), so in-place updates land in the parameter.
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined]
    return t


class LocalViews(Sequence[Tensor]):
    """The parameters as the outer step sees them: each one's local tensor, looked up at every
    access (FSDP2 may replace a parameter's local tensor, e.g. at its lazy initialisation or a
    ``load_state_dict``, so a view taken once could go stale).

    Args:
        params: the optimizer's parameters, in the index order used on every rank; the list is
            kept (not copied), so parameters added to it later are seen.
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.keys = params

    @overload
    def __getitem__(self, i: int) -> Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[Tensor]: ...
    def __getitem__(self, i: int | slice) -> Tensor | list[Tensor]:
        if isinstance(i, slice):
            return [local(p) for p in self.keys[i]]
        return local(self.keys[i])

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator[Tensor]:
        return (local(p) for p in self.keys)


def local_groups(param_groups: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups with each parameter replaced by its local tensor (the other entries,
    such as ``lr``, shared)."""
    return [dict(g, params=[local(p) for p in g["params"]]) for g in param_groups]


class Islands:
    """What one SlowMo worker is with ``worker=Islands(mesh)``: an island of ranks.

    Inside an island the user's FSDP2 (``fully_shard(module, mesh=mesh[inner])``) or DDP trains
    every step; the outer step runs across islands, each rank with the ranks holding its shard
    in the other islands. Needs ``torch.distributed`` (``torchrun``).

    Args:
        mesh: a 2-D ``torch.distributed.device_mesh.DeviceMesh`` over every rank of the job, with
            dimension names, e.g. ``init_device_mesh("cuda", (2, 8), mesh_dim_names=("islands",
            "shard"))``: 2 islands of 8 ranks.
        across: the name of the dimension across islands; the other one is inside them.

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: a mesh that is not 2-D, has no dimension names, does not name ``across``, or
            does not cover every rank of the job.
    """

    def __init__(self, mesh: Any, across: str = "islands") -> None:
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"Islands(mesh=...) takes a torch.distributed.device_mesh.DeviceMesh, got "
                f"{type(mesh).__name__}; build one with init_device_mesh(device, (islands, "
                "ranks_per_island), mesh_dim_names=('islands', 'shard'))"
            )
        names = mesh.mesh_dim_names
        if mesh.ndim != 2 or not names:
            raise ValueError(
                f"Islands(mesh=...) needs a 2-D mesh with dimension names (one across islands, "
                f"one inside them), got a {mesh.ndim}-D mesh with names {names}; pass "
                "init_device_mesh(device, (islands, ranks_per_island), "
                "mesh_dim_names=('islands', 'shard'))"
            )
        if across not in names:
            raise ValueError(
                f"Islands(across={across!r}) is not a dimension of the mesh {tuple(names)}; "
                "name the dimension that runs across islands"
            )
        world = torch.distributed.get_world_size()
        if mesh.size() != world:
            raise ValueError(
                f"Islands(mesh=...) covers {mesh.size()} ranks, the job has {world}: the mesh "
                "must hold every rank (islands x ranks per island = world size)"
            )
        self.mesh = mesh
        self.across = across
        self.inside = next(n for n in names if n != across)
        self._dims = tuple(names)

    @property
    def count(self) -> int:
        """The number of islands (SlowMo workers)."""
        return int(self.mesh.size(self._dims.index(self.across)))

    @property
    def index(self) -> int:
        """This rank's island (its coordinate across islands)."""
        return int(self.mesh.get_local_rank(self.across))

    @property
    def ranks_per_island(self) -> int:
        """The number of ranks inside each island."""
        return int(self.mesh.size(self._dims.index(self.inside)))

    def groups(self) -> tuple[Any, Any]:
        """``(across, inside)``: this rank's process group across islands (its shard's peers) and
        the one of its own island."""
        return self.mesh.get_group(self.across), self.mesh.get_group(self.inside)

    def check_params(
        self, params: Sequence[Tensor], names: Sequence[str], base: str, nonfinite: str
    ) -> None:
        """Refuse parameters and settings that islands cannot run, before any state exists.

        Args:
            params: the optimizer's parameters.
            names: their names, for messages.
            base: the base algorithm's name.
            nonfinite: the ``nonfinite`` setting.

        Raises:
            ValueError: a base other than those in :data:`ISLAND_BASES`; ``nonfinite="skip"``
                (each shard's peers would decide alone whether to skip); a model whose
                parameters are partly sharded (a parameter outside every ``fully_shard``ed
                module would be trained by each rank alone); a DTensor on another mesh than
                the island's dimension of ``mesh``.
        """
        if base not in ISLAND_BASES:
            raise ValueError(
                f"base={base!r} with worker=Islands(...): islands run {ISLAND_BASES} between "
                "them; for a per-step gradient average across FSDP islands use FSDP2's HSDP "
                "(fully_shard on a 2-D mesh) instead of hvd_slowmo"
            )
        if nonfinite == "skip":
            raise ValueError(
                "nonfinite='skip' with worker=Islands(...) is not supported: the ranks holding "
                "one shard decide on their own shard, so an island could skip half its model; "
                "use nonfinite='raise' (the default) and restart from a checkpoint"
            )
        sharded = [is_distributed_tensor(p) for p in params]
        if any(sharded) and not all(sharded):
            plain = [n for n, s in zip(names, sharded) if not s]
            more = "..." if len(plain) > 5 else ""
            raise ValueError(
                f"worker=Islands(...): parameters {plain[:5]}{more} are not sharded while the "
                "others are DTensors: they sit outside every fully_shard()ed module, so each "
                "rank would train its own copy. Call fully_shard() on the root module too (after "
                "its submodules), or wrap the whole model in DDP instead"
            )
        inner = self.mesh[self.inside]
        for n, p in zip(names, params):
            if is_distributed_tensor(p) and p.device_mesh != inner:  # type: ignore[attr-defined]
                raise ValueError(
                    f"worker=Islands(...): parameter {n!r} is sharded over the mesh "
                    f"{p.device_mesh}, not the island's dimension {self.inside!r} of the "  # type: ignore[attr-defined]
                    f"islands' mesh; shard it with fully_shard(module, mesh=mesh[{self.inside!r}])"
                )
