"""The plain exchange: one allreduce (mean) of a fragment's parameters and model buffers, in
place (SlowMo's exact average, arXiv 1910.00643, Algorithm 1, line 6)."""

from ..comm.base import PendingAverage
from ..merge import weighted_start
from .base import EXACT_AVERAGE, Exchange, Payload

__all__ = ["PlainExchange"]


class PlainExchange(Exchange):
    """The parameters (when ``exact``) and the model buffers in one averaging collective; with
    a tally (``payload.tally``), the parameters' average is weighted and the tally rides along.

    Args:
        comm: the communicator over all workers.
    """

    name = "plain"

    def start(self, payload: Payload, exact: bool) -> PendingAverage:
        params = payload.params if exact else []
        if payload.tally is not None:
            return weighted_start(self.comm, params, payload.extra, payload.tally, EXACT_AVERAGE)
        tensors = params + payload.extra
        return self.comm.average_start(tensors, name=EXACT_AVERAGE)
