"""The dense scaled codecs' arithmetic (``int8``, ``fp8``) as fused CPU kernels, the same bits
as the eager path of :mod:`hvd_slowmo.compression.codecs` (``DenseCodec(name,
kernels="compiled")``).

The eager path runs each step of an encode (absolute values, block maxima, scales, quotients,
rounding, the cast, the decode and the residual's update) as its own torch op, a pass over
memory each. Here every step of one phase of the exchange (:mod:`.exchange`) is one function
compiled by ``torch.compile(dynamic=True)`` (inductor: generated C++), called a slice of
columns at a time:

* :func:`encode_rows`: each row's contribution (with error feedback ``flat + residual``, the
  residual then less what the codes decode to) into codes and scales;
* :func:`reduce`: the received packets decoded, summed in rank order, divided by the workers'
  count (an IEEE division, as :func:`hvd_slowmo.divide.div_`) and encoded again;
* :func:`decode_rows`: the gathered packets into the mean's buffer.

Each op is the eager path's, in the same order, so the codes, scales, residuals and means are
bitwise the eager ones (tests/test_fused_codecs.py); where inductor's C++ picks other bits
than torch's eager kernels (a NaN's payload and sign, a NaN's int8 code, which of two NaNs a
product yields) the eager bits are made explicit, as measured on x86 with this torch. A kernel
is compiled at its first call in a process, and again for another codec, block size, workers'
count (the reduce's sum is unrolled) or intra-op thread count (dynamo allows 8 per kernel, then
runs it uncompiled): tens of seconds, then cached by torch on disk
(``/tmp/torchinductor_<user>``), so a later process spends seconds. CPU tensors only:
:mod:`.exchange` keeps the eager path on a GPU, where torch's own kernels are already fast and
a Triton kernel's float32 division may not be the correctly rounded one the bits depend on.

SlowMo's compressed outer exchange (arXiv 1910.00643): the pseudo-gradient's codes.
"""

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .codecs import (
    _CODE_DTYPE,
    _CODE_MAX,
    BLOCK_SIZE,
    _fp8_values,
    column_slices,
    encoded_nbytes,
)

__all__ = ["decode_rows", "encode_rows", "ready", "reduce", "warm_up"]


def _quantize(
    x: Tensor, codes: Tensor, scales: Tensor, codec: str, block: int, table: Tensor | None
) -> Tensor:
    """``x`` (1-D float32 of ``n``, traced) encoded into ``codes`` (``n``, the codec's dtype)
    and ``scales`` (float32, one per block and a spare one: :func:`_scales`):
    :func:`~.codecs._scaled`'s ops on the blocks, the short last one zero padded; returns what
    the codes decode to, ``(blocks, block)``."""
    n = x.shape[0]
    _, rows = _blocks(n, block)
    code_max = _CODE_MAX[codec]
    padded = F.pad(x, (0, rows * block - n)).view(rows, block)
    amax = padded.abs().amax(dim=1)
    # Inductor's maximum yields an all-ones NaN for a NaN, torch's eager one the block's NaN
    # (its sign cleared by abs: the quiet NaN 0x7fc00000 for every NaN that arithmetic or
    # float("nan") makes): that one, so a NaN scale has the eager bits.
    amax = torch.where(amax.isnan(), torch.full_like(amax, float("nan")), amax)
    # Divided by a tensor, as the eager path: a correctly rounded division (not a product
    # with 1/127's rounded reciprocal, one ulp off for some maxima).
    scale = amax / torch.full_like(amax, code_max)
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    quotient = padded / divisor[:, None]
    if codec == "int8":
        quotient = quotient.round()
    # A NaN quotient (a NaN, or an infinity over an infinite scale): inductor's clamp makes it
    # an all-ones NaN, torch's eager clamp keeps it (and fp8's NaN code keeps its sign); int8
    # has no NaN: torch's eager cast truncates the CPU's invalid-conversion result to 0 (x86
    # and ARM), inductor's saturates it to -128. The eager values, made explicit.
    nan = torch.zeros_like(quotient) if codec == "int8" else quotient
    quotient = torch.where(quotient.isnan(), nan, quotient.clamp(-code_max, code_max))
    code = quotient.to(_CODE_DTYPE[codec])
    codes.copy_(code.view(-1)[:n])
    # All the rows' scales, the padding block's too (0, into the spare scale or the next
    # slice's first, which its own call writes after): a copy of the blocks alone would compile
    # again for one block.
    scales[:rows].copy_(scale)
    # The codes decoded, as the eager path decodes them (not the quotients: a NaN's code).
    return _times(_values(code, table), scale)


