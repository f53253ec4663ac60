"""The sharded exchange: the sharded slow state's reduce-scatter (each rank receives its shard
of the average; the slow update then all-gathers the new anchor into the parameters:
:mod:`hvd_slowmo.slow_state.sharded`)."""

from ..comm.base import Communicator, PendingAverage
from ..slow_state import ShardedSlowState
from .base import Exchange, Payload

__all__ = ["ShardedExchange"]


class ShardedExchange(Exchange):
    """The average that :class:`~hvd_slowmo.slow_state.ShardedSlowState` consumes.

    It runs when the handle is waited for (``started`` is False): the reduce-scatter's result
    is the layout's own until its slow update, so it cannot be in flight across base steps.

    Args:
        comm: the communicator over all workers.
        slow_state: the sharded slow state.
    """

    name = "sharded"
    unsupported = ShardedSlowState.unsupported

    def __init__(self, comm: Communicator, slow_state: ShardedSlowState) -> None:
        super().__init__(comm)
        self.slow_state = slow_state

    def start(self, payload: Payload, exact: bool) -> PendingAverage:
        p = payload
        return PendingAverage(
            lambda: self.slow_state.average_(p.params, p.extra, exact, p.indices), started=False
        )
