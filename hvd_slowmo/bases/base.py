"""The protocol of a base algorithm: what a worker does around its local optimizer step.

SlowMo (arXiv 1910.00643, Algorithm 1) runs ``tau`` steps of a *base algorithm* between outer
steps. :class:`hvd_slowmo.DistributedOptimizer` owns the schedule (``tau``, the exact average,
the slow update, the base optimizer's buffers); a base algorithm owns the per-step
communication. To add one, subclass :class:`BaseAlgorithm` and pass the class as
``DistributedOptimizer(base=MyBase)`` (or register it in :data:`hvd_slowmo.bases.BASES` to pass
its name). The optimizer drives it in this order::

    __init__(comm, **options)       once, and again after a change of workers (elastic)
    attach(params)                  once, then after every add_param_group
    gradient_average(params, names, node)   once per base and set of parameters: the
                                    bucketed per-step gradient average the optimizer feeds
                                    during backward and waits for before each step (AR-SGD's
                                    allreduce; the node level of worker="node"), or None
    every step:   communicate_gradients()   gradients are ready (and averaged by the
                                    gradient average); it touches gradients only: the
                                    step may still be skipped (AMP)
                  pre_step()        the step will happen: local work only (re-bias: push-sum)
                  <the wrapped optimizer's step>
                  post_step(step)   parameters were stepped (gossip them: SGP, D-PSGD)
    every tau:    before_average()  finish anything in flight: no mass may be lost
                  <exact average of the parameters (when average=True and needs_exact_average)>
                  after_average(averaged)
                  <slow update>
    state_dict() / check_state_dict(state) / load_state_dict(state)   checkpoints

Class attributes tell the optimizer what the base needs, so it never asks which base it has:

* :attr:`~BaseAlgorithm.name`: the name in messages, the saved configuration and the report.
* :attr:`~BaseAlgorithm.label`: the report's row label (``{opt}`` becomes the optimizer's name).
* :attr:`~BaseAlgorithm.OPTIONS`: the keyword options its constructor takes.
* :attr:`~BaseAlgorithm.communicates_every_step`: workers talk inside the inner loop, so
  skipping the exact average (``average=False``) still mixes their models.
* :attr:`~BaseAlgorithm.needs_exact_average`: False when the parameters are already identical
  on every worker after each step (AR-SGD), so the exact average would only repeat them.
* :attr:`~BaseAlgorithm.averages_gradients`: the base's :meth:`~BaseAlgorithm.gradient_average`
  averages the gradients over ``self.comm`` at every step (AR-SGD, in buckets of
  :attr:`~BaseAlgorithm.bucket_bytes` started during backward, after
  :attr:`~BaseAlgorithm.backward_passes_per_step` passes:
  :mod:`hvd_slowmo.bases.gradient_buckets`). Every worker then holds the same gradients, so a
  non-finite check of them agrees everywhere without a collective (AMP's overflow decision).

A base talks to its workers through the :class:`~hvd_slowmo.comm.base.Communicator` it is given
(``self.comm``), and never to Horovod or MPI directly.
"""

from collections.abc import Sequence

from torch import Tensor

from ..comm.base import Communicator
from .gradient_buckets import BucketedAverage, Stage, choose_bucket_bytes

__all__ = ["BaseAlgorithm"]

#: The label of the node-level gradient average of ``worker="node"`` (Horovod matches by label).
NODE_LABEL = "hvd_slowmo.node_grad_average"


