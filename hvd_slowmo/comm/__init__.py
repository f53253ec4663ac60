"""Transports: Horovod (default), MPI neighbour collectives, and in-process threads for tests."""
from .base import Communicator, PendingExchange

__all__ = ["Communicator", "PendingExchange"]
