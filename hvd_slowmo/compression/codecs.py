"""Codecs for the compressed exact average: pure functions from an fp32 vector to codes and back.

A codec turns a 1-D float32 tensor into an :class:`Encoded` (``codes`` in a narrow dtype, and
``scales``, one float32 per block, for the scaled codecs) and back into float32. Nothing here
communicates; :mod:`hvd_slowmo.compression.exchange` builds the reduction from these functions
and the communicator's collectives.

==========  ===============================  ==============================  =============
codec       codes                            scales                          bytes/element
==========  ===============================  ==============================  =============
``fp32``    the values (no compression)      none                            4
``fp16``    ``float16`` cast                 none                            2
``bf16``    ``bfloat16`` cast                none                            2
``int8``    ``round(x / s)`` in [-127, 127]  ``s = absmax / 127`` per block  1 + 4/block
``fp8``     ``float8_e4m3fn(x / s)``         ``s = absmax / 448`` per block  1 + 4/block
==========  ===============================  ==============================  =============

Blocks: block ``b`` of an encoded vector is its elements ``[b * block, (b + 1) * block)``; the
last block may be shorter. The blocks belong to the vector handed to :func:`encode` (one chunk of
the exchange), not to the model's tensors. A scale is ``absmax / 127`` (or ``/ 448``) rounded
to the nearest float32, the same bits on the CPU and on CUDA. Casts and ``fp8`` round to
nearest, ties to even; ``int8`` rounds with ``torch.round`` (to nearest, ties to even). A block
whose scale is zero (all zeros, or an absmax so small that ``absmax / 127`` underflows, below
about 1.8e-43) has codes 0 and decodes to zeros. A block holding a NaN or an infinity decodes to
NaN everywhere (its scale is NaN or inf), so a non-finite value is never silently turned into a
finite one.
``fp16`` overflows to inf beyond 65504, like ``hvd.Compression.fp16``.

Used for the pseudo-gradient average of SlowMo's outer step (arXiv 1910.00643): the codes carry
``anchor - parameters``, whose scale does not grow with the weights.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch
from torch import Tensor

from .sparse import SLICE, SparseCodec

if TYPE_CHECKING:  # the exchanges import this module
    from ..comm.base import Communicator

__all__ = [
    "BLOCK_SIZE",
    "CODECS",
    "SLICE",
    "Codec",
    "DenseCodec",
    "Encoded",
    "as_codec",
    "check_codec",
    "check_transport",
    "check_vector",
    "column_slices",
    "decode",
    "decode_rows",
    "encode",
    "encode_rows",
    "encoded_nbytes",
    "from_bytes",
    "to_bytes",
]

#: The codecs by name.
CODECS = ("fp32", "fp16", "bf16", "int8", "fp8")
#: Elements per scale of the ``int8`` and ``fp8`` codecs (4 bytes of scale per 256 codes: +1.6%).
BLOCK_SIZE = 256

_CODE_DTYPE = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "fp8": getattr(torch, "float8_e4m3fn", None),
}
#: The largest code of a scaled codec: a block's absmax maps to it.
_CODE_MAX = {"int8": 127.0, "fp8": 448.0}  # 448 = torch.finfo(torch.float8_e4m3fn).max


class Encoded(NamedTuple):
    """An encoded vector.

    Attributes:
        codes: 1-D, one code per element, in the codec's dtype.
        scales: 1-D float32, one per block (``int8``, ``fp8``); empty for the casts.
    """

    codes: Tensor
    scales: Tensor


class Codec(Protocol):
    """What every codec of the outer exchange speaks: its packet of a flat float32 vector, the
    vector a packet stands for, the packet's size, which average is built from its packets
    (``exchange``: :func:`hvd_slowmo.compression.means.mean_start` starts it; the averages
    import the codecs, never the other way), and its settings as plain values.
    :class:`DenseCodec` and :class:`~hvd_slowmo.compression.sparse.SparseCodec` implement it;
    :func:`as_codec` makes one from a user's spelling."""

    @property
    def exchange(self) -> str:
        """``"dense"`` (all-to-all, then all-gather), ``"allgather"`` or ``"owners"`` (sparse)."""
        ...

    def encode(self, x: Tensor) -> Tensor:
        """The uint8 packet of a 1-D float32 vector."""
        ...

    def decode(self, packet: Tensor, numel: int) -> Tensor:
        """The float32 vector of ``numel`` elements a packet stands for."""
        ...

    def packet_nbytes(self, numel: int) -> int:
        """Bytes of the packet of ``numel`` elements."""
        ...

    def sum_numel(self, numel: int) -> int:
        """Float32 elements of a buffer its mean may be written into
        (:func:`hvd_slowmo.compression.means.mean_start`'s ``out``; 0: it takes none)."""
        ...

    def summary(self) -> "str | dict[str, Any]":
        """The settings as plain values (saved beside a residual, compared across ranks)."""
        ...