def _values(codes: Tensor, table: Tensor | None) -> Tensor:
    """``codes`` as float32 (traced): ``fp8`` by a look-up in ``table`` (the eager
    :func:`~.codecs._fp8_values`: inductor's cast makes every NaN code the quiet NaN, torch's
    keeps more bits), ``int8`` by the cast."""
    if table is None:
        return codes.to(torch.float32)
    return table[codes.view(torch.uint8).to(torch.int64)]


def _decoded(codes: Tensor, scales: Tensor, block: int, table: Tensor | None) -> Tensor:
    """The 1-D float32 values of ``codes`` (traced): each code times its block's scale."""
    n = codes.shape[0]
    _, rows = _blocks(n, block)
    values = F.pad(_values(codes, table), (0, rows * block - n)).view(rows, block)
    return _times(values, scales[:rows]).view(-1)[:n]


def _blocks(n: Any, block: int) -> tuple[Any, Any]:
    """The blocks of ``n`` elements (traced), and the rows of the padded matrix they are made
    into: at least 2, since dynamo compiles again for a matrix of one row (the padding's
    block has scale 0, or the buffer's spare scale: its values are never written)."""
    blocks = (n + block - 1) // block
    return blocks, torch.sym_max(blocks, 2)


def _times(values: Tensor, scales: Tensor) -> Tensor:
    """``values`` (``(blocks, block)``, traced) times their block's scale. Which NaN a product
    of two NaNs (an fp8 NaN code in a block whose scale is NaN) yields is the compiler's
    choice of operand order: torch's eager kernel yields the scale's, so here too, explicitly."""
    scale = scales[:, None]
    return torch.where(scale.isnan(), scale, values * scale)


def _encode_kernel(codec: str, block: int, feedback: bool) -> Callable[..., None]:
    """The encode of a row: ``(flat, codes, scales, table)``, or ``(flat, residual, codes,
    scales, table)`` with ``residual`` set to ``flat + residual`` less what the codes decode
    to."""

    def encode(flat: Tensor, codes: Tensor, scales: Tensor, table: Tensor | None) -> None:
        _quantize(flat, codes, scales, codec, block, table)

    def encode_feedback(
        flat: Tensor, residual: Tensor, codes: Tensor, scales: Tensor, table: Tensor | None
    ) -> None:
        x = flat + residual  # operands in the eager order (which NaN a sum of NaNs yields)
        back = _quantize(x, codes, scales, codec, block, table).view(-1)[: x.shape[0]]
        residual.copy_(x - back)

    return encode_feedback if feedback else encode


def _reduce_kernel(codec: str, block: int, workers: int) -> Callable[..., None]:
    """The reduce of ``workers`` packets: ``(codes_0, .., codes_{m-1}, scales_0, ..,
    scales_{m-1}, codes, scales, table)``."""

    def reduce_(*args: Any) -> None:
        received, (out_codes, out_scales, table) = args[: 2 * workers], args[2 * workers :]
        total = _decoded(received[0], received[workers], block, table)
        for src in range(1, workers):  # unrolled: row 0 + row 1 + ..., the eager loop's order
            total = total + _decoded(received[src], received[workers + src], block, table)
        mean = total / torch.full((), float(workers), dtype=torch.float32)  # as div_
        _quantize(mean, out_codes, out_scales, codec, block, table)

    return reduce_


def _decode_kernel(codec: str, block: int) -> Callable[..., None]:
    """The decode of a row: ``(codes, scales, out, table)``."""

    def decode(codes: Tensor, scales: Tensor, out: Tensor, table: Tensor | None) -> None:
        out.copy_(_decoded(codes, scales, block, table))

    return decode


#: The compiled kernels of this process, by (phase, codec, block, variant).
_KERNELS: dict[tuple[str, str, int, Any], Callable[..., None]] = {}
# Held through every call: thread workers calling a kernel for the first time at once would
# each compile it (dynamo's cache is checked before its compile lock is taken); uncontended
# where a process runs one worker.
_LOCK = threading.Lock()


def _kernel(phase: str, codec: str, block: int, variant: Any) -> Callable[..., None]:
    """The compiled kernel of ``phase`` (made lazily, once per process; the compile itself
    happens at its first call)."""
    key = (phase, codec, block, variant)
    with _LOCK:  # one function object per kernel
        fn = _KERNELS.get(key)
        if fn is None:
            if phase == "encode":
                make = _encode_kernel(codec, block, variant)
            elif phase == "reduce":
                make = _reduce_kernel(codec, block, variant)
            else:
                make = _decode_kernel(codec, block)
            fn = _KERNELS[key] = torch.compile(make, dynamic=True)
    return fn


