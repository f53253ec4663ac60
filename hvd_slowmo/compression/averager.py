"""The exact average of the parameters sent as compressed pseudo-gradients, with the error
feedback residual it owns (SlowMo's outer step, arXiv 1910.00643).

Every worker holds the same anchor ``x0``; the workers average ``d_i = x0 - x_i`` with a codec
(:func:`~hvd_slowmo.compression.exchange.compressed_mean`) and every worker sets its parameters
to ``x0 - mean(d)``. The codes then carry the progress of one outer step, whose size does not
grow with the weights, instead of the weights themselves.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingAverage
from .codecs import BLOCK_SIZE, check_codec
from .exchange import PendingMean

__all__ = ["PseudoGradientAverage"]


class PseudoGradientAverage:
    """Averages parameters through their pseudo-gradients from a common anchor.

    Args:
        comm: the workers of the exact average.
        codec: a name of :data:`~hvd_slowmo.compression.codecs.CODECS`.
        error_feedback: keep this worker's residual and add it to its next pseudo-gradient.
        block: elements per scale of the scaled codecs.

    Attributes:
        residual: this worker's error-feedback residual (flat float32 over all parameters), or
            None (no error feedback, or nothing lost yet).
    """

    def __init__(
        self, comm: Communicator, codec: str, error_feedback: bool, block: int = BLOCK_SIZE
    ) -> None:
        self.comm = comm
        self.codec = check_codec(codec)
        self.error_feedback = error_feedback
        self.block = block
        self.residual: Tensor | None = None

    def start(
        self, params: Sequence[Tensor], anchor: Sequence[Tensor], name: str
    ) -> PendingAverage:
        """Start the average; once the returned handle's ``wait()`` returns, every parameter
        holds ``anchor - mean(anchor - params)``, bitwise the same on every worker. Collective.

        Args:
            params: this worker's parameters (overwritten at ``wait()``; not read after this).
            anchor: the anchor, one tensor per parameter, identical on every worker.
            name: a label for the collectives.
        """
        params, anchor = list(params), list(anchor)
        if len(params) != len(anchor):
            raise ValueError(
                f"PseudoGradientAverage: {len(params)} parameters but {len(anchor)} anchor tensors"
            )
        if not params:
            return PendingAverage()
        flat = torch.cat([(a.float() - p.float()).reshape(-1) for p, a in zip(params, anchor)])
        residual = None
        if self.error_feedback:
            if self.residual is None or self.residual.shape != flat.shape:
                self.residual = torch.zeros_like(flat)
            self.residual = residual = self.residual.to(flat.device)  # a loaded one: on the CPU
        pending = PendingMean(self.comm, flat, self.codec, name, residual, self.block)

        def finish() -> None:
            mean = pending.wait()
            for p, a, d in zip(params, anchor, mean.split([p.numel() for p in params])):
                p.copy_(a.float() - d.view_as(p))

        return PendingAverage(finish, progress=pending.poll)

    def average_(self, params: Sequence[Tensor], anchor: Sequence[Tensor], name: str) -> None:
        """:meth:`start` and wait. Collective.

        Args:
            params: as for :meth:`start`.
            anchor: as for :meth:`start`.
            name: as for :meth:`start`.
        """
        self.start(params, anchor, name).wait()

    def reset(self) -> None:
        """Forget the residual (a restart from the anchor: what it held was lost with the
        steps since)."""
        self.residual = None

    def state_dict(self) -> dict[str, Any]:
        """This worker's residual, with the rank and number of workers it belongs to."""
        return {
            "codec": self.codec,
            "residual": self.residual,
            "rank": self.comm.rank,
            "world_size": self.comm.size,
        }

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Take the residual of :meth:`state_dict` if it is this worker's own (same rank, same
        number of workers, same codec); any other worker's residual, or none, starts from zero.

        Args:
            saved: :meth:`state_dict` output, or None (a state saved without compression).
        """
        residual = None if saved is None else saved.get("residual")
        own = (
            saved is not None
            and saved.get("codec") == self.codec
            and (saved.get("rank"), saved.get("world_size")) == (self.comm.rank, self.comm.size)
        )
        if not isinstance(residual, Tensor) or not own or not self.error_feedback:
            self.residual = None
            return
        self.residual = residual.detach().to(torch.float32).clone()