@dataclass(frozen=True)
class DenseCodec:
    """A codec of :data:`CODECS` as a :class:`Codec`: a value per element (a cast, or a code and
    a float32 scale per ``block``), averaged by an all-to-all and an all-gather
    (:mod:`hvd_slowmo.compression.exchange`).

    Args:
        name: one of :data:`CODECS`.
        block: elements per scale of ``int8`` and ``fp8``.
    """

    name: str
    block: int = BLOCK_SIZE
    exchange: str = "dense"

    def encode(self, x: Tensor) -> Tensor:
        """:func:`to_bytes` of :func:`encode`.

        Args:
            x: the 1-D float32 vector.
        """
        return to_bytes(encode(x, self.name, self.block))

    def decode(self, packet: Tensor, numel: int) -> Tensor:
        """:func:`decode` of :func:`from_bytes`.

        Args:
            packet: from :meth:`encode`.
            numel: the vector's length.
        """
        return decode(from_bytes(packet, numel, self.name, self.block), self.name, self.block)

    def packet_nbytes(self, numel: int) -> int:
        """:func:`encoded_nbytes`.

        Args:
            numel: the vector's length.
        """
        return encoded_nbytes(numel, self.name, self.block)

    def sum_numel(self, numel: int) -> int:
        """``numel``: the dense mean decodes the gathered chunks into that buffer.

        Args:
            numel: the vector's length.
        """
        return numel

    def summary(self) -> str:
        """The name (what states saved before this class hold)."""
        return self.name


def as_codec(spec: Any, device: torch.device | str = "cpu", name: str = "codec") -> Codec:
    """The :class:`Codec` of a user's spelling: a name of :data:`CODECS`, ``"sparse"``, or a
    codec object (returned as is). The one place a codec's spelling is told apart.

    Args:
        spec: the spelling.
        device: where the codes are made (``fp8`` needs ``float8_e4m3fn`` there).
        name: the argument's name, for the messages.

    Raises:
        TypeError, ValueError: as :func:`check_codec`.
    """
    if isinstance(spec, DenseCodec):
        return spec
    checked = check_codec(spec, device, name)
    return DenseCodec(checked) if isinstance(checked, str) else checked


def check_transport(comm: "Communicator", codec: object) -> None:
    """Refuse a transport without the collectives a compressed average is built from
    (``alltoall_flat`` and ``allgather_flat``): the one guard, where a codec's average is
    built (:class:`~hvd_slowmo.compression.averager.PseudoGradientAverage`) and where a mean
    starts.

    Args:
        comm: the workers.
        codec: the codec, for the message.

    Raises:
        ValueError: more than one worker and no all-to-all, naming the transport and the fix.
    """
    if comm.size > 1 and not comm.supports_alltoall:
        raise ValueError(
            f"codec={codec!r} needs a communicator with alltoall_flat and allgather_flat; "
            f"{type(comm).__name__} has none: use codec=None"
        )


