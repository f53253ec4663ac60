"""The sparse codec: chunked top-k of a flat vector, its values at 2, 4 or 8 bits, in one packet.

Pure functions, no communication (:mod:`hvd_slowmo.compression.sparse_exchange` builds the
average from them). The codec of SparseLoCo (arXiv 2508.15706), used for the pseudo-gradient of
SlowMo's outer step (arXiv 1910.00643); see docs/sparse.md.

For a 1-D float32 vector ``x`` of ``n`` elements and a :class:`SparseCodec` with ``chunk`` ``c``,
``density`` and ``bits`` ``b``:

* **Chunks.** ``x`` is zero-padded to ``C = ceil(n / c)`` chunks of ``c`` elements.
* **Top-k.** Each chunk keeps its ``k = max(1, round(density * c))`` entries of largest
  magnitude (Python's ``round``, ties to even; ``k <= c``). Ties in magnitude go to the lower
  position, so the selection (and the packet) is a function of the values alone. A NaN counts
  as the largest magnitude.
* **Values.** With ``L = 2 ** (b - 1)`` magnitude levels, a chunk's levels are evenly spaced
  from ``lo``, the smallest kept magnitude, to ``hi``, the largest: ``step = (hi - lo) / (L -
  1)`` (float32). A kept value ``v`` has the code ``q | s << (b - 1)``, with ``s = 1`` when
  ``v < 0`` and ``q = round((|v| - lo) / step)`` (ties to even, 0 where ``step`` is 0), clamped
  to ``[0, L - 1]``; it decodes to ``±(lo + q * step)``. So a kept 0 (a chunk with fewer than
  ``k`` non-zeros) decodes to 0 exactly, the largest kept magnitude is sent (as ``lo + (L - 1)
  * step``, equal to it up to float32 rounding), and at
  ``b = 2`` a value is sent as ``±lo`` or ``±hi``. A chunk holding a NaN or an infinity
  decodes to non-finite values (its ``step`` is non-finite): nothing non-finite becomes finite.
* **Indices.** A kept entry's position in its chunk, in ``w = ceil(log2(c))`` bits (12 for
  ``c = 4096``): up to 8 bits packed by :func:`pack_bits`; above 8 bits, the low byte of
  every position, then their high ``w - 8`` bits packed by :func:`pack_bits`.

The packet (uint8), the same size on every worker for a given ``n``::

    lo     C float32
    step   C float32
    index  C * k positions of w bits (see Indices)
    code   C * k codes of b bits, packed by pack_bits
    zeros  to a multiple of 4 bytes

Entries are in chunk order, and within a chunk by decreasing magnitude (ties: lower position
first). Bytes: ``8 C + ceil(C k w / 8) + ceil(C k b / 8)`` (with ``w > 8`` the positions take
``C k + ceil(C k (w - 8) / 8)``), rounded up to a multiple of 4 (:func:`packet_nbytes`): at
``c = 4096``, density 0.02 (``k = 82``) and ``b = 2``, 151.5 bytes per 4096 values, 108 times
fewer than float32.
"""

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from ..divide import div_
from .native import sparse_encode as native_sparse_encode
from .native import sparse_sum as native_sparse_sum
from .native import usable as native_usable

__all__ = [
    "SLICE",
    "SparseCodec",
    "pack_bits",
    "packet_nbytes",
    "sparse_decode",
    "sparse_decode_dense",
    "sparse_decode_runs",
    "sparse_encode",
    "sparse_encode_feedback",
    "sparse_encode_with_feedback",
    "sparse_sum",
    "unpack_bits",
    "with_feedback",
]

#: The value widths the codec has.
BITS = (2, 4, 8)
#: Float32 elements an encode or decode works on at once (the codecs of :mod:`.codecs` too):
#: its temporaries (the top-k keys, the quotients, a padded copy of a short last block or
#: chunk) are bounded by a few times this many, however long the vector.
SLICE = 1 << 18
#: The largest chunk: a position in it fits in 16 bits.
MAX_CHUNK = 1 << 16
#: How the packets are averaged: one all-gather (the default), or reduced at owners and gathered.
EXCHANGES = ("allgather", "owners")


