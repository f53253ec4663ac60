"""Base algorithms: what a worker does around its local optimizer step in the inner loop.

Each base is a small object driven by :class:`hvd_slowmo.DistributedOptimizer`; the
optimizer owns the schedule (tau, the exact average, the slow update), the base owns the
per-step communication.
"""
from typing import Any, Dict, List, Tuple, Type

import torch
from torch import Tensor

from ..comm.base import Communicator

__all__ = ["BaseAlgorithm", "LocalSGD", "AllReduceSGD", "SGP", "OSGP", "DPSGD", "BASES", "grads_or_zeros"]


class BaseAlgorithm:
    """Local SGD/Adam: no communication in the inner loop (the default behaviour of every hook).

    Args:
        comm: the communicator of this worker.
    """

    name = "localsgd"
    #: Keyword options the constructor accepts beyond ``comm`` (passed through DistributedOptimizer).
    OPTIONS: Tuple[str, ...] = ()
    #: True where workers communicate inside the inner loop (so skipping the exact average is safe).
    communicates_every_step = False
    #: False where the parameters are already identical on every worker after each step, so
    #: the exact average at an outer step would only repeat them.
    needs_exact_average = True
    #: True where :meth:`communicate_gradients` leaves every worker with the same (averaged)
    #: gradients, so a non-finite check on them gives the same answer everywhere.
    averages_gradients = False

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.params: List[Tensor] = []

    def attach(self, params: List[Tensor]) -> None:
        """Called once with every parameter, in the index order used on every rank.

        Args:
            params: the parameters.
        """
        self.params = params

    def communicate_gradients(self) -> None:
        """This step's gradient communication (gradients are ready); run by
        :meth:`DistributedOptimizer.synchronize`. It must only read and write gradients: the
        step it belongs to may still be skipped (an AMP overflow), and then runs it again on
        the next gradients."""

    def pre_step(self) -> None:
        """Right before the local optimizer step, once the step is certain to happen (local
        work only, no communication)."""

    def post_step(self, step: int) -> None:
        """After the local optimizer step.

        Args:
            step: the global step number (0-based, identical on all workers).
        """

    def before_average(self) -> None:
        """Before an outer step: finish anything in flight so no mass is lost."""

    def after_average(self, averaged: bool) -> None:
        """After an outer step.

        Args:
            averaged: whether the parameters were exactly averaged (False for noaverage).
        """

    def state_dict(self) -> Dict[str, Any]:
        """State needed to resume exactly (push-sum weights and the like)."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (already validated by :meth:`check_state_dict`).

        Args:
            state: what :meth:`state_dict` returned.
        """

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` cannot be loaded; changes nothing.

        Args:
            state: a candidate for :meth:`load_state_dict`.
        """


LocalSGD = BaseAlgorithm


def grads_or_zeros(params: List[Tensor]) -> List[Tensor]:
    """The gradients of ``params``, giving zeros to those without one.

    Like Horovod: a parameter without a gradient on this rank joins with zeros, so every rank
    enters the same collective and unused parameters cannot deadlock the job.

    Args:
        params: the parameters, in the same order on every rank.
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]


class AllReduceSGD(BaseAlgorithm):
    """AR-SGD / AR-Adam: Horovod's per-step gradient average before every local step."""

    name = "allreduce"
    communicates_every_step = True
    needs_exact_average = False
    averages_gradients = True

    def communicate_gradients(self) -> None:
        self.comm.average_(grads_or_zeros(self.params), name="hvd_slowmo.grad_average")


#: Registered base algorithms: name -> class, constructed as ``cls(comm, **options)``.
BASES: Dict[str, Type[BaseAlgorithm]] = {"localsgd": LocalSGD, "allreduce": AllReduceSGD}

# The gossip bases subclass BaseAlgorithm, so they are imported after it (no import cycle).
from .gossip import DPSGD, OSGP, SGP  # noqa: E402

BASES.update({"sgp": SGP, "osgp": OSGP, "dpsgd": DPSGD})
