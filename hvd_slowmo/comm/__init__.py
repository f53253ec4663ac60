"""Transports: the Communicator interface (base), Horovod, torch.distributed (torchdist), MPI
neighbour collectives, in-process threads for tests, and the factory that chooses among them.
Only the interface is imported here: the transports import Horovod or mpi4py lazily, and the
factory imports them."""

from .base import Communicator, PendingExchange

__all__ = ["Communicator", "PendingExchange"]
