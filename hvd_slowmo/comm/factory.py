"""Which transport carries what: every choice between Horovod, MPI and threads is made here.

The optimizer asks for the communicator of the exact average (:func:`default_communicator`),
for the two levels of ``worker="node"`` (:func:`horovod_node_hierarchy`), and the gossip bases
ask for the transport of their neighbour exchanges (:func:`gossip_transport`). Nothing outside
:mod:`hvd_slowmo.comm` names a concrete communicator (SlowMo: arXiv 1910.00643).
"""

import logging
import os
from typing import Any

from ..hierarchy import Hierarchy, node_groups
from ..validation import check_choice
from .base import Communicator
from .horovod import HorovodCommunicator, check_compression

__all__ = [
    "GOSSIP_TRANSPORTS",
    "default_communicator",
    "gossip_transport",
    "horovod_node_hierarchy",
    "worker_hierarchy",
]

log = logging.getLogger("hvd_slowmo")

#: Values of the gossip bases' ``gossip_transport`` option.
GOSSIP_TRANSPORTS = ("auto", "mpi", "horovod")
_logged_choice = False


def default_communicator(communicator: Communicator | None, compression: Any) -> Communicator:
    """The communicator of the exact average: ``communicator`` if given, else Horovod's.

    Args:
        communicator: the user's communicator, or None.
        compression: ``hvd.Compression`` for the Horovod communicator's payload, or None.

    Raises:
        TypeError: ``communicator`` is not a :class:`Communicator`, or ``compression`` is not a
            ``hvd.Compression``.
        ValueError: ``compression`` together with a user's communicator.
    """
    check_compression(compression)
    if communicator is None:
        return HorovodCommunicator(compression=compression)
    if not isinstance(communicator, Communicator):
        raise TypeError(
            f"communicator must be a hvd_slowmo.comm.Communicator, got "
            f"{type(communicator).__name__}; leave it out to use Horovod's"
        )
    if compression is not None:
        raise ValueError(
            "compression is applied by the default Horovod communicator; "
            "pass compression to your communicator instead"
        )
    return communicator


def worker_hierarchy(worker: Any, communicator: Communicator | None) -> Hierarchy | None:
    """The two levels of a hierarchical run, or None when every process is a worker.

    Args:
        worker: ``"process"``, ``"node"`` (built from Horovod's host layout: collective) or a
            :class:`~hvd_slowmo.hierarchy.Hierarchy`.
        communicator: the user's communicator, or None (Horovod).
    """
    if isinstance(worker, Hierarchy):
        return worker
    check_choice("worker", worker, ("process", "node"), "or a hvd_slowmo.hierarchy.Hierarchy")
    if worker == "process":
        return None
    if communicator is not None:
        raise ValueError(
            "worker='node' builds Horovod process sets; with your own communicator pass "
            "worker=Hierarchy(node=..., cross=...) instead"
        )
    return horovod_node_hierarchy()


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
    import horovod.torch as hvd

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


def gossip_transport(comm: Communicator, choice: str, cuda: bool, label: str) -> Communicator:
    """The communicator that carries a gossip base's neighbour exchanges.

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
    mpi_launch = is_hvd and comm.mpi_launch
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