def _number(name: str, value: Any, what: str) -> float:
    """``value`` if it is a real number (not a bool), else a ``TypeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SparseCodec: {name} must be {what}, got {value!r}")
    return value


def _integer(name: str, value: Any, what: str) -> int:
    """``value`` if it is an int (not a bool), else a ``TypeError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SparseCodec: {name} must be {what}, got {value!r}")
    return value


@dataclass(frozen=True)
class SparseCodec:
    """The sparse codec's settings: pass it as ``codec=SparseCodec(...)`` (the string
    ``"sparse"`` is ``SparseCodec()``).

    Args:
        density: the fraction of each chunk sent, in ``(0, 1]``; ``k = max(1, round(density *
            chunk))`` entries per chunk.
        bits: bits per sent value, 2, 4 or 8 (sign and ``bits - 1`` bits of magnitude).
        chunk: elements per top-k chunk, in ``[2, 65536]``.
        ef_decay: ``d``, the decay of the error feedback: each worker keeps ``e <- d e +
            delta``, sends ``C(e)`` and keeps ``e - C(e)`` (with ``error_feedback=True``).
            1.0: plain error feedback, what is not sent now is sent later; SparseLoCo's form
            (no outer momentum, the residual is the momentum) uses e.g. 0.95. In ``[0, 1]``.
        exchange: ``"allgather"``: every worker gathers every packet and sums them (the exact
            mean of the sent packets; ``m - 1`` packets received per worker); ``"owners"``: each
            region is reduced at an owner, sparsified again and gathered
            (:mod:`~hvd_slowmo.compression.sparse_owners`: about two packets per worker for any
            number of workers, at the cost of a second sparsification).

    Raises:
        TypeError, ValueError: a setting of the wrong type or out of range.
    """

    density: float = 0.02
    bits: int = 2
    chunk: int = 4096
    ef_decay: float = 1.0
    exchange: str = "allgather"

    def __post_init__(self) -> None:
        density = _number("density", self.density, "a number in (0, 1]")
        if not 0 < density <= 1:  # also refuses NaN
            raise ValueError(
                f"SparseCodec: density must be in (0, 1], got {density!r}; e.g. 0.02 keeps 2% "
                "of each chunk"
            )
        if _integer("bits", self.bits, f"one of {BITS}") not in BITS:
            raise ValueError(f"SparseCodec: bits must be one of {BITS}, got {self.bits!r}")
        if not 2 <= _integer("chunk", self.chunk, "an integer") <= MAX_CHUNK:
            raise ValueError(
                f"SparseCodec: chunk must be in [2, {MAX_CHUNK}] (a position in a chunk is sent "
                f"in at most 16 bits), got {self.chunk!r}; e.g. 4096"
            )
        decay = _number("ef_decay", self.ef_decay, "a number in [0, 1]")
        if not 0 <= decay <= 1:
            raise ValueError(
                f"SparseCodec: ef_decay must be in [0, 1], got {decay!r}; 1.0 is plain error "
                "feedback, SparseLoCo uses 0.95"
            )
        if self.exchange not in EXCHANGES:
            raise ValueError(
                f"SparseCodec: exchange must be one of {EXCHANGES}, got {self.exchange!r}; "
                "'owners' keeps the bytes per worker constant in the number of workers"
            )
        object.__setattr__(self, "density", float(density))
        object.__setattr__(self, "ef_decay", float(decay))

    @property
    def k(self) -> int:
        """Entries sent per chunk."""
        return min(self.chunk, max(1, round(self.density * self.chunk)))

    @property
    def index_bits(self) -> int:
        """Bits of a position in a chunk: ``ceil(log2(chunk))``."""
        return (self.chunk - 1).bit_length()

    def summary(self) -> dict[str, Any]:
        """The settings as plain values (saved in a state, compared across ranks); the default
        exchange is left out, as states saved before it existed have it."""
        values = asdict(self)
        if values["exchange"] == EXCHANGES[0]:
            del values["exchange"]
        return {"codec": "sparse", **values}

    # The codec protocol (hvd_slowmo.compression.codecs.Codec).
    def encode(self, x: Tensor) -> Tensor:
        """:func:`sparse_encode`.

        Args:
            x: the 1-D float32 vector.
        """
        return sparse_encode(x, self)

    def decode(self, packet: Tensor, numel: int) -> Tensor:
        """:func:`sparse_decode_dense`.

        Args:
            packet: from :meth:`encode`.
            numel: the vector's length.
        """
        return sparse_decode_dense(packet, numel, self)

    def packet_nbytes(self, numel: int) -> int:
        """:func:`packet_nbytes`.

        Args:
            numel: the vector's length.
        """
        return packet_nbytes(numel, self)

    def sum_numel(self, numel: int) -> int:
        """The padded length ``ceil(numel / chunk) * chunk`` the all-gather form sums the packets
        into (0 for ``"owners"``, which sums each region at its owner).

        Args:
            numel: the vector's length.
        """
        return _chunks(numel, self.chunk) * self.chunk if self.exchange == "allgather" else 0


