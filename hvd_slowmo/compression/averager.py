"""The exact average of the parameters sent as compressed pseudo-gradients, with the error
feedback residual it owns (SlowMo's outer step, arXiv 1910.00643).

Every worker holds the same anchor ``x0``; the workers average ``d_i = x0 - x_i`` with a codec
(:func:`~hvd_slowmo.compression.exchange.compressed_mean`) and every worker sets its parameters
to ``x0 - mean(d)``. The codes then carry the progress of one outer step, whose size does not
grow with the weights, instead of the weights themselves.

With streaming (``fragments=P``, :mod:`hvd_slowmo.fragments`) each fragment owns one average
over its parameters (concatenated in the optimizer's order, from their own anchor tensors), and
so its own residual, which carries into that fragment's next average.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingAverage
from .codecs import Codec, as_codec, check_transport
from .means import PendingCodecMean, mean_start
from .offload import CodecThread
from .sparse import SparseCodec

__all__ = ["PseudoGradientAverage"]


class PseudoGradientAverage:
    """Averages parameters through their pseudo-gradients from a common anchor.

    Args:
        comm: the workers of the exact average.
        codec: a :class:`~hvd_slowmo.compression.codecs.Codec`, or its spelling
            (:func:`~hvd_slowmo.compression.codecs.as_codec`): a name of
            :data:`~hvd_slowmo.compression.codecs.CODECS`, or ``"sparse"`` /
            :class:`~hvd_slowmo.compression.sparse.SparseCodec`, whose average is an all-gather
            of sparse packets (:mod:`~hvd_slowmo.compression.sparse_exchange`) and whose error
            feedback decays. The codec's own average is used
            (:func:`~hvd_slowmo.compression.means.mean_start`).
        error_feedback: keep this worker's residual and add it to its next pseudo-gradient.
        thread: the codec thread to run on (one shared by every fragment's average keeps their
            collectives in one order, and its :class:`~hvd_slowmo.compression.offload.Scratch`
            serves them all); None: a new one.

    Raises:
        TypeError, ValueError: an unknown codec, or ``comm`` without the collectives its
            average needs (:func:`~hvd_slowmo.compression.codecs.check_transport`).

    Attributes:
        residual: this worker's error-feedback residual, flat float32 over the parameters it
            averages (a fragment's), in order, or None (no error feedback, or nothing lost yet).
        thread: the :class:`~hvd_slowmo.compression.offload.CodecThread` that runs each
            average's codec work and collectives off the training thread, where the
            communicator allows it (``collectives_any_thread``); None: they run on the caller's
            thread.
    """

    def __init__(
        self,
        comm: Communicator,
        codec: "str | SparseCodec | Codec",
        error_feedback: bool,
        thread: CodecThread | None = None,
    ) -> None:
        self.codec: Codec = as_codec(codec)
        check_transport(comm, codec)
        self.comm = comm
        self.error_feedback = error_feedback
        self.residual: Tensor | None = None
        thread = thread if thread is not None else CodecThread(comm.counter)
        self.thread = thread if comm.collectives_any_thread else None
        # Shared with the averages of the same thread, on it or on the training thread: either
        # way they run one at a time (the thread is started only by a job).
        self._scratch = thread.scratch

    def start(
        self, params: Sequence[Tensor], anchor: Sequence[Tensor], name: str
    ) -> PendingAverage:
        """Start the average; once the returned handle's ``wait()`` returns, every parameter
        holds ``anchor - mean(anchor - params)``, bitwise the same on every worker. Collective.

        Args:
            params: this worker's parameters (read, then overwritten as soon as the mean is in:
                on the codec thread, before ``wait()``; the caller neither changes nor reads
                them until ``wait()`` has returned).
            anchor: their anchor, one tensor each, identical on every worker.
            name: a label for the collectives.
        """
        params, mine = list(params), list(anchor)
        if len(params) != len(mine):
            raise ValueError(
                f"PseudoGradientAverage: {len(params)} parameters for {len(mine)} anchor tensors"
            )
        if not params:
            return PendingAverage()
        if self.thread is None or self.comm.size == 1:
            pending = self._begin(params, mine, name)
            return PendingAverage(lambda: self._land(pending, params, mine), progress=pending.done)
        # Off the training thread: everything from the pseudo-gradient to the parameters' new
        # values (the inputs, snapshots or this step's parameters, are not touched by anyone
        # else until the wait); nothing of the fragment's size outlives the job.
        devices = {t.device for t in (*params, *mine) if t.is_cuda}
        job = self.thread.submit(
            lambda: self._land(self._begin(params, mine, name), params, mine), devices
        )
        return PendingAverage(job.wait, progress=job.done)

    def _begin(self, params: list[Tensor], mine: list[Tensor], name: str) -> PendingCodecMean:
        """The pseudo-gradient (in the scratch buffer), its error feedback, and the codec's mean
        started: which has made its packets, and is done with the pseudo-gradient, when it
        returns. Where each mean is consumed before the next starts (one job at a time on the
        codec thread, which lands it), the mean is then written into the same buffer: one
        buffer, of the largest fragment's size, serves every fragment's outer step. In flight
        on the training thread, two fragments' means may coexist: each mean is a new tensor."""
        numel = sum(p.numel() for p in params)
        offloaded = self.thread is not None and self.comm.size > 1
        into = self.codec.sum_numel(numel) if offloaded else 0
        buffer = self._scratch.take("flat", max(numel, into), params[0].device)
        flat = buffer[:numel]
        for part, p, a in zip(flat.split([p.numel() for p in params]), params, mine):
            torch.sub(a.float().reshape(-1), p.float().reshape(-1), out=part)
        residual = None
        if self.error_feedback:
            if self.residual is None or tuple(self.residual.shape) != (numel,):
                self.residual = torch.zeros_like(flat)
            self.residual = residual = self.residual.to(flat.device)  # a loaded one: on the CPU
        out = buffer[:into] if into else None
        scratch = self._scratch if offloaded else None  # packets too: one mean at a time
        return mean_start(self.codec, self.comm, flat, name, residual, out, scratch)

    @staticmethod
    @torch.no_grad()
    def _land(pending: PendingCodecMean, params: list[Tensor], mine: list[Tensor]) -> None:
        """Each parameter set to ``anchor - mean`` once the mean is in: straight into a float32
        parameter, else through the mean's own storage (which is consumed here)."""
        mean = pending.wait()
        for p, a, d in zip(params, mine, mean.split([p.numel() for p in params])):
            d = d.view_as(p)
            if p.dtype == torch.float32:
                torch.sub(a.float(), d, out=p)
            else:
                p.copy_(torch.sub(a.float(), d, out=d))

    @property
    def scratch(self) -> list[Tensor]:
        """The float32 buffer kept across outer steps (the pseudo-gradient, then the mean),
        shared with the averages of the same codec thread, for the memory accounting
        (:func:`hvd_slowmo.memory.held_bytes`, which counts a storage once)."""
        return self._scratch.buffers

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
            "codec": self._codec_name(),
            "residual": self.residual,
            "rank": self.comm.rank,
            "world_size": self.comm.size,
        }

    def _codec_name(self) -> str | dict[str, Any]:
        """The codec as plain values (a saved residual is only taken back by the same codec)."""
        return self.codec.summary()

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        """Take the residual of :meth:`state_dict` if it is this worker's own (same rank, same
        number of workers, same codec); any other worker's residual, or none, starts from zero.

        Args:
            saved: :meth:`state_dict` output, or None (a state saved without compression).
        """
        residual = None if saved is None else saved.get("residual")
        own = (
            saved is not None
            and saved.get("codec") == self._codec_name()
            and (saved.get("rank"), saved.get("world_size")) == (self.comm.rank, self.comm.size)
        )
        if not isinstance(residual, Tensor) or not own or not self.error_feedback:
            self.residual = None
            return
        self.residual = residual.detach().to(torch.float32).clone()