def check_codec(
    codec: Any, device: torch.device | str = "cpu", name: str = "codec"
) -> "str | SparseCodec":
    """``codec`` itself, checked to be a codec name that works on ``device``; ``"sparse"``
    becomes ``SparseCodec()`` (:mod:`hvd_slowmo.compression.sparse`).

    Args:
        codec: one of :data:`CODECS`, ``"sparse"`` or a
            :class:`~hvd_slowmo.compression.sparse.SparseCodec`.
        device: where the codes are made (``fp8`` needs torch's ``float8_e4m3fn`` there).
        name: the argument's name, for the messages.

    Raises:
        TypeError: ``codec`` is not a string.
        ValueError: an unknown name, or ``fp8`` where torch cannot cast to ``float8_e4m3fn``.
    """
    if isinstance(codec, SparseCodec):
        return codec
    if codec == "sparse":
        return SparseCodec()
    if not isinstance(codec, str):
        raise TypeError(
            f"{name} must be one of {CODECS}, 'sparse' or a SparseCodec(...), got {codec!r}"
        )
    if codec not in CODECS:
        raise ValueError(
            f"{name} must be one of {CODECS}, 'sparse' or a SparseCodec(...), got {codec!r}"
        )
    if codec == "fp8":
        dtype = _CODE_DTYPE["fp8"]
        try:
            ok = dtype is not None and torch.ones(1, device=device).to(dtype).float().item() == 1.0
        except (RuntimeError, TypeError):
            ok = False
        if not ok:
            raise ValueError(
                f"{name}='fp8' needs torch.float8_e4m3fn on {device} (torch {torch.__version__} "
                "has no working cast there); use 'int8' or 'bf16'"
            )
    return codec


def check_vector(flat: Tensor, residual: Tensor | None, what: str) -> None:
    """Refuse the arguments of a compressed mean that are not a 1-D float32 vector and a
    residual of its shape (the dense exchange's and the sparse one's).

    Args:
        flat: this worker's vector.
        residual: its error-feedback residual, or None.
        what: the function, for the message.

    Raises:
        ValueError: naming the argument, what it is and what it must be.
    """
    if flat.dtype != torch.float32 or flat.dim() != 1:
        raise ValueError(
            f"{what}: flat must be a 1-D float32 tensor, got {flat.dtype} of shape "
            f"{tuple(flat.shape)}"
        )
    if residual is not None and (residual.dtype != torch.float32 or residual.shape != flat.shape):
        raise ValueError(
            f"{what}: residual must be float32 of shape {tuple(flat.shape)}, got "
            f"{residual.dtype} of shape {tuple(residual.shape)}"
        )


def _num_blocks(numel: int, block: int) -> int:
    return math.ceil(numel / block)


def _blocked(x: Tensor, block: int) -> Tensor:
    """``x`` zero-padded to whole blocks, one row per block (zeros change no block's absmax)."""
    pad = _num_blocks(x.numel(), block) * block - x.numel()
    if pad == 0 and x.is_contiguous():
        return x.view(-1, block)  # whole blocks already: no copy
    return torch.nn.functional.pad(x, (0, pad)).view(-1, block)


def _scaled(blocks: Tensor, codec: str) -> tuple[Tensor, Tensor]:
    """The scales of ``blocks`` (one row a block) and the blocks divided by them, rounded and
    clamped to the codes' range (a new float32 tensor, converted to the codes by a copy)."""
    code_max = _CODE_MAX[codec]
    scaled = blocks.abs()  # the magnitudes, then (below) the quotients: one buffer
    amax = scaled.amax(dim=1) if blocks.numel() else blocks.new_empty(0)
    # Divided by a tensor, not a Python number: for a CPU scalar divisor CUDA multiplies by its
    # float32 reciprocal instead (torch's div_true_kernel_cuda), one ulp off the CPU's correctly
    # rounded quotient for many absmax values (1/448 and 1/127 are not exact in binary: about
    # 55% and 5% of them). A tensor divisor is an IEEE division on every device: equal bits.
    scales = amax / torch.full_like(amax, code_max)
    # A zero scale divides by one instead (its codes are 0); a NaN or inf scale is kept for the
    # decode, which then yields NaN for the whole block.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    torch.div(blocks, divisor[:, None], out=scaled)
    if codec == "int8":
        scaled.round_()
    return scales, scaled.clamp_(-code_max, code_max)


def _codes_into(out: Tensor, codes: Tensor) -> Tensor:
    """``out`` (float32, ``codes``' shape) set to the codes' values, the bits of
    ``codes.to(torch.float32)``: ``fp8`` codes by a look-up in the float32 values of all 256
    codes (:func:`_fp8_values`), about twice as fast on the CPU as torch's cast (which has no
    vectorised kernel for it there), the others by the cast."""
    if codes.dtype != _CODE_DTYPE["fp8"] or codes.numel() == 0:
        return out.copy_(codes)
    index = codes.view(torch.uint8).to(torch.int32).view(-1)
    table = _fp8_values(codes.device)
    if out.is_contiguous():
        torch.index_select(table, 0, index, out=out.view(-1))
        return out
    return out.copy_(table.index_select(0, index).view(codes.shape))


