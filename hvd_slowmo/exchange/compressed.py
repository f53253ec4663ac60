"""The compressed exchange: each worker sends its pseudo-gradient ``anchor - parameters`` in a
codec's format and every worker ends with ``anchor - mean`` (SlowMo's outer step, arXiv
1910.00643; the reduction: :mod:`hvd_slowmo.compression.exchange`). It owns the error-feedback
residual (:class:`~hvd_slowmo.compression.averager.PseudoGradientAverage`), saves it and forgets
it on a restart. The model buffers go through a plain average beside it."""

from typing import Any

from torch import Tensor

from ..comm.base import Communicator, PendingAverage
from ..compression.averager import PseudoGradientAverage
from ..compression.codecs import Codec
from ..compression.offload import CodecThread
from ..compression.sparse import SparseCodec
from ..slow_state import SlowState
from .base import EXACT_AVERAGE, Payload
from .plain import PlainExchange

__all__ = ["CompressedExchange"]


class CompressedExchange(PlainExchange):
    """Pseudo-gradients through a codec, from the fragment's anchor.

    Args:
        comm: the communicator over all workers (with ``alltoall_flat``/``allgather_flat``
            for more than one worker).
        slow_state: the fragment's slow state, whose anchor the pseudo-gradients are measured
            from (one tensor per parameter: the sharded layout declares ``"codec"`` unsupported).
        codec: a :class:`~hvd_slowmo.compression.codecs.Codec` or its spelling (a name of
            :data:`~hvd_slowmo.compression.codecs.CODECS`, ``"sparse"``).
        error_feedback: keep this worker's residual and add it to its next pseudo-gradient.
        thread: the codec thread shared by every fragment's exchange (their collectives in one
            order), or None.

    Raises:
        ValueError: ``comm`` has no all-to-all.
    """

    name = "compressed"
    unsupported = {
        "merge": "the weights must travel uncompressed beside the codes, which the codec's "
        "all-to-all does not carry",
        "period": "the step times must travel uncompressed beside the codes, which the codec's "
        "all-to-all does not carry",
    }

    def __init__(
        self,
        comm: Communicator,
        slow_state: SlowState,
        codec: "str | SparseCodec | Codec",
        error_feedback: bool,
        thread: CodecThread | None = None,
    ) -> None:
        # PseudoGradientAverage refuses a transport without the collectives, before any state.
        self.average = PseudoGradientAverage(comm, codec, error_feedback, thread)
        super().__init__(comm)
        self.slow_state = slow_state

    @property
    def residual(self) -> Tensor | None:
        """This worker's error-feedback residual (flat float32 over the fragment's parameters),
        or None."""
        return self.average.residual

    def start(self, payload: Payload, exact: bool) -> PendingAverage:
        if not exact or not payload.params:
            return super().start(payload, exact)
        anchor = self.slow_state.anchor
        assert anchor is not None, "the anchor is captured at the first step"
        pending = [
            self.average.start(payload.params, anchor, "hvd_slowmo.compressed_average"),
            self.comm.average_start(payload.extra, name=EXACT_AVERAGE),
        ]

        def finish() -> None:
            for p in pending:
                p.wait()

        return PendingAverage(finish, progress=pending[0].done)

    def reset(self) -> None:
        # The residual was lost with the steps since the anchor (and may hold the NaN of a
        # skipped outer step).
        self.average.reset()

    def state_dict(self) -> dict[str, Any] | None:
        return self.average.state_dict()

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        self.average.load_state_dict(saved)
