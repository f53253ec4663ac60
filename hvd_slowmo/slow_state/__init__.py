"""SlowMo's slow state (arXiv 1910.00643, Algorithm 1, lines 6-8): the anchor ``x_{t,0}`` and the
slow buffer ``u_t`` or an outer optimizer, of one fragment, kept whole on every worker
(:mod:`.full`) or sharded across workers (:mod:`.sharded`), behind one interface (:mod:`.base`)."""

from ..comm.base import Communicator
from ..config import SlowMoConfig
from ..timing import PhaseTimer
from .base import LoadedSlowState, SlowState
from .full import FullSlowState
from .sharded import ShardedSlowState

__all__ = [
    "FullSlowState",
    "LoadedSlowState",
    "ShardedSlowState",
    "SlowState",
    "make_slow_state",
]


def make_slow_state(comm: Communicator, config: SlowMoConfig, timer: PhaseTimer) -> SlowState:
    """One fragment's slow state, of the layout ``config`` asks for (``shard_slow_state``), over
    ``comm`` (it takes the fragment's parameters at its capture).

    Args:
        comm: the communicator of the exact average.
        config: the optimizer's configuration.
        timer: the optimizer's phase timer (a layout books its collectives to ``"average"``).

    Raises:
        ValueError: the layout cannot run with a feature of ``config`` (its ``unsupported``).
        TypeError: ``comm`` lacks the collectives the layout needs.
    """
    if config.shard_slow_state:
        ShardedSlowState.check_supported(config.features())
        return ShardedSlowState(comm, config, timer)
    FullSlowState.check_supported(config.features())
    return FullSlowState(comm, config, timer)