def _fp8_values(device: torch.device) -> Tensor:
    """The float32 value of each ``float8_e4m3fn`` code (by its byte), made by torch's own cast
    on ``device`` (so a look-up gives the cast's bits, the NaNs' included); kept per device."""
    table = _FP8_VALUES.get(device)
    if table is None:
        fp8 = _CODE_DTYPE["fp8"]
        assert fp8 is not None, "check_codec refuses fp8 where torch has no float8_e4m3fn"
        codes = torch.arange(256, dtype=torch.uint8, device=device)
        table = _FP8_VALUES[device] = codes.view(fp8).to(torch.float32)
    return table


#: :func:`_fp8_values` by device (1 KB each).
_FP8_VALUES: dict[torch.device, Tensor] = {}


def _rescale_(values: Tensor, scales: Tensor, block: int) -> Tensor:
    """``values`` (float32, ``(count, size)``, the codes of blocks restarting at every row)
    multiplied in place by their block's scale (``scales``: ``(count, ceil(size / block))``):
    the whole blocks as one view, and the short last block of every row zero-padded to a
    whole one in a small buffer, so every product runs on the same kernel path as a product
    of whole blocks (which NaN a NaN code times a NaN scale yields depends on it)."""
    count, size = values.shape
    whole, short = divmod(size, block)
    if whole:
        values[:, : whole * block].view(count, whole, block).mul_(scales[:, :whole, None])
    if short:
        tail = values.new_zeros(count, block)
        tail[:, :short] = values[:, whole * block :]
        values[:, whole * block :] = tail.mul_(scales[:, whole:])[:, :short]
    return values


def encode(x: Tensor, codec: str, block: int = BLOCK_SIZE) -> Encoded:
    """Encode a 1-D float32 vector.

    Args:
        x: the vector (float32, 1-D, any length including 0).
        codec: one of :data:`CODECS`.
        block: elements per scale (``int8``, ``fp8``).
    """
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(
            f"encode: need a 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}"
        )
    dtype = _CODE_DTYPE[codec]
    if codec not in _CODE_MAX:
        return Encoded(x.to(dtype, copy=True), x.new_empty(0))
    scales, scaled = _scaled(_blocked(x, block), codec)
    return Encoded(scaled.view(-1)[: x.numel()].to(dtype), scales)


def decode(enc: Encoded, codec: str, block: int = BLOCK_SIZE) -> Tensor:
    """The float32 vector an :class:`Encoded` stands for.

    Args:
        enc: from :func:`encode` (or :func:`from_bytes`).
        codec: the codec it was encoded with.
        block: the block size it was encoded with.
    """
    out = torch.empty(enc.codes.numel(), dtype=torch.float32, device=enc.codes.device)
    _codes_into(out, enc.codes)
    if codec in _CODE_MAX:
        _rescale_(out.view(1, -1), enc.scales.view(1, -1), block)
    return out


