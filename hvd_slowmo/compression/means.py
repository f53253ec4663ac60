"""Which average a codec's packets travel by, in one place: the codecs (:mod:`.codecs`,
:mod:`.sparse`) say which (``Codec.exchange``) and the averages (:mod:`.exchange`,
:mod:`.sparse_exchange`, :mod:`.sparse_owners`) import them, so no codec imports an average
(SlowMo's compressed outer step, arXiv 1910.00643).
"""

from torch import Tensor

from ..comm.base import Communicator
from .codecs import Codec
from .exchange import PendingMean
from .offload import Scratch
from .sparse_exchange import PendingSparseMean
from .sparse_owners import PendingOwnerSparseMean

__all__ = ["PendingCodecMean", "mean_start"]

#: The handle of any codec's average: ``wait()`` returns the decoded average.
PendingCodecMean = PendingMean | PendingSparseMean | PendingOwnerSparseMean


def mean_start(
    codec: Codec,
    comm: Communicator,
    flat: Tensor,
    name: str,
    residual: Tensor | None = None,
    out: Tensor | None = None,
    scratch: Scratch | None = None,
) -> PendingCodecMean:
    """Start the average of ``flat`` over ``comm``'s workers through ``codec``'s packets
    (collective); the handle's ``wait()`` returns the decoded average, the same bits on every
    worker.

    Args:
        codec: the codec (:func:`~hvd_slowmo.compression.codecs.as_codec`).
        comm: the workers.
        flat: this worker's 1-D float32 vector.
        name: a label for the collectives.
        residual: this worker's error-feedback residual, updated in place, or None.
        out: a buffer of ``codec.sum_numel(n)`` float32 the mean is written into (the dense
            codecs' decoded chunks, the sparse all-gather's sum), or None: a new one.
        scratch: buffers the dense codecs' packets are kept in from one mean to the next, where
            the caller waits for each mean before it starts the next
            (:class:`~hvd_slowmo.compression.exchange.PendingMean`), or None: new ones.
    """
    if codec.exchange == "dense":
        name_, block = codec.name, codec.block  # type: ignore[attr-defined]
        return PendingMean(comm, flat, name_, name, residual, block, out, scratch)
    if codec.exchange == "owners":
        return PendingOwnerSparseMean(comm, flat, codec, name, residual)  # type: ignore[arg-type]
    return PendingSparseMean(comm, flat, codec, name, residual, out=out)  # type: ignore[arg-type]
