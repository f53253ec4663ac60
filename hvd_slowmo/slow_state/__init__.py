"""SlowMo's slow state (arXiv 1910.00643, Algorithm 1, lines 6-8): the anchor ``x_{t,0}`` and the
slow buffer ``u_t`` or an outer optimizer, kept whole on every worker (:mod:`.full`) or sharded
across workers (:mod:`.sharded`), behind one interface (:mod:`.base`)."""

from collections.abc import Sequence

from ..comm.base import Communicator
from ..config import SlowMoConfig
from ..timing import PhaseTimer
from .base import LoadedSlowState, SlowState, SlowView
from .full import FullSlowState
from .sharded import ShardedSlowState

__all__ = [
    "FullSlowState",
    "LoadedSlowState",
    "ShardedSlowState",
    "SlowState",
    "SlowView",
    "make_slow_state",
]


def make_slow_state(
    comm: Communicator, config: SlowMoConfig, timer: PhaseTimer, split: Sequence[int] | None = None
) -> SlowState:
    """The slow state that ``config`` asks for (``shard_slow_state``), over ``comm``.

    Args:
        comm: the communicator of the exact average.
        config: the optimizer's configuration.
        timer: the optimizer's phase timer (a layout books its collectives to ``"average"``).
        split: each parameter's fragment (:func:`hvd_slowmo.fragments.fragment_of`); None: one.

    Raises:
        ValueError: the layout cannot run with a feature of ``config`` (its ``unsupported``).
        TypeError: ``comm`` lacks the collectives the layout needs.
    """
    if config.shard_slow_state:
        ShardedSlowState.check_supported(config.features())
        return ShardedSlowState(comm, config, timer, split)
    FullSlowState.check_supported(config.features())
    return FullSlowState(comm, config, timer)