def with_feedback(flat: Tensor, residual: Tensor | None, codec: SparseCodec) -> Tensor:
    """What a worker encodes: ``flat``, or with error feedback ``e <- d e + flat`` (the residual
    decayed by ``codec.ef_decay``, updated in place and returned).

    Args:
        flat: this worker's 1-D float32 vector.
        residual: its residual, or None (no error feedback).
        codec: the sparse codec (its ``ef_decay``).
    """
    if residual is None:
        return flat
    if codec.ef_decay != 1.0:
        residual.mul_(codec.ef_decay)
    return residual.add_(flat)


def _chunks(numel: int, chunk: int) -> int:
    return math.ceil(numel / chunk)


def packet_nbytes(numel: int, codec: SparseCodec) -> int:
    """Bytes of the :func:`sparse_encode` packet of a vector of ``numel`` elements.

    Args:
        numel: the vector's length.
        codec: the settings.
    """
    entries = _chunks(numel, codec.chunk) * codec.k
    raw = 8 * _chunks(numel, codec.chunk) + _index_nbytes(entries, codec.index_bits)
    raw += math.ceil(entries * codec.bits / 8)
    return raw + (-raw) % 4


def pack_bits(values: Tensor, width: int) -> Tensor:
    """Pack non-negative integers below ``2 ** width`` into bytes, ``width`` bits each,
    little-endian: bit ``j`` of value ``i`` is bit ``t = i * width + j`` of the stream, and bit
    ``t`` of the stream is bit ``t % 8`` of byte ``t // 8``; the last byte is zero-padded.

    Args:
        values: 1-D integer tensor.
        width: bits per value, 1 to 8.
    """
    values = values.reshape(-1).to(torch.int64)
    if 8 % width == 0:  # whole values per byte: one shift and sum per byte
        per = 8 // width
        values = torch.nn.functional.pad(values, (0, (-values.numel()) % per)).view(-1, per)
        shifts = torch.arange(0, 8, width, device=values.device, dtype=torch.int64)
        return (values << shifts).sum(dim=1).to(torch.uint8)
    shifts = torch.arange(width, device=values.device, dtype=torch.int64)
    stream = ((values[:, None] >> shifts) & 1).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8)).view(-1, 8)
    return (stream << torch.arange(8, device=values.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: Tensor, count: int, width: int) -> Tensor:
    """The first ``count`` values :func:`pack_bits` packed (int64), along the last dimension:
    ``packed`` of shape ``(..., nbytes)`` gives ``(..., count)`` (several packets at once).

    Args:
        packed: uint8, the packed bytes along the last dimension.
        count: how many values.
        width: their width in bits, 1 to 8.
    """
    return _unpack(packed, count, width).to(torch.int64)


def _unpack(packed: Tensor, count: int, width: int) -> Tensor:
    """:func:`unpack_bits` in the narrowest dtype: uint8 where ``width`` divides 8 (the
    values' own bytes, shifted and masked: an eighth of int64's traffic), else int64."""
    lead = packed.shape[:-1]
    if 8 % width == 0:
        shifts = torch.arange(0, 8, width, device=packed.device, dtype=torch.uint8)
        values = (packed[..., None] >> shifts).bitwise_and_((1 << width) - 1)
        return values.reshape(*lead, -1)[..., :count]
    packed = packed.to(torch.int64)
    stream = ((packed[..., None] >> torch.arange(8, device=packed.device)) & 1).reshape(*lead, -1)
    stream = stream[..., : count * width].reshape(*lead, count, width)
    return (stream << torch.arange(width, device=packed.device)).sum(dim=-1)


def _pack_index(index: Tensor, width: int) -> Tensor:
    """Positions of ``width`` bits: with more than 8 bits, their low bytes (one per entry),
    then their high ``width - 8`` bits by :func:`pack_bits`."""
    if width <= 8:
        return pack_bits(index, width)
    return torch.cat([(index & 255).to(torch.uint8), pack_bits(index >> 8, width - 8)])


def _index_nbytes(count: int, width: int) -> int:
    if width <= 8:
        return math.ceil(count * width / 8)
    return count + math.ceil(count * (width - 8) / 8)


def _unpack_index(packed: Tensor, count: int, width: int) -> Tensor:
    """:func:`_pack_index` undone along the last dimension (several packets at once), in a
    narrow integer dtype (uint8 or int32)."""
    if width <= 8:
        return _unpack(packed, count, width)
    high = _unpack(packed[..., count:], count, width - 8).to(torch.int32)
    return high.bitwise_left_shift_(8).bitwise_or_(packed[..., :count])


def sparse_encode(x: Tensor, codec: SparseCodec) -> Tensor:
    """The packet of a 1-D float32 vector (see the module's docstring).

    Args:
        x: the vector (float32, 1-D, any length including 0).
        codec: the settings.
    """
    if _native(x):  # the same bits, in C
        return _native_encode(x, codec)
    return _encode(x, codec)[0]


def sparse_encode_with_feedback(flat: Tensor, codec: SparseCodec, residual: Tensor) -> Tensor:
    """Error feedback's whole encode: ``e <- d e + flat`` (:func:`with_feedback`), the packet of
    ``e``, and ``e`` less what the packet decodes to (:func:`sparse_encode_feedback`); in C one
    pass, a chunk at a time.

    Args:
        flat: this worker's 1-D float32 vector.
        codec: the settings (``ef_decay`` is ``d``).
        residual: its residual ``e`` (float32 of ``flat``'s shape), updated in place.
    """
    if _native(flat, residual):
        return _native_encode(residual, codec, residual, flat)
    return sparse_encode_feedback(with_feedback(flat, residual, codec), codec, residual)


def _native(x: Tensor, *others: Tensor | None) -> bool:
    """Whether the C encode (:mod:`.native`) takes ``x`` (and the vectors beside it)."""
    ok = x.dtype == torch.float32 and x.dim() == 1 and x.numel() > 0 and x.is_contiguous()
    for t in others:
        ok = ok and (
            t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.shape == x.shape)
        )
    return ok and native_usable("sparse", x)


