"""Which transport carries what: every choice between Horovod, torch.distributed, MPI and
threads is made here.

The optimizer asks for the communicator of the exact average (:func:`default_communicator`,
over the engine :func:`choose_engine` picks), for the two levels of ``worker="node"``
(:func:`worker_hierarchy`), and the gossip bases ask for the transport of their neighbour
exchanges (:func:`gossip_transport`). Nothing outside :mod:`hvd_slowmo.comm` names a concrete
communicator (SlowMo: arXiv 1910.00643).
"""

import logging
import os
import sys
from typing import Any

from ..validation import check_choice
from .base import Communicator
from .hierarchy import Hierarchy, node_groups
from .horovod import HorovodCommunicator, check_compression

__all__ = [
    "ENGINES",
    "GOSSIP_TRANSPORTS",
    "choose_engine",
    "default_communicator",
    "gossip_transport",
    "horovod_node_hierarchy",
    "island_communicators",
    "torch_node_hierarchy",
    "worker_hierarchy",
]

log = logging.getLogger("hvd_slowmo")

#: Values of the gossip bases' ``gossip_transport`` option.
GOSSIP_TRANSPORTS = ("auto", "mpi", "horovod")
#: Values of ``DistributedOptimizer(engine=...)``: who carries the default communicator.
ENGINES = ("auto", "horovod", "torch")
_logged_choice = False


def _horovod_initialized() -> bool:
    # Only a Horovod the user imported counts: importing it here would load its MPI/Gloo runtime
    # into torchrun jobs (and fail where Horovod is not installed).
    hvd = sys.modules.get("horovod.torch")
    return hvd is not None and bool(hvd.is_initialized())


def choose_engine(engine: str) -> str:
    """``"horovod"`` or ``"torch"``: the engine of the default communicator.

    ``"auto"``: Horovod where ``hvd.init()`` has run (the default of this package), else
    torch.distributed where a default process group exists (``torchrun`` +
    ``init_process_group``), else Horovod if it was imported (it then says to call ``hvd.init()``).

    Args:
        engine: ``"auto"``, ``"horovod"`` or ``"torch"``.

    Raises:
        ValueError: ``"auto"`` with neither engine initialized, or an unknown value.
    """
    from .torchdist import torch_distributed_ready

    check_choice("engine", engine, ENGINES)
    if engine != "auto":
        return engine
    if _horovod_initialized():
        return "horovod"
    if torch_distributed_ready():
        return "torch"
    if sys.modules.get("horovod.torch") is not None:
        return "horovod"
    raise ValueError(
        "engine='auto' found no initialized engine: under torchrun call "
        "torch.distributed.init_process_group() first, under horovodrun call hvd.init() first "
        "(or pass communicator=...)"
    )


def default_communicator(
    communicator: Communicator | None, compression: Any, engine: str = "auto"
) -> Communicator:
    """The communicator of the exact average: ``communicator`` if given, else one over the
    engine :func:`choose_engine` picks.

    Args:
        communicator: the user's communicator, or None.
        compression: the payload's compression for the default communicator, or None:
            ``hvd.Compression.none``/``fp16`` (either engine) or ``"fp16"`` (torch.distributed).
        engine: ``"auto"``, ``"horovod"`` or ``"torch"`` (ignored with a user's communicator).

    Raises:
        TypeError: ``communicator`` is not a :class:`Communicator`, or ``compression`` is not a
            compression of the chosen engine.
        ValueError: ``compression`` together with a user's communicator; an elastic Horovod
            launch on the torch.distributed engine.
    """
    if communicator is None:
        if choose_engine(engine) == "torch":
            from ..elastic import is_elastic_launch
            from .torchdist import TorchDistCommunicator

            if is_elastic_launch():
                raise ValueError(
                    "elastic training (horovodrun --min-np/--max-np) needs the Horovod engine: "
                    "call hvd.init() or pass engine='horovod'; under torchrun, restart from a "
                    "checkpoint instead (torchrun --max-restarts, see README)"
                )
            return TorchDistCommunicator(compression=compression)
        return HorovodCommunicator(compression=check_compression(compression))
    check_compression(compression)
    if not isinstance(communicator, Communicator):
        raise TypeError(
            f"communicator must be a hvd_slowmo.comm.Communicator, got "
            f"{type(communicator).__name__}; leave it out to use the engine's default"
        )
    if compression is not None:
        raise ValueError(
            "compression is applied by the default communicator; "
            "pass compression to your communicator instead"
        )
    return communicator


