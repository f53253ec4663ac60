"""SlowMo's slow state (arXiv 1910.00643, Algorithm 1, lines 6-8): the anchor ``x_{t,0}`` and the
slow buffer ``u_t`` or an outer optimizer, kept whole on every worker (:mod:`.full`) or sharded
across workers (:mod:`.sharded`), behind one interface (:mod:`.base`)."""

from ..comm.base import Communicator
from ..config import SlowMoConfig
from ..timing import PhaseTimer
from .base import LoadedSlowState, SlowState
from .full import FullSlowState
from .sharded import ShardedSlowState

__all__ = ["FullSlowState", "LoadedSlowState", "ShardedSlowState", "SlowState", "make_slow_state"]


def make_slow_state(comm: Communicator, config: SlowMoConfig, timer: PhaseTimer) -> SlowState:
    """The slow state that ``config`` asks for (``shard_slow_state``), over ``comm``.

    Args:
        comm: the communicator of the exact average.
        config: the optimizer's configuration.
        timer: the optimizer's phase timer (a layout books its collectives to ``"average"``).
    """
    return (ShardedSlowState if config.shard_slow_state else FullSlowState)(comm, config, timer)