def _native_encode(
    x: Tensor, codec: SparseCodec, residual: Tensor | None = None, add: Tensor | None = None
) -> Tensor:
    return native_sparse_encode(
        x, codec.chunk, codec.k, codec.bits, codec.index_bits, packet_nbytes(x.numel(), codec),
        residual, add, codec.ef_decay,
    )  # fmt: skip


def sparse_encode_feedback(x: Tensor, codec: SparseCodec, residual: Tensor) -> Tensor:
    """:func:`sparse_encode` of ``x`` with error feedback: the packet, and ``residual`` (``x``
    itself, or another vector of its shape) less what the packet decodes to, in place. The
    same bits as ``residual.sub_(sparse_decode_dense(packet, ...))``, without unpacking the
    packet or a dense vector of the decoded values: one ``index_add_`` of the kept entries.

    Args:
        x: the vector (float32, 1-D).
        codec: the settings.
        residual: float32 of ``x``'s shape.
    """
    if _native(x, residual):  # the same bits, in C
        return _native_encode(x, codec, residual)
    packet, index, values = _encode(x, codec)
    numel = x.numel()
    if index.numel():
        position = (
            index
            + torch.arange(0, index.shape[0] * codec.chunk, codec.chunk, device=x.device)[:, None]
        )
        if position.numel() and index.shape[0] * codec.chunk > numel:
            # Entries in the padding of the last chunk: added as -0.0 at the last element,
            # which changes no float (x + -0.0 is x, for every x).
            values = torch.where(position < numel, values, torch.zeros_like(values))
            position = position.clamp_(max=numel - 1)
        # ``residual + (-1) * v`` has the bits of ``residual - v`` (NaN payloads included:
        # the product keeps a NaN's sign, as the difference does).
        residual.index_add_(0, position.view(-1), values.view(-1), alpha=-1)
    return packet