def worker_hierarchy(
    worker: Any, communicator: Communicator | None, comm: Communicator | None = None
) -> Hierarchy | None:
    """The two levels of a hierarchical run, or None when every process is a worker. Both
    levels count their bytes in ``comm``'s counter (:meth:`Communicator.share_counter`), so
    ``comm.bytes_sent`` is everything this rank sends.

    Args:
        worker: ``"process"``, ``"node"`` (built from the host layout of ``comm``'s engine:
            collective) or a :class:`~hvd_slowmo.comm.hierarchy.Hierarchy`.
        communicator: the user's communicator, or None.
        comm: the communicator of the exact average (:func:`default_communicator`); None or a
            Horovod one builds Horovod process sets, a torch.distributed one builds sub-groups.
    """
    if isinstance(worker, Hierarchy):
        hierarchy = worker
    else:
        check_choice(
            "worker", worker, ("process", "node"), "or a hvd_slowmo.comm.hierarchy.Hierarchy"
        )
        if worker == "process":
            return None
        if communicator is not None:
            raise ValueError(
                "worker='node' builds Horovod process sets; with your own communicator pass "
                "worker=Hierarchy(node=..., cross=...) instead"
            )
        from .torchdist import TorchDistCommunicator

        if isinstance(comm, TorchDistCommunicator):
            hierarchy = torch_node_hierarchy(comm)
        else:
            hierarchy = horovod_node_hierarchy()
    if comm is not None:
        for level in (hierarchy.node, hierarchy.cross):
            if level is not comm:
                level.share_counter(comm)
    return hierarchy


def island_communicators(
    islands: Any, communicator: Communicator | None, compression: Any, engine: str
) -> tuple[Communicator, Communicator, Communicator]:
    """The communicators of ``worker=Islands(mesh)``, over the mesh's process groups.

    Args:
        islands: the :class:`~hvd_slowmo.islands.Islands`.
        communicator: the user's communicator: must be None (the mesh decides the groups).
        compression: the payload's compression of the outer exchange's allreduce, or None.
        engine: must be ``"auto"`` or ``"torch"``: islands run over torch.distributed.

    Returns:
        ``(across, inside, world)``: this rank's shard peers in the other islands (the outer
        step's), its own island's ranks, and every rank of the job (the settings check's).

    Raises:
        ValueError: a ``communicator``, or ``engine="horovod"``.
    """
    from .torchdist import TorchDistCommunicator

    if communicator is not None:
        raise ValueError(
            "worker=Islands(mesh) builds its communicators from the mesh; leave communicator "
            "out (it is None by default)"
        )
    if engine == "horovod":
        raise ValueError(
            "worker=Islands(mesh) runs over torch.distributed (the mesh's process groups), not "
            "Horovod: launch with torchrun and pass engine='auto' or 'torch'. Under horovodrun "
            "use worker='node' with a model every rank holds whole (docs/islands.md)"
        )
    across, inside = islands.groups()
    outer = TorchDistCommunicator(group=across, compression=compression)
    island = TorchDistCommunicator(group=inside)
    world = TorchDistCommunicator()
    for level in (island, world):
        level.share_counter(outer)
    return outer, island, world


_PROCESS_SETS: dict[tuple[int, ...], Any] = {}


def _process_set(hvd: Any, ranks: list[int]) -> Any:
    """Horovod's process set over ``ranks``, created once per job (creation is collective)."""
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    key = tuple(ranks)
    if key not in _PROCESS_SETS:
        _PROCESS_SETS[key] = hvd.add_process_set(list(ranks))
    return _PROCESS_SETS[key]


def horovod_node_hierarchy() -> Hierarchy:
    """Build the node and cross-node communicators of ``worker="node"`` from Horovod's host
    layout. Collective.

    Needs dynamic process sets: ``hvd.init(process_sets="dynamic")`` (or
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` in the environment before ``hvd.init()``).
    """
    from .horovod import _hvd

    hvd = _hvd()
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") in ("0", ""):
        raise ValueError(
            "worker='node' creates Horovod process sets after hvd.init(): call "
            "hvd.init(process_sets='dynamic') (or set HOROVOD_DYNAMIC_PROCESS_SETS=1), or "
            "pass worker=Hierarchy(node=..., cross=...) built from your own process sets"
        )
    layout = hvd.allgather_object((hvd.cross_rank(), hvd.local_rank()), name="hvd_slowmo.layout")
    nodes, peers = node_groups(layout)
    # Every rank adds every set in the same order: process-set creation is a collective.
    node_sets = [_process_set(hvd, ranks) for ranks in nodes]
    peer_sets = [_process_set(hvd, ranks) for ranks in peers]
    mine = hvd.rank()
    node_set = next(ps for ps, ranks in zip(node_sets, nodes) if mine in ranks)
    peer_set = next(ps for ps, ranks in zip(peer_sets, peers) if mine in ranks)
    return Hierarchy(
        node=HorovodCommunicator(process_set=node_set),
        cross=HorovodCommunicator(process_set=peer_set),
    )


_GROUPS: dict[tuple[int, ...], Any] = {}