class BaseAlgorithm:
    """A base algorithm with no communication in the inner loop (every hook does nothing).

    Args:
        comm: the communicator over the SlowMo workers (between nodes with ``worker="node"``).
    """

    #: The name in messages, the saved configuration and the report (defaults to the class name).
    name: str = ""
    #: The report's row label; ``{opt}`` is replaced by the base optimizer's name ("SGD", "Adam").
    label: str = ""
    #: Keyword options the constructor accepts beyond ``comm`` (given to DistributedOptimizer).
    OPTIONS: tuple[str, ...] = ()
    #: True where workers communicate inside the inner loop (so skipping the exact average is safe).
    communicates_every_step = False
    #: False where the parameters are already identical on every worker after each step, so
    #: the exact average at an outer step would only repeat them.
    needs_exact_average = True
    #: True where :meth:`gradient_average` averages the gradients over ``self.comm`` at every
    #: step (before :meth:`communicate_gradients`), so a non-finite check on them agrees
    #: everywhere.
    averages_gradients = False
    #: The most gradient bytes in one bucket of the per-step gradient average (and of the
    #: node-level average of ``worker="node"``); None: the transport's choice
    #: (:func:`hvd_slowmo.bases.gradient_buckets.choose_bucket_bytes`).
    bucket_bytes: int | None = None
    #: Backward passes accumulated into the gradients before each per-step average.
    backward_passes_per_step: int = 1

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.params: list[Tensor] = []

    @classmethod
    def display_name(cls) -> str:
        """:attr:`name`, or the class name for a subclass that sets none of its own."""
        return cls.__dict__.get("name") or cls.__name__

    def attach(self, params: list[Tensor]) -> None:
        """Called with every parameter, in the index order used on every rank.

        Args:
            params: the parameters.
        """
        self.params = params

    def gradient_average(
        self, params: Sequence[Tensor], names: Sequence[str], node: Communicator | None
    ) -> BucketedAverage | None:
        """The per-step gradient average this base hands the optimizer: it feeds it each
        gradient as backward produces it and waits for it before the step (at
        ``synchronize()``). This base averages no gradients: only the node level of
        ``worker="node"``, all at ``synchronize()``; None without one.

        Args:
            params: the parameters, in the index order used on every rank.
            names: their names, for the errors.
            node: this rank's node (``worker="node"``: gradients are averaged over it first),
                or None.
        """
        return self._bucketed(params, names, self._node_stages(node), in_backward=False)

    def _node_stages(self, node: Communicator | None) -> list[Stage]:
        """The node level of ``worker="node"`` (none with one rank per node)."""
        return [(node, NODE_LABEL)] if node is not None and node.size > 1 else []

    def _bucketed(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        stages: list[Stage],
        in_backward: bool,
    ) -> BucketedAverage | None:
        """The bucketed average over ``stages`` (None for none), with this base's bucket size
        and backward passes per step."""
        if not stages:
            return None
        bucket_bytes = choose_bucket_bytes(self.bucket_bytes, stages)
        return BucketedAverage(
            params, names, stages, self.backward_passes_per_step, bucket_bytes, in_backward
        )

    def communicate_gradients(self) -> None:
        """This step's gradient communication (gradients are ready); run by
        :meth:`hvd_slowmo.DistributedOptimizer.synchronize`. It must only read and write
        gradients: the step it belongs to may still be skipped (an AMP overflow), and then runs
        it again on the next gradients."""

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
        """After an outer step's exact average (or a skipped outer step).

        Args:
            averaged: whether the parameters were exactly averaged (False for noaverage), or
                restored to the common anchor (a skipped outer step).
        """

    def flush(self) -> None:
        """Finish every message in flight (at the end of training); nothing to do by default."""

    @property
    def consensus_weight(self) -> float:
        """This worker's weight in the consensus average: the push-sum weight ``w`` where the
        model holds ``z = x / w`` (SGP, OSGP); 1 for every other base."""
        return 1.0

    def state_dict(self) -> dict:
        """State needed to resume exactly (push-sum weights and the like)."""
        return {}

    def check_state_dict(self, state: dict) -> None:
        """Raise ``ValueError`` if ``state`` cannot be loaded; changes nothing.

        Args:
            state: a candidate for :meth:`load_state_dict`.
        """

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output (already validated by :meth:`check_state_dict`).

        Args:
            state: what :meth:`state_dict` returned.
        """