def _call(kernel: Callable[..., None], codec: str, *tensors: Tensor) -> None:
    """``kernel`` of ``tensors``, each seen anew at storage offset 0 (through DLPack: the same
    memory, no copy) and the fp8 look-up table last: dynamo specializes a view's storage offset
    (0, and a value equal to one of the sizes, each its own compile of tens of seconds), so
    rows of one matrix would compile the kernel up to three times."""
    table = _fp8_values(tensors[0].device) if codec == "fp8" else None
    operands = [torch.from_dlpack(t.detach()) for t in tensors]
    # Without autograd, always: dynamo compiles again when the grad mode changes.
    with _LOCK, torch.no_grad():
        kernel(*operands, table)


def _slices(size: int, block: int) -> list[tuple[int, int]]:
    """:func:`~.codecs.column_slices` of one row, a last slice of one element joined to the
    one before (dynamo specializes a size of 1: a compile of its own). The encode and the
    reduce run a slice at a time: inductor writes a kernel's float32 result (the residual,
    the mean) into a buffer of its own before the copy into place, so the buffer stays a
    slice's size, and in the cache."""
    slices = column_slices(size, 1, block)
    if len(slices) > 1 and slices[-1][1] - slices[-1][0] == 1:
        slices[-2:] = [(slices[-2][0], size)]
    return slices


def _scales(count: int, blocks: int, device: torch.device) -> Tensor:
    """A float32 buffer of ``count`` rows of ``blocks`` scales and a spare one: dynamo
    specializes a size of 1, so chunks of one block would compile each kernel again."""
    return torch.empty(count, blocks + 1, dtype=torch.float32, device=device)