def _node_layout() -> tuple[Any, int]:
    """This rank's (node, local rank) as its launcher says: torchrun's ``GROUP_RANK`` (the node
    index, which also tells emulated nodes on one host apart) and ``LOCAL_RANK``; without them
    the host name, and -1 for a local rank to be numbered in rank order on each host."""
    if "GROUP_RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    import socket

    return socket.gethostname(), -1


def torch_node_hierarchy(comm: Communicator) -> Hierarchy:
    """Build the node and cross-node communicators of ``worker="node"`` as
    ``torch.distributed.new_group`` sub-groups. Collective over every rank of the job.

    Args:
        comm: the torch.distributed communicator over every rank of the job.
    """
    import torch.distributed as dist

    from .torchdist import TorchDistCommunicator

    if comm.size != dist.get_world_size():
        raise ValueError(
            "worker='node' over torch.distributed builds sub-groups of the whole job: the "
            f"communicator has {comm.size} of {dist.get_world_size()} ranks"
        )
    raw = comm.allgather_object(_node_layout())
    keys = list(dict.fromkeys(node for node, _ in raw))  # node index by first appearance
    seen: dict[Any, int] = {}
    layout = []
    for node, local in raw:
        if local < 0:  # no launcher numbering: number the ranks of each host in rank order
            local = seen[node] = seen.get(node, -1) + 1
        layout.append((keys.index(node), local))
    nodes, peers = node_groups(layout)
    # new_group is collective over the whole job: every rank creates every group, in one order.
    for ranks in nodes + peers:
        if tuple(ranks) not in _GROUPS:
            _GROUPS[tuple(ranks)] = dist.new_group(ranks)
    mine = dist.get_rank()
    node = next(r for r in nodes if mine in r)
    peer = next(r for r in peers if mine in r)
    return Hierarchy(
        node=TorchDistCommunicator(group=_GROUPS[tuple(node)]),
        cross=TorchDistCommunicator(group=_GROUPS[tuple(peer)]),
    )


def gossip_transport(comm: Communicator, choice: str, cuda: bool, label: str) -> Communicator:
    """The communicator that carries a gossip base's neighbour exchanges (its bytes are counted
    in ``comm``'s counter).

    ``"auto"``: MPI neighbour collectives under an MPI launch with CPU tensors (the same ranks as
    Horovod's, checked), otherwise ``comm``'s own exchange (Horovod ``alltoall``, threads).

    Args:
        comm: the base's communicator.
        choice: ``"auto"``, ``"mpi"`` or ``"horovod"`` (the ``gossip_transport`` option).
        cuda: whether the parameters are CUDA tensors.
        label: the base's name, for messages.

    Raises:
        ValueError: a choice that ``comm`` cannot serve, or a ``comm`` without exchanges.
    """
    from .mpi import MPICommunicator  # mpi4py is imported only where MPI is used

    if isinstance(comm, MPICommunicator):
        if choice == "horovod":
            raise ValueError(
                "gossip_transport='horovod' needs the Horovod communicator, but an "
                "MPICommunicator was passed; use gossip_transport='mpi' or 'auto'"
            )
        return comm
    is_hvd = isinstance(comm, HorovodCommunicator)
    mpi_launch = isinstance(comm, HorovodCommunicator) and comm.mpi_launch
    if choice == "horovod" and not is_hvd:
        raise ValueError(
            f"gossip_transport='horovod' needs the Horovod communicator, got "
            f"{type(comm).__name__}; use gossip_transport='auto'"
        )
    if choice == "mpi" and not mpi_launch:
        raise ValueError(
            "gossip_transport='mpi' needs an MPI launch (horovodrun --mpi or mpirun): "
            "under Gloo mpi4py sees a world of one process; use gossip_transport='auto' "
            "or 'horovod'"
        )
    use_mpi = choice == "mpi" or (choice == "auto" and mpi_launch and not cuda)
    transport = MPICommunicator.for_horovod(comm) if use_mpi else comm
    if transport is not comm:
        transport.share_counter(comm)  # the gossip's bytes count in the base's counter
    if not transport.supports_exchange:
        raise ValueError(
            f"base={label!r} exchanges messages with its neighbours, which "
            f"{type(transport).__name__} cannot (supports_exchange is False); use the "
            "Horovod, MPI or thread communicator"
        )
    global _logged_choice
    if choice == "auto" and not _logged_choice and comm.rank == 0:
        why = (
            "an MPI launch with CPU tensors"
            if use_mpi
            else "CUDA tensors"
            if mpi_launch
            else "no MPI launch"
            if is_hvd
            else "the given communicator"
        )
        log.info(
            "hvd_slowmo: gossip for base=%r goes over %s (%s)",
            label,
            "MPI neighbour collectives" if use_mpi else type(transport).__name__,
            why,
        )
        _logged_choice = True
    return transport