def column_slices(size: int, count: int, block: int = BLOCK_SIZE) -> list[tuple[int, int]]:
    """Ranges ``(start, stop)`` of the columns of a ``(count, size)`` matrix, about
    :data:`SLICE` elements each, every one starting at a whole block: an encode or decode of a
    slice at a time gives the bits of the whole (a block's scale is made from its whole block).

    Args:
        size: the columns.
        count: the rows.
        block: elements per scale.
    """
    width = max(block, SLICE // max(count, 1) // block * block)
    return [(start, min(size, start + width)) for start in range(0, size, width)]


def _encode_slice(
    values: Tensor,
    codes: Tensor,
    packets: Tensor,
    start: int,
    codec: str,
    block: int,
    decoded: bool,
) -> Tensor | None:
    """:func:`encode_rows` of the columns ``values`` (from column ``start``, a whole block on):
    their codes into ``codes`` (the same columns of the packets' codes) and their scales into
    their bytes of ``packets``; returns what they decode to if ``decoded`` (a slice-sized
    buffer), else None."""
    if codec not in _CODE_MAX:
        codes.copy_(values)
        return codes.to(torch.float32) if decoded else None
    count, width = values.shape
    # The slice's blocks as rows of one matrix (a copy: the columns of a slice are not
    # contiguous), the short last block zero-padded (zeros change no block's absmax).
    blocks = _num_blocks(width, block)
    padded = values
    if blocks * block != width:
        padded = torch.nn.functional.pad(values, (0, blocks * block - width))
    scales, scaled = _scaled(padded.reshape(count * blocks, block), codec)
    first = start // block
    packets[:, 4 * first : 4 * (first + blocks)].copy_(scales.view(count, blocks).view(torch.uint8))
    codes.copy_(scaled.view(count, -1)[:, :width])
    if not decoded:
        return None
    # The codes back to float32 into the quotient's buffer (whose padding holds zeros), then
    # times their scales, whole blocks.
    _codes_into(scaled.view(count, -1)[:, :width], codes)
    return scaled.mul_(scales[:, None]).view(count, -1)[:, :width]


def encode_rows(
    rows: Tensor,
    codec: str,
    block: int = BLOCK_SIZE,
    out: Tensor | None = None,
    decoded: bool = True,
    feedback: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Every row of a matrix encoded as a vector of its own, a slice of columns (whole blocks,
    about :data:`SLICE` elements) at a time, so the temporaries stay a slice's size: the same
    bits as :func:`to_bytes` of :func:`encode` of each row, and of :func:`decode`.

    Args:
        rows: float32 of shape ``(count, size)`` (the equal chunks of an exchange).
        codec: one of :data:`CODECS`.
        block: elements per scale (``int8``, ``fp8``); the blocks restart at every row.
        out: uint8 of shape ``(count, encoded_nbytes(size))`` to write the packets into (rows
            of a larger buffer, e.g.); None: a new one.
        decoded: also return what the packets decode to (a new matrix of ``rows``' shape).
        feedback: subtract what the packets decode to from ``rows`` in place, slice by slice
            (error feedback, where ``rows`` are the residual): no matrix of it is made.

    Returns:
        ``(packets, decoded)``: uint8 of shape ``(count, encoded_nbytes(size))``, one packet a
        row, and the float32 rows they decode to (None without ``decoded``).
    """
    count, size = rows.shape
    dtype = _CODE_DTYPE[codec]
    assert dtype is not None, "check_codec refuses fp8 where torch has no float8_e4m3fn"
    packets = out
    if packets is None:
        packets = rows.new_empty(count, encoded_nbytes(size, codec, block), dtype=torch.uint8)
    whole = rows.new_empty(count, size) if decoded else None
    if size == 0:
        return packets, whole
    per_row = _num_blocks(size, block) if codec in _CODE_MAX else 0
    all_codes = packets[:, 4 * per_row :].view(dtype)
    for start, stop in column_slices(size, count, block):
        values = rows[:, start:stop]
        back = _encode_slice(
            values, all_codes[:, start:stop], packets, start, codec, block, decoded or feedback
        )
        if back is not None and whole is not None:
            whole[:, start:stop] = back
        if back is not None and feedback:
            values.sub_(back)
    return packets, whole


def _as(buf: Tensor, dtype: torch.dtype) -> Tensor:
    """``buf`` (uint8, 2-D) seen as ``dtype`` along its last dimension, copied first where its
    rows are not contiguous or not aligned for ``dtype``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    misaligned = buf.stride(0) % itemsize or buf.storage_offset() % itemsize
    if itemsize > 1 and (buf.stride(-1) != 1 or misaligned):
        buf = buf.clone(memory_format=torch.contiguous_format)
    return buf.view(dtype)


def decode_rows(
    packets: Tensor,
    size: int,
    codec: str,
    block: int = BLOCK_SIZE,
    out: Tensor | None = None,
    columns: tuple[int, int] | None = None,
) -> Tensor:
    """Packets of equal vectors decoded at once, one a row, a slice of columns at a time (the
    temporaries stay a slice's size): the same bits as :func:`decode` of :func:`from_bytes` of
    each.

    Args:
        packets: uint8 of shape ``(count, encoded_nbytes(size))``.
        size: each vector's length.
        codec: their codec.
        block: their block size.
        out: float32 of shape ``(count, stop - start)`` to decode into (rows of a larger
            buffer, e.g.); None: a new one.
        columns: ``(start, stop)``: only the elements ``[start, stop)`` of every vector
            (``start`` a multiple of ``block``); None: all of them.

    Raises:
        ValueError: packets of another size, or columns that do not start a block.
    """
    want = encoded_nbytes(size, codec, block)
    if packets.dtype != torch.uint8 or packets.dim() != 2 or packets.shape[1] != want:
        raise ValueError(
            f"decode_rows: {codec} packets of {size} elements have {want} bytes, got "
            f"{tuple(packets.shape)} of {packets.dtype}"
        )
    begin, end = (0, size) if columns is None else columns
    if not (0 <= begin <= end <= size and begin % block == 0):
        raise ValueError(
            f"decode_rows: columns must be (start, stop) with 0 <= start <= stop <= {size} and "
            f"start a multiple of the block ({block}), got {columns}"
        )
    count = packets.shape[0]
    if out is None:
        out = torch.empty(count, end - begin, dtype=torch.float32, device=packets.device)
    code_dtype = _CODE_DTYPE[codec]
    assert code_dtype is not None, "check_codec refuses fp8 where torch has no float8_e4m3fn"
    per_row = _num_blocks(size, block) if codec in _CODE_MAX else 0
    itemsize = torch.empty(0, dtype=code_dtype).element_size()
    for start, stop in column_slices(end - begin, count, block):
        target = out[:, start:stop]
        start, stop = begin + start, begin + stop
        first = 4 * per_row + start * itemsize
        _codes_into(target, _as(packets[:, first : first + (stop - start) * itemsize], code_dtype))
        if codec in _CODE_MAX:
            blocks = slice(4 * (start // block), 4 * _num_blocks(stop, block))
            _rescale_(target, _as(packets[:, blocks], torch.float32), block)
    return out


def encoded_nbytes(numel: int, codec: str, block: int = BLOCK_SIZE) -> int:
    """Bytes of :func:`to_bytes` for a vector of ``numel`` elements (codes and scales).

    Args:
        numel: the vector's length.
        codec: one of :data:`CODECS`.
        block: elements per scale.
    """
    itemsize = torch.empty(0, dtype=_CODE_DTYPE[codec]).element_size()
    scales = 4 * _num_blocks(numel, block) if codec in _CODE_MAX else 0
    return numel * itemsize + scales


def to_bytes(enc: Encoded) -> Tensor:
    """One uint8 packet: the scales' bytes, then the codes' bytes (what goes on the wire).

    Args:
        enc: the encoded vector.
    """
    return torch.cat([enc.scales.view(torch.uint8), enc.codes.view(torch.uint8)])


def _view(buf: Tensor, dtype: torch.dtype) -> Tensor:
    # Tensor.view(dtype) needs the byte offset to be a multiple of the new element size; a
    # packet received at an odd offset of a larger buffer is copied first.
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if buf.storage_offset() % itemsize:
        buf = buf.clone()
    return buf.view(dtype)


def from_bytes(packet: Tensor, numel: int, codec: str, block: int = BLOCK_SIZE) -> Encoded:
    """The :class:`Encoded` of a :func:`to_bytes` packet.

    Args:
        packet: 1-D uint8, as made by :func:`to_bytes`.
        numel: the encoded vector's length.
        codec: its codec.
        block: its block size.

    Raises:
        ValueError: the packet's length is not that of ``numel`` elements of ``codec``.
    """
    want = encoded_nbytes(numel, codec, block)
    if packet.dtype != torch.uint8 or packet.numel() != want:
        raise ValueError(
            f"from_bytes: a {codec} packet of {numel} elements has {want} bytes, got "
            f"{packet.numel()} of {packet.dtype}"
        )
    n_scales = 4 * _num_blocks(numel, block) if codec in _CODE_MAX else 0
    scales = _view(packet[:n_scales], torch.float32)
    code_dtype = _CODE_DTYPE[codec]
    assert code_dtype is not None, "check_codec refuses fp8 where torch has no float8_e4m3fn"
    return Encoded(_view(packet[n_scales:], code_dtype), scales)