def _split(packets: Tensor, size: int, codec: str, block: int) -> tuple[Tensor, Tensor]:
    """``packets`` (uint8, ``(count, encoded_nbytes(size))``) as codes (a view) and scales (a
    float32 copy, :func:`_scales`: the scales' bytes need not be 4-byte aligned; 4 bytes per
    block)."""
    blocks = -(-size // block)
    scales = _scales(packets.shape[0], blocks, packets.device)
    scales[:, :blocks].view(torch.uint8).copy_(packets[:, : 4 * blocks])
    return packets[:, 4 * blocks :].view(_code_dtype(codec)), scales


def _code_dtype(codec: str) -> torch.dtype:
    dtype = _CODE_DTYPE[codec]
    assert dtype is not None, "check_codec refuses fp8 where torch has no float8_e4m3fn"
    return dtype


def encode_rows(
    rows: Tensor, codec: str, block: int, out: Tensor, residual: Tensor | None = None
) -> None:
    """Every row of a matrix encoded as a vector of its own into ``out``: the bits of
    :func:`~.codecs.encode_rows` (``decoded=False``; with a residual, ``feedback=True`` on
    the rows of ``torch.add(rows, residual, out=residual)``).

    Args:
        rows: float32 of shape ``(count, size)`` (a run of an exchange's equal chunks).
        codec: ``int8`` or ``fp8``.
        block: elements per scale; the blocks restart at every row.
        out: uint8 of shape ``(count, encoded_nbytes(size))``, the packets' rows.
        residual: the rows' error-feedback residual (``rows``' shape), set in place to
            ``rows + residual`` less what the packets decode to; None: no error feedback.
    """
    count, size = rows.shape
    if size == 0:
        return
    blocks = -(-size // block)
    codes = out[:, 4 * blocks :].view(_code_dtype(codec))
    scales = _scales(count, blocks, rows.device)
    kernel = _kernel("encode", codec, block, residual is not None)
    for r in range(count):
        for start, stop in _slices(size, block):
            cols = slice(start, stop)
            # The slice's blocks and the next scale (the spare one for the last slice).
            first = start // block
            its_scales = scales[r, first : first + -(-(stop - start) // block) + 1]
            operands = (rows[r, cols],) if residual is None else (rows[r, cols], residual[r, cols])
            _call(kernel, codec, *operands, codes[r, cols], its_scales)
    out[:, : 4 * blocks].copy_(scales[:, :blocks].view(torch.uint8))


def reduce(packets: Tensor, size: int, codec: str, block: int) -> Tensor:
    """The reduced packet of the received ones: their sum in rank order, divided by their
    count, encoded; the bits of the eager reduce (:mod:`.exchange`).

    Args:
        packets: uint8 of shape ``(m, encoded_nbytes(size))``, one per worker in rank order.
        size: the chunk's elements.
        codec: ``int8`` or ``fp8``.
        block: elements per scale.

    Returns:
        A new uint8 packet of ``encoded_nbytes(size)`` bytes.
    """
    workers = packets.shape[0]
    reduced = packets.new_empty(encoded_nbytes(size, codec, block))
    if size == 0:
        return reduced
    codes, scales = _split(packets, size, codec, block)
    blocks = scales.shape[1] - 1
    mean_scales = _scales(1, blocks, packets.device)[0]
    kernel = _kernel("reduce", codec, block, workers)
    out_codes = reduced[4 * blocks :].view(codes.dtype)
    for start, stop in _slices(size, block):
        first, last = start // block, -(-stop // block) + 1  # and the next (spare) scale
        received = [*codes[:, start:stop].unbind(0), *scales[:, first:last].unbind(0)]
        _call(kernel, codec, *received, out_codes[start:stop], mean_scales[first:last])
    reduced[: 4 * blocks].copy_(mean_scales[:blocks].view(torch.uint8))
    return reduced


def decode_rows(packets: Tensor, size: int, codec: str, block: int, out: Tensor) -> Tensor:
    """Packets of equal vectors decoded into ``out``, one a row: the bits of
    :func:`~.codecs.decode_rows`.

    Args:
        packets: uint8 of shape ``(count, encoded_nbytes(size))``.
        size: each vector's length.
        codec: ``int8`` or ``fp8``.
        block: elements per scale.
        out: float32 of shape ``(count, size)`` (rows of a larger buffer, e.g.).

    Returns:
        ``out``.
    """
    if size == 0:
        return out
    codes, scales = _split(packets, size, codec, block)
    kernel = _kernel("decode", codec, block, None)
    for r in range(packets.shape[0]):
        _call(kernel, codec, codes[r], scales[r], out[r])
    return out


def warm_up(codec: str, workers: int, block: int = BLOCK_SIZE, feedback: bool = True) -> None:
    """Compile now the kernels a mean of ``workers`` workers runs (the encode, with or without
    error feedback, the reduce, the decode), on a small made-up chunk: the first outer step
    then does not wait for the compiler (tens of seconds the first time on a machine, seconds
    from torch's disk cache). Kernels are compiled for the intra-op thread count in force:
    call it where the training sets it. Not collective.

    Args:
        codec: ``int8`` or ``fp8``.
        workers: the workers of the mean (the reduce is compiled per count).
        block: elements per scale.
        feedback: the encode with error feedback (else the plain one).
    """
    size = 2 * block + 3  # whole blocks and a short one: the shapes of any chunk
    rows = torch.zeros(workers, size)
    packets = torch.empty(workers, encoded_nbytes(size, codec, block), dtype=torch.uint8)
    encode_rows(rows, codec, block, packets, torch.zeros_like(rows) if feedback else None)
    reduce(packets, size, codec, block)
    decode_rows(packets, size, codec, block, torch.empty_like(rows))


#: Whether the kernels of a mean compiled here, by (codec, block, workers, feedback, threads).
_READY: dict[tuple[str, int, int, bool, int], bool] = {}
_READY_LOCK = threading.Lock()  # not _LOCK: warm_up's calls take that one


def ready(codec: str, workers: int, block: int = BLOCK_SIZE, feedback: bool = True) -> bool:
    """Whether the fused kernels of a mean run here: :func:`warm_up` once per setting, before
    any of the mean's data is touched. Where torch cannot compile them (no C++ compiler; torch
    2.14's inductor under ``ATEN_CPU_CAPABILITY=default`` writes code its own header does not
    declare), False, with a warning: the eager kernels run instead, the same bits, so training
    goes on and every rank still agrees whichever path each took.

    Args:
        codec: ``int8`` or ``fp8``.
        workers: the workers of the mean.
        block: elements per scale.
        feedback: the encode with error feedback.
    """
    key = (codec, block, workers, feedback, torch.get_num_threads())
    with _READY_LOCK:
        if key not in _READY:
            try:
                warm_up(codec, workers, block, feedback)
                _READY[key] = True
            except Exception as e:  # any compiler failure: the eager path has the same bits
                first = (str(e).strip().splitlines() or [""])[0][:200]
                warnings.warn(
                    f"kernels='compiled': torch.compile failed here ({type(e).__name__}: "
                    f"{first}); the {codec} mean runs the eager kernels instead (the same "
                    "bits, slower); pass kernels='eager' to silence this",
                    RuntimeWarning,
                    stacklevel=2,
                )
                _READY[key] = False
        return _READY[key]