def _top_k(x: Tensor, codec: SparseCodec) -> tuple[Tensor, Tensor]:
    """The kept entries of every chunk of ``x`` (zero-padded to whole chunks): their positions
    in their chunk, by decreasing magnitude (ties: the lower position first), and their values,
    both of shape ``(chunks, k)``; chosen a slice of chunks at a time (about :data:`SLICE`
    elements), so the keys and the padded copy of the last chunk stay a slice's size."""
    c, k = codec.chunk, codec.k
    n_chunks = _chunks(x.numel(), c)
    index = torch.empty(n_chunks, k, dtype=torch.int64, device=x.device)
    kept = torch.empty(n_chunks, k, dtype=x.dtype, device=x.device)
    reverse = torch.arange(c - 1, -1, -1, device=x.device, dtype=torch.int64)
    per = max(1, SLICE // c)
    for first in range(0, n_chunks, per):
        last = min(n_chunks, first + per)
        part = x[first * c : last * c]
        if part.numel() < (last - first) * c:  # the short last chunk, zero-padded
            part = torch.nn.functional.pad(part, (0, (last - first) * c - part.numel()))
        rows = part.view(last - first, c)
        # One int64 key per entry: the magnitude's float32 bits (the sign bit cleared: ordered
        # like the magnitudes, NaN above inf) times 2^16 plus the reversed position, so no two
        # keys tie and top-k is deterministic. The mask written straight into int64 (one
        # pass), then in place (torch.add with an alpha was four times slower here).
        keys = torch.empty(rows.shape, dtype=torch.int64, device=x.device)
        torch.bitwise_and(rows.view(torch.int32), 0x7FFFFFFF, out=keys)
        keys.bitwise_left_shift_(16).bitwise_or_(reverse)
        index[first:last] = keys.topk(k, dim=1, sorted=True).indices
        del keys
        torch.gather(rows, 1, index[first:last], out=kept[first:last])
    return index, kept


def _encode(x: Tensor, codec: SparseCodec) -> tuple[Tensor, Tensor, Tensor]:
    """The packet of ``x``, and its kept entries: their positions in their chunks and the
    values the packet decodes them to (both of shape ``(chunks, k)``)."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(
            f"sparse_encode: need a 1-D float32 tensor, got {x.dtype} of shape {tuple(x.shape)}"
        )
    c, k, b = codec.chunk, codec.k, codec.bits
    n_chunks = _chunks(x.numel(), c)
    if n_chunks == 0:
        empty = torch.empty(0, k, device=x.device)
        return torch.empty(0, dtype=torch.uint8, device=x.device), empty.long(), empty
    index, kept = _top_k(x, codec)
    size = kept.abs()
    lo = size[:, -1].clone()  # size is overwritten below
    step = (size[:, 0] - lo) / ((1 << (b - 1)) - 1)
    divisor = torch.where(step > 0, step, torch.ones_like(step))
    level = size.sub_(lo[:, None]).div_(divisor[:, None]).round_()
    level = level.nan_to_num_(nan=0.0).clamp_(0, (1 << (b - 1)) - 1)
    negative = kept < 0
    codes = level.to(torch.int64) | (negative.to(torch.int64) << (b - 1))
    parts = [
        torch.stack([lo, step]).reshape(-1).view(torch.uint8),  # every lo, then every step
        _pack_index(index.reshape(-1), codec.index_bits),
        pack_bits(codes.reshape(-1), b),
    ]
    packet = torch.cat(parts)
    packet = torch.nn.functional.pad(packet, (0, (-packet.numel()) % 4))
    # What the packet decodes to, as the decode computes it: lo + q * step, one rounding
    # each (level holds q exactly), then the sign.
    decoded = level.mul_(step[:, None]).add_(lo[:, None])
    return packet, index, torch.where(negative, -decoded, decoded)


def _view_f32(buf: Tensor) -> Tensor:
    # A packet received at an offset of a larger buffer may be misaligned for float32.
    # (A slice of several packets' scales is not contiguous either.)
    if buf.storage_offset() % 4 or not buf.is_contiguous():
        buf = buf.clone(memory_format=torch.contiguous_format)
    return buf.view(torch.float32)


def _check_packets(packets: Tensor, numel: int, codec: SparseCodec, what: str) -> None:
    want = packet_nbytes(numel, codec)
    if packets.dtype != torch.uint8 or packets.dim() != 2 or packets.shape[1] != want:
        raise ValueError(
            f"{what}: a packet of {numel} elements with {codec} has {want} bytes, got "
            f"{tuple(packets.shape)} of {packets.dtype}"
        )


def _decode_rows(packets: Tensor, numel: int, codec: SparseCodec) -> tuple[Tensor, Tensor]:
    """:func:`sparse_decode` of ``m`` packets at once (``packets`` of shape ``(m, nbytes)``):
    positions and values of shape ``(m, C * k)``, row ``r`` those of packet ``r``."""
    m = packets.shape[0]
    c, k, b, w = codec.chunk, codec.k, codec.bits, codec.index_bits
    n_chunks = _chunks(numel, c)
    entries = n_chunks * k
    scales = _view_f32(packets[:, : 8 * n_chunks]).view(m, 2, n_chunks, 1)
    lo, step = scales[:, 0], scales[:, 1]
    start = 8 * n_chunks
    index_bytes = _index_nbytes(entries, w)
    index = _unpack_index(packets[:, start : start + index_bytes], entries, w)
    codes = _unpack(packets[:, start + index_bytes :], entries, b).reshape(m, n_chunks, k)
    level = (codes & ((1 << (b - 1)) - 1)).to(torch.float32)
    size = level.mul_(step).add_(lo)  # lo + q * step: one rounding each, as the reference's
    values = torch.where((codes >> (b - 1)) == 1, -size, size)
    offsets = torch.arange(0, n_chunks * c, c, device=packets.device, dtype=torch.int64)
    index = index.reshape(m, n_chunks, k) + offsets[:, None]
    return index.view(m, entries), values.view(m, entries)


def sparse_decode(packet: Tensor, numel: int, codec: SparseCodec) -> tuple[Tensor, Tensor]:
    """The kept entries of a packet: their positions in the padded vector (``ceil(numel /
    chunk) * chunk`` elements, int64, unique) and their decoded values (float32).

    Args:
        packet: 1-D uint8, from :func:`sparse_encode`.
        numel: the encoded vector's length.
        codec: its settings.

    Raises:
        ValueError: the packet's length is not :func:`packet_nbytes`.
    """
    if packet.dim() != 1:
        raise ValueError(f"sparse_decode: need a 1-D packet, got shape {tuple(packet.shape)}")
    _check_packets(packet.view(1, -1), numel, codec, "sparse_decode")
    index, values = _decode_rows(packet.view(1, -1), numel, codec)
    return index.view(-1), values.view(-1)


def sparse_sum(
    packets: Tensor,
    numel: int,
    codec: SparseCodec,
    out: Tensor | None = None,
    divide: int = 1,
) -> Tensor:
    """The sum of the vectors of ``m`` packets, added in row order into float32 zeros: element
    by element ``((0 + v_0) + v_1) + ...`` over the packets that keep it, so every worker that
    sums the same packets gets the same bits.

    One decode of all packets and one ``index_add_`` in row order (torch's CPU ``index_add_``
    adds the entries of its index one after the other; on CUDA the order of the adds into one
    element is not fixed, so the sum is then made packet by packet).

    Args:
        packets: uint8 of shape ``(m, packet_nbytes(numel, codec))``, one packet a row.
        numel: the encoded vectors' length.
        codec: their settings.
        out: a float32 buffer of ``ceil(numel / chunk) * chunk`` elements to sum into (zeroed
            here); None: a new one.
        divide: the sum divided by it (:func:`~hvd_slowmo.divide.div_`: the mean of ``m``
            packets with ``m``); 1: the sum itself.

    Returns:
        The first ``numel`` elements of the sum (a view of ``out``).
    """
    _check_packets(packets, numel, codec, "sparse_sum")
    padded = _chunks(numel, codec.chunk) * codec.chunk
    if out is None:
        out = torch.empty(padded, dtype=torch.float32, device=packets.device)
    if native_usable("sparse", packets) and packets.stride(1) == 1 and out.is_contiguous():
        c = codec
        native_sparse_sum(packets, numel, c.chunk, c.k, c.bits, c.index_bits, out, divide)
        return out[:numel]
    out.zero_()
    index, values = _decode_rows(packets, numel, codec)
    if packets.is_cuda:
        for i, v in zip(index, values):  # a fixed order of the adds into one element
            out.index_add_(0, i, v)
    else:
        out.index_add_(0, index.view(-1), values.view(-1))
    return out[:numel] if divide == 1 else div_(out[:numel], divide)


def sparse_decode_runs(packets: Tensor, sizes: list[int], codec: SparseCodec) -> Tensor:
    """The concatenated vectors of consecutive packets, each a vector of whole chunks but the
    last (the regions of :mod:`~hvd_slowmo.compression.sparse_owners`): the same bits as the
    concatenation of :func:`sparse_decode_dense` of each, decoded a run of equal sizes at a
    time (at most three runs) into one buffer.

    Args:
        packets: 1-D uint8, the packets one after the other.
        sizes: each vector's length; every one but the last a multiple of ``codec.chunk``.
        codec: their settings.
    """
    padded = [_chunks(size, codec.chunk) * codec.chunk for size in sizes]
    out = torch.zeros(sum(padded), dtype=torch.float32, device=packets.device)
    start = byte = i = 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        count, nbytes = j - i, packet_nbytes(sizes[i], codec)
        if sizes[i]:
            rows = packets[byte : byte + count * nbytes].view(count, nbytes)
            _check_packets(rows, sizes[i], codec, "sparse_decode_runs")
            index, values = _decode_rows(rows, sizes[i], codec)
            index += torch.arange(
                start, start + count * padded[i], padded[i], device=packets.device
            )[:, None]
            out.index_put_((index.view(-1),), values.view(-1))
        start, byte, i = start + count * padded[i], byte + count * nbytes, j
    return out[: sum(sizes)]


def sparse_decode_dense(packet: Tensor, numel: int, codec: SparseCodec) -> Tensor:
    """The float32 vector of ``numel`` elements a packet stands for (zeros where nothing was
    kept).

    Args:
        packet: 1-D uint8, from :func:`sparse_encode`.
        numel: the encoded vector's length.
        codec: its settings.
    """
    if packet.dim() != 1:
        raise ValueError(f"sparse_decode_dense: need a 1-D packet, got {tuple(packet.shape)}")
    _check_packets(packet.view(1, -1), numel, codec, "sparse_decode_dense")
    index, values = _decode_rows(packet.view(1, -1), numel, codec)
    dense = torch.zeros(_chunks(numel, codec.chunk) * codec.chunk, device=packet.device)
    return dense.index_put_((index.view(-1),), values.view(-1))[:numel]
