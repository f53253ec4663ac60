"""The base algorithm's gradient path: the hooks that start a gradient average while backward
runs (AR-SGD's buckets, the node level of ``worker="node"``), the wait at the end of the
backward pass, and Horovod's ``synchronize``/``skip_synchronize`` protocol (SlowMo, arXiv
1910.00643). Mixed precision's verdict on top of it is :mod:`hvd_slowmo.amp`.
"""

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..comm.base import Communicator
from ..timing import PhaseTimer
from .base import BaseAlgorithm
from .gradient_buckets import BucketedAverage

__all__ = ["GradientPath", "on_backward"]


def on_backward(
    params: list[Tensor], owner: Any, callback: Callable[[Any, Tensor], None]
) -> list[Any]:
    """Call ``callback(owner, param)`` whenever a backward pass accumulates a gradient into any
    ``param`` of ``params``; the hooks hold ``owner`` weakly, so the parameters do not keep it
    alive.

    Args:
        params: the parameters to watch.
        owner: the object the callback acts on.
        callback: what to do.

    Returns:
        The hook handles.
    """
    ref = weakref.ref(owner)

    def fresh_gradient(param: Tensor) -> None:
        obj = ref()
        if obj is not None:
            callback(obj, param)

    return [p.register_post_accumulate_grad_hook(fresh_gradient) for p in params]


class GradientPath:
    """The gradient side of :class:`hvd_slowmo.DistributedOptimizer`: run the base algorithm's
    gradient average once per step (:meth:`~hvd_slowmo.bases.base.BaseAlgorithm.gradient_average`:
    AR-SGD's allreduce, the node level of ``worker="node"``).

    An average that starts during backward (AR-SGD's, bucket by bucket:
    :mod:`hvd_slowmo.bases.gradient_buckets`) is waited for at the end of the backward pass
    that completes the gradients, as DDP's is: ``backward()`` returns averaged gradients, so
    clipping, ``GradScaler``'s inf/NaN check and ``unscale_`` see the average, and the loss
    scales stay the same on every worker. Except for thread workers on CUDA (a communicator with
    ``workers_share_process``): autograd's device thread, which ends their backward passes,
    serves all of them, so there ``step()``/``synchronize()`` wait instead. The node-level
    average of the other bases runs at :meth:`synchronize`.

    A mixin: the optimizer provides the attributes annotated here and calls
    :meth:`_watch_gradients` for its parameters; :class:`hvd_slowmo.amp.MixedPrecision` adds
    the loss scaler's verdict on top.
    """

    params: list[Tensor]
    param_names: list[str]
    node_comm: Communicator | None
    comm: Communicator
    timer: PhaseTimer

    if TYPE_CHECKING:  # provided by the optimizer (read-only: rebuilt with the workers)

        @property
        def base(self) -> BaseAlgorithm: ...

    _synchronized = False  # this backward's gradients are communicated
    _skip_synchronize = False
    _grad_average: BucketedAverage | None = None  # the base's; None: no gradient is averaged
    _grad_average_for: tuple[Any, int] | None = None  # (base, number of parameters) it is for
    _wait_queued = False  # the end of this backward pass waits for the buckets
    _wait_deferred = False  # ... or left the wait to step()/synchronize() (see _end_of_backward)
    _owner_thread: int | None = None  # the thread that built the optimizer (a worker's)

    def _watch_gradients(self, params: list[Tensor]) -> None:
        """Hook every parameter of ``params``: each backward pass's gradient marks the gradients
        as not yet communicated (a step skipped after :meth:`synchronize`, an AMP overflow, must
        not make the next step reuse that synchronization) and, for a base that averages
        gradients, may start a bucket's average."""
        hooks = on_backward(params, self, _gradient_accumulated)
        self._owner_thread = threading.get_ident()
        self._grad_hooks: list[Any] = getattr(self, "_grad_hooks", []) + hooks

    def _gradient_average(self) -> BucketedAverage | None:
        """The base's gradient average of the current parameters, asked for again after
        ``add_param_group`` and of a new base (elastic)."""
        if self._grad_average_for != (self.base, len(self.params)):
            if self._grad_average is not None:
                self._grad_average.discard()
            self._grad_average = self.base.gradient_average(
                self.params, self.param_names, self.node_comm
            )
            self._grad_average_for = (self.base, len(self.params))
        return self._grad_average

    def _on_gradient(self, param: Tensor) -> None:
        self._synchronized = False
        average = self._gradient_average()
        if average is None or not average.in_backward:
            return  # nothing to average, or the node-level average alone: at synchronize()
        average.gradient_ready(param)
        if average.last_pass and not self._wait_queued:
            # The end of this backward pass waits for the buckets (DDP's finalize), so whatever
            # reads the gradients next (clipping, a scaler) reads the average.
            self._wait_queued = True
            ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: _end_of_backward(ref))

    def _average_gradients(self) -> BucketedAverage | None:
        """Start whatever gradient average has not started, and wait for all of it.

        Returns:
            The base's gradient average, or None where no gradient is averaged (one worker, or
            a base that does not average gradients without ``worker="node"``).
        """
        average = self._gradient_average()
        if average is not None:
            with self.timer("base_comm"):
                average.finish()
        return average

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients, as ``torch.optim.Optimizer.zero_grad``; an average in
        flight is waited for first (the transport may still write the gradients).

        Args:
            set_to_none: drop the gradient tensors instead of zeroing them.
        """
        if self._grad_average is not None:
            self._grad_average.discard()
        self._wait_queued = self._wait_deferred = False  # a failed backward ran no callback
        super().zero_grad(set_to_none)  # type: ignore[misc]
        self._synchronized = False

    def synchronize(self) -> None:
        """Finish this step's gradient communication now (Horovod's recipe for ``GradScaler``:
        ``synchronize()``, ``scaler.unscale_(opt)``, then
        ``with opt.skip_synchronize(): scaler.step(opt)``).

        It touches gradients only, so a step skipped after it changes nothing; it runs once per
        backward pass (a new backward, or ``zero_grad``, makes the next call communicate again).
        """
        self._wait_deferred = False  # the wait below is the one the backward pass left
        if not self._synchronized:
            with self.timer("base_comm"):
                buckets = self._average_gradients()
                if buckets is not None:
                    buckets.take()
                self.base.communicate_gradients()
            self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context, ``step()`` does not run :meth:`synchronize` again."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False


def _gradient_accumulated(opt: GradientPath, param: Tensor) -> None:
    opt._on_gradient(param)


def _end_of_backward(ref: "weakref.ref[GradientPath]") -> None:
    opt = ref()
    if opt is None:
        return
    opt._wait_queued = False
    if threading.get_ident() != opt._owner_thread and any(
        comm is not None and comm.workers_share_process for comm in (opt.node_comm, opt.base.comm)
    ):
        # Autograd's device thread (CUDA) runs this, and it serves every thread worker of the
        # process: waiting here for the other workers would wait for their backward passes,
        # queued behind this one on the same thread (a deadlock). step() and synchronize()
        # wait instead; read gradients before step() only after synchronize().
        opt._wait_deferred = True
        return
    opt._average_gradients()
