"""The exchange of the outer step (SlowMo, arXiv 1910.00643): how a fragment's parameters reach
their exact average. One interface (:class:`Exchange`: ``start(payload, exact) -> handle``),
one class per way: plain allreduce (:class:`PlainExchange`), compressed pseudo-gradients with
any codec (:class:`CompressedExchange`), the sharded layout's reduce-scatter
(:class:`ShardedExchange`), exact inside a node and sharded across nodes
(:class:`HierarchicalExchange`), over the workers that arrived in time
(:class:`QuorumExchange`). :func:`make_exchange` picks one from the configuration, for one
fragment."""

from ..comm.base import Communicator
from ..comm.hierarchy import Hierarchy
from ..compression.offload import CodecThread
from ..config import SlowMoConfig
from ..slow_state import ShardedSlowState, SlowState
from .base import EXACT_AVERAGE, Exchange, Payload
from .compressed import CompressedExchange
from .hierarchical import HierarchicalExchange
from .plain import PlainExchange
from .quorum import QuorumExchange
from .sharded import ShardedExchange

__all__ = [
    "EXACT_AVERAGE",
    "CompressedExchange",
    "Exchange",
    "HierarchicalExchange",
    "Payload",
    "PlainExchange",
    "QuorumExchange",
    "ShardedExchange",
    "make_exchange",
]


def make_exchange(
    comm: Communicator,
    config: SlowMoConfig,
    slow_state: SlowState,
    levels: tuple[Hierarchy, bool] | None = None,
    thread: CodecThread | None = None,
) -> Exchange:
    """One fragment's exchange, as ``config`` and its slow state's layout ask, checked against
    the features the configuration uses (:attr:`Exchange.unsupported`).

    Args:
        comm: the communicator over all workers.
        config: the optimizer's configuration (``codec``, ``error_feedback``, ...).
        slow_state: the fragment's slow state (a sharded layout brings its own exchange).
        levels: with ``config.hierarchical``, the node and cross-node levels and whether a
            node's ranks hold identical parameters.
        thread: the background thread every fragment's exchange shares (so their collectives
            run in one order on every worker), or None: the exchange makes its own if it
            needs one.

    Raises:
        ValueError: the exchange cannot run with a feature of ``config``, or ``comm`` lacks a
            collective it needs.
    """
    exchange: Exchange
    if config.straggler is not None:
        exchange = QuorumExchange(comm, config.straggler, slow_state)
    elif isinstance(slow_state, ShardedSlowState):
        exchange = ShardedExchange(comm, slow_state, config.overlap, thread)
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
        exchange = CompressedExchange(comm, slow_state, config.codec, config.error_feedback, thread)
    else:
        exchange = PlainExchange(comm)
    type(exchange).check_supported(config.features())
    return exchange
