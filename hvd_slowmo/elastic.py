"""Elastic training (``horovodrun --min-np/--max-np``, ``@hvd.elastic.run``) that keeps SlowMo's
state, and the restart from the anchor that every change of workers goes through.

``hvd.elastic.TorchState(model=model, optimizer=opt)`` picks a state handler per object from
Horovod's handler registry. Horovod's optimizer handler re-broadcasts with
``hvd.broadcast_optimizer_state``, which only knows a plain optimizer's ``state`` and
``param_groups``: it would fail on, or lose, the anchor, the slow buffer, the step counters and
the base algorithm's state. :func:`register_state_handler` (called by
:class:`~hvd_slowmo.DistributedOptimizer` under an elastic launch) puts :class:`SlowMoStateHandler`
first in that registry, so the user code stays Horovod's own::

    opt = hvd_slowmo.DistributedOptimizer(...)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    state.register_reset_callbacks([lambda: scale_lr(opt, hvd.size())])   # the LR is yours

    @hvd.elastic.run
    def train(state): ...

What happens on a membership change (workers lost or added), in Horovod's order:

1. ``restore`` (only after a failed collective): the optimizer goes back to the last
   ``state.commit()`` (anchor, slow buffer, counters, base optimizer state); gossip messages of
   the old world still in flight are dropped first, since their peers may be gone.
2. Horovod shuts down and re-initializes with the new workers; your reset callbacks run.
3. ``sync`` (every worker, joiners included): the cross-rank configuration check (skipped at
   construction under elastic, because a joiner constructs its optimizer alone), rank 0's full
   optimizer state is broadcast, then :meth:`DistributedOptimizer.adopt_world` rebuilds the
   base algorithm for the new rank/size (gossip graph and transport) and restarts the current
   outer step from the anchor ``x_{t,0}``, identical on every worker
   (:meth:`hvd_slowmo.outer_step.OuterLoop.restart`); the base steps taken since the anchor
   are dropped (``opt.num_steps`` goes back with them). One log line on rank 0 says what was
   done.

When Horovod skips ``sync`` (workers removed gracefully at a commit), the optimizer notices the
new world size at its next ``step()`` and does the same rebuild and restart locally (no
collective is needed: the anchor is already identical everywhere).

Paper: arXiv 1910.00643 (SlowMo); Horovod elastic: ``horovod.torch.elastic``.
"""

import copy
import os
from typing import Any, Protocol

__all__ = ["is_elastic_launch", "register_state_handler", "sync_optimizer"]


def is_elastic_launch() -> bool:
    """True in a worker started by an elastic ``horovodrun`` (it sets ``HOROVOD_ELASTIC=1``)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


class Syncable(Protocol):
    """What :func:`sync_optimizer` needs of a :class:`hvd_slowmo.DistributedOptimizer` (the
    optimizer imports this module, so it is described here rather than imported)."""

    def reset_base(self) -> None: ...
    def check_consistent(self) -> None: ...
    def broadcast_state(self, root_rank: int = 0) -> None: ...
    def adopt_world(self, why: str) -> None: ...


def sync_optimizer(opt: Syncable) -> None:
    """Bring every worker's optimizer to rank 0's state after a membership change. Collective.

    Checks that every worker is configured alike, broadcasts rank 0's full state (anchor, slow
    buffer, counters, base optimizer and base algorithm state), then rebuilds the base algorithm
    for the current workers and restarts the outer step from the anchor.

    Args:
        opt: a :class:`hvd_slowmo.DistributedOptimizer`.
    """
    opt.reset_base()  # drop anything of the old world before the first collective
    opt.check_consistent()
    opt.broadcast_state(root_rank=0)
    opt.adopt_world("elastic state sync")


_handler_cls: Any = None


def register_state_handler(optimizer_cls: type) -> None:
    """Make ``hvd.elastic.TorchState`` save, restore and sync ``optimizer_cls`` objects with
    their full SlowMo state (idempotent).

    Args:
        optimizer_cls: :class:`hvd_slowmo.DistributedOptimizer` (passed in: this module does not
            import the optimizer, which imports it).
    """
    global _handler_cls
    from horovod.torch.elastic import state as hvd_state  # only reached under Horovod

    if _handler_cls is None:

        class SlowMoStateHandler(hvd_state.StateHandler):
            """``TorchState`` handler for a :class:`hvd_slowmo.DistributedOptimizer`."""

            def __init__(self, opt: Any) -> None:
                super().__init__(opt)
                self._saved: dict[str, Any] = copy.deepcopy(opt.state_dict())

            def save(self) -> None:
                # state_dict() finishes gossip in flight first, so the copy holds all the mass.
                self._saved = copy.deepcopy(self.value.state_dict())

            def restore(self) -> None:
                # After a failed collective, messages in flight can never complete: drop them
                # (rebuild the base) before loading, or the load would wait for a dead peer.
                self.value.reset_base()
                self.value.load_state_dict(copy.deepcopy(self._saved))

            def sync(self) -> None:
                sync_optimizer(self.value)

        _handler_cls = SlowMoStateHandler
    registry = hvd_state.get_handler_registry()
    if not any(cls is optimizer_cls for cls, _ in registry):
        # First match wins and DistributedOptimizer is a torch.optim.Optimizer: insert ahead of
        # Horovod's generic optimizer handler.
        hvd_state.set_handler_registry([(optimizer_cls, _handler_cls)] + list(registry))
