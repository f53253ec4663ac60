"""The exchange of the outer step (SlowMo, arXiv 1910.00643): how a fragment's parameters reach
their exact average. One interface (:class:`Exchange`: ``start(payload, exact) -> handle``),
one class per way: plain allreduce (:class:`PlainExchange`), compressed pseudo-gradients with
any codec (:class:`CompressedExchange`), the sharded layout's reduce-scatter
(:class:`ShardedExchange`), exact inside a node and sharded across nodes
(:class:`HierarchicalExchange`). :func:`make_exchange` picks one from the configuration."""

from ..comm.base import Communicator
from ..comm.hierarchy import Hierarchy
from ..config import SlowMoConfig
from ..slow_state import ShardedSlowState, SlowState
from .base import EXACT_AVERAGE, Exchange, Payload
from .compressed import CompressedExchange
from .hierarchical import HierarchicalExchange
from .plain import PlainExchange
from .sharded import ShardedExchange

__all__ = [
    "EXACT_AVERAGE",
    "CompressedExchange",
    "Exchange",
    "HierarchicalExchange",
    "Payload",
    "PlainExchange",
    "ShardedExchange",
    "make_exchange",
]


def make_exchange(
    comm: Communicator,
    config: SlowMoConfig,
    slow_state: SlowState,
    levels: tuple[Hierarchy, bool] | None = None,
) -> Exchange:
    """The exchange that ``config`` and the slow state's layout ask for, checked against the
    features the configuration uses (:attr:`Exchange.unsupported`).

    Args:
        comm: the communicator over all workers.
        config: the optimizer's configuration (``codec``, ``error_feedback``, ...).
        slow_state: the slow state (a sharded layout brings its own exchange).
        levels: with ``config.hierarchical``, the node and cross-node levels and whether a
            node's ranks hold identical parameters.

    Raises:
        ValueError: the exchange cannot run with a feature of ``config``, or ``comm`` lacks a
            collective it needs.
    """
    exchange: Exchange
    if isinstance(slow_state, ShardedSlowState):
        exchange = ShardedExchange(comm, slow_state, config.overlap)
    elif config.hierarchical:
        assert levels is not None, "hierarchical=True needs the node and cross-node levels"
        hierarchy, replicated = levels
        exchange = HierarchicalExchange(
            comm,
            hierarchy,
            slow_state,
            config.codec,
            config.error_feedback,
            replicated,
            config.overlap,
        )
    elif config.codec is not None:
        exchange = CompressedExchange(comm, slow_state, config.codec, config.error_feedback)
    else:
        exchange = PlainExchange(comm)
    type(exchange).check_supported(config.features())
    return exchange
