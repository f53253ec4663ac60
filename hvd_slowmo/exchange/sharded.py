"""The sharded exchange: the sharded slow state's reduce-scatter (each rank receives its shard
of the average; the slow update then all-gathers the new anchor into the parameters:
:mod:`hvd_slowmo.slow_state.sharded`)."""

from ..comm.base import Communicator, PendingAverage
from ..compression.offload import CodecThread
from ..slow_state import ShardedSlowState
from .base import Exchange, Payload

__all__ = ["ShardedExchange"]


class ShardedExchange(Exchange):
    """The average that :class:`~hvd_slowmo.slow_state.ShardedSlowState` consumes.

    With ``overlap >= 1`` and a transport that pairs collectives started from two threads
    (:attr:`~hvd_slowmo.comm.base.Communicator.collectives_any_thread`: Horovod, MPI, the thread
    workers), the reduce-scatter runs on a thread of its own from the boundary on, while the
    worker takes its ``d`` base steps, and its shard waits in the layout for the landing's slow
    update and all-gather: the overlap hides it as it hides the full layout's allreduce. Otherwise
    (``overlap=0``, or torch.distributed, whose collectives pair by order per process group, so
    one started from a second thread could cross the training thread's) it runs when the handle
    is waited for (``started`` is False). Either way the same operations on the same tensors: the
    same bits.

    Args:
        comm: the communicator over all workers.
        slow_state: the fragment's sharded slow state.
        overlap: the configuration's ``overlap``.
        thread: the thread shared by every fragment's exchange (their collectives in one
            order); None: a new one where it runs in the background.
    """

    name = "sharded"
    unsupported = ShardedSlowState.unsupported

    def __init__(
        self,
        comm: Communicator,
        slow_state: ShardedSlowState,
        overlap: int = 0,
        thread: CodecThread | None = None,
    ) -> None:
        super().__init__(comm)
        self.slow_state = slow_state
        background = overlap >= 1 and comm.size > 1 and comm.collectives_any_thread
        self._thread = (thread or CodecThread(comm.counter)) if background else None

    def start(self, payload: Payload, exact: bool) -> PendingAverage:
        p = payload

        def reduce_scatter() -> None:
            self.slow_state.average_(p.params, p.extra, exact)

        if self._thread is None:
            return PendingAverage(reduce_scatter, started=False)
        devices = {t.device for t in [*p.params, *p.extra] if t.is_cuda}
        job = self._thread.submit(reduce_scatter, devices)
        return PendingAverage(job.wait, progress=job.done)
