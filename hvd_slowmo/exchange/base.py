"""The exchange of SlowMo's outer step (arXiv 1910.00643, Algorithm 1, line 6): how one
fragment's parameters reach their exact average, behind one interface.

Each fragment owns one exchange. The fragment hands it its tensors (:class:`Payload`) at its
boundary and gets a handle back; once the handle's ``wait()`` returns, the payload's tensors
hold their averages, bitwise the same on every worker. An exchange that keeps state between
outer steps (a codec's error-feedback residual, over its fragment's parameters) owns it, saves
it and forgets it on a restart.
A new way to exchange (compressed, sparse, sharded, ...) is a new subclass, chosen by
:func:`hvd_slowmo.exchange.make_exchange`; what it cannot run with is declared in
:attr:`Exchange.unsupported` and refused at construction.
"""

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from ..comm.base import Communicator, PendingAverage

__all__ = ["EXACT_AVERAGE", "Exchange", "Payload"]

#: The name of the parameters' (and model buffers') plain average collective.
EXACT_AVERAGE = "hvd_slowmo.exact_average"


@dataclass
class Payload:
    """One fragment's tensors for one exact average (each averaged in place).

    Attributes:
        params: the fragment's parameters, all of them in the optimizer's order (a snapshot of
            them, or the parameters themselves when the outer step lands in its own step),
            numerators for push-sum bases.
        extra: tensors averaged alongside as plain values (the model buffers, with the fragment
            that ends the period).
        tally: this worker's float64 tally (:func:`hvd_slowmo.merge.make_tally`: its weight
            ``r_i`` first), averaged in place in the same collective, with ``params`` weighted
            by ``r_i`` (:func:`hvd_slowmo.merge.weighted_start`); None: the plain mean. An
            exchange that cannot carry it declares ``"merge"`` and ``"period"`` unsupported.
    """

    params: list[Tensor]
    extra: list[Tensor] = field(default_factory=list)
    tally: Tensor | None = None


class Exchange(abc.ABC):
    """How the outer step averages one fragment's parameters across workers (one instance per
    fragment).

    Args:
        comm: the communicator over all workers.

    Attributes:
        name: the exchange's name, for messages.
        unsupported: features (``"fragments"``, ``"eager"``, ``"codec"``, ``"merge"``,
            ``"period"``) it cannot run with,
            each with the reason (checked by :meth:`check_supported`).
        resumed_at: set by the last ``wait()`` when it did not average but brought this worker
            to the state after a later outer step (a late worker under a straggler quorum): the
            outer step to continue from, its slow step already applied; None otherwise.
    """

    name: ClassVar[str] = ""
    unsupported: ClassVar[dict[str, str]] = {}
    resumed_at: int | None = None

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    @abc.abstractmethod
    def start(self, payload: Payload, exact: bool) -> PendingAverage:
        """Start the average of ``payload`` (collective); its handle's ``wait()`` completes it
        (``done()`` advances one made of several collectives; ``started`` is False for one that
        runs entirely in ``wait()``).

        Args:
            payload: the fragment's tensors, averaged in place.
            exact: whether the parameters need averaging (False: a base such as AR-SGD keeps
                them identical on every worker, or ``average=False``: only ``extra`` is averaged).
        """

    def landed(self, tensors: list[Tensor]) -> None:
        """After the slow step of an average this exchange completed (nothing by default).

        Args:
            tensors: the payload's tensors (parameters, then model buffers), now the new anchor.
        """
        return None

    def settle(self) -> None:
        """At the end of training (``opt.finish()``, on every worker): complete what is owed
        to other workers (nothing by default)."""
        return None

    def reset(self) -> None:
        """Forget what is kept between outer steps (a restart from the anchor: it belonged to
        the steps that were dropped)."""
        return None  # nothing kept by default

    def state_dict(self) -> dict[str, Any] | None:
        """What this exchange keeps between outer steps (None: nothing): its fragment's
        ``"exchange"`` entry of the saved state."""
        return None

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Take back :meth:`state_dict`'s output where it belongs to this worker and exchange;
        anything else starts afresh (never raises: a state saved with another exchange loads).

        Args:
            saved: a saved ``"exchange"`` entry, or None.
        """
        return None  # nothing kept by default

    @classmethod
    def check_supported(cls, features: dict[str, str]) -> None:
        """Refuse the features this exchange declares unsupported.

        Args:
            features: the features asked for, each with the setting that asks.

        Raises:
            ValueError: one of them is not supported (the message says why).
        """
        for feature, asked in features.items():
            if feature in cls.unsupported:
                raise ValueError(
                    f"{asked} with the {cls.name} exchange is not supported: "
                    f"{cls.unsupported[feature]}"
                )
