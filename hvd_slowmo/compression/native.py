"""The int8, fp8, fp16 and bf16 codecs' encode, reduce and decode as C loops (``kernels.c``), one
pass over memory each: the bits of the eager torch path, several times faster on a CPU.

The eager path (:mod:`.codecs`, :mod:`.exchange`) runs each step of an encode (the error
feedback's sum, magnitudes, block maxima, scales, quotients, rounding, clamping, the cast, the
decode, the residual's update) as its own torch op, a pass over memory each, a slice at a time.
Here each phase of the compressed mean is one loop, in C:

* :func:`encode_rows`: a run of equal chunks (error feedback included) into their packets;
* :func:`reduce`: the received packets decoded, summed in rank order, divided by the workers'
  count and encoded again;
* :func:`decode_rows`: the gathered packets into the mean's buffer.

The C code runs the eager path's IEEE float32 operations in its order, compiled without
``-ffast-math`` and with ``-ffp-contract=off`` (no fused multiply-add), so codes, scales,
residuals and means are bitwise the eager ones (``tests/test_native_codecs.py``). A NaN stays a
NaN in the same places, but which NaN (its payload and sign) is not promised: torch's own
kernels differ there too (its vectorized subtraction is a fused multiply-add, the one under
``ATEN_CPU_CAPABILITY=default`` is not).

The library is compiled on first use with the C compiler Horovod's build needs anyway (``$CC``,
else ``cc``), ``-march=native`` where the compiler takes it, into ``$HVD_SLOWMO_CACHE``
(default ``~/.cache/hvd_slowmo``), keyed by the source, the compiler, its flags and the CPU's
features: a machine compiles it once (about a second), and a home shared by unlike machines
keeps one build per kind. Where no compiler works, a ``RuntimeWarning`` says so once and the
eager path runs: the same bits. ``HVD_SLOWMO_NATIVE_CODECS=0`` keeps the eager path. CPU
tensors only: on a GPU the eager path's kernels are already at memory speed.

The sparse codec's encode, error feedback included (:func:`sparse_encode`: the top-k, the
quantization, the packing), and the sum of the gathered packets (:func:`sparse_sum`) run here
too.

The blocks of a phase are split between ``torch.get_num_threads()`` OpenMP threads, as torch's
own ops split theirs (ctypes releases the GIL while C runs). Built with ``-fopenmp`` (where the
compiler has it), the library names ``libgomp.so.1``, the runtime torch's wheels have already
loaded: so both share one OpenMP runtime. With a thread pool of its own, torch's idle threads,
spinning after its last op, took the cores from the pool's, and the mean ran slower on 2
threads than on 1.

SlowMo's compressed outer exchange (arXiv 1910.00643): the pseudo-gradient's codes.
"""

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CODECS",
    "decode_rows",
    "encode_rows",
    "reduce",
    "sparse_encode",
    "sparse_sum",
    "usable",
]

#: The codecs with C kernels.
CODECS = ("int8", "fp8", "fp16", "bf16")

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
#: Tried in turn: the first the compiler takes is built.
_VARIANTS: tuple[list[str], ...] = (
    ["-march=native", "-fopenmp"],
    ["-fopenmp"],
    ["-march=native"],
    [],
)
#: Elements below which a phase runs on one thread (a parallel region costs more than it saves).
_MIN_PER_THREAD = 65536
#: The casts' unit of work (they have no blocks): a thread's share is a whole number of them.
_CAST_UNIT = 256

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), so a cache shared by unlike machines keeps a build each."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(cc: str, flags: list[str], out: Path) -> None:
    """``kernels.c`` compiled into ``out`` (written whole, then renamed: ranks that compile at
    once each rename a complete file)."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [cc, *flags, str(_SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> Path:
    """The compiled library's path, compiled first where the cache lacks it."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    cache = Path(os.environ.get("HVD_SLOWMO_CACHE", Path.home() / ".cache" / "hvd_slowmo"))
    cache.mkdir(parents=True, exist_ok=True)
    last: subprocess.CalledProcessError | None = None
    for extra in _VARIANTS:
        flags = _FLAGS + extra
        key = "\0".join([_SOURCE.read_text(), cc, version, *flags, _cpu_features()])
        path = cache / f"kernels-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        if path.exists():
            return path
        try:
            _compile(cc, flags, path)
            return path
        except subprocess.CalledProcessError as e:  # e.g. a compiler without -march=native
            last = e
    assert last is not None
    raise RuntimeError(f"{cc} failed: {last.stderr.strip()[-500:]}")


def _load() -> ctypes.CDLL | None:
    """The library, built and loaded once per process; None where it cannot be (warned once)."""
    global _LIB, _TRIED
    if _TRIED:  # every mean asks: no lock once the answer is known
        return _LIB
    with _LOCK:
        if not _TRIED:
            _TRIED = True
            try:
                lib = ctypes.CDLL(str(_build()))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(
                    f"hvd_slowmo: the codecs' C kernels could not be built ({e}); the eager "
                    "torch path runs instead (the same bits, slower on a CPU)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return None
            p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            for codec in CODECS:
                encode, decode, reduce_ = (
                    getattr(lib, f"hvd_{codec}_{phase}")
                    for phase in ("encode_rows", "decode_rows", "reduce")
                )
                encode.argtypes = [p, p, i64, i64, i64, p, i64, i32]
                decode.argtypes = [p, i64, i64, i64, i64, p, i32]
                reduce_.argtypes = [p, i64, i64, i64, p, p, i32]
                for fn in (encode, decode, reduce_):
                    fn.restype = None
            f32 = ctypes.c_float
            lib.hvd_sparse_encode.argtypes = [
                *(p, p, p, f32, i64, i64, i64, i32, i32),
                *(p, p, p, p, i64, i32),
            ]
            lib.hvd_sparse_sum.argtypes = [p, i64, i64, i64, i64, i64, i32, i32, f32, p, i32]
            for fn in (lib.hvd_sparse_encode, lib.hvd_sparse_sum):
                fn.restype = None
            _LIB = lib
    return _LIB


def usable(codec: str, t: Tensor) -> bool:
    """Whether the C kernels run ``codec``'s phases on ``t``'s device here: one of
    :data:`CODECS` (or ``"sparse"``: :func:`sparse_encode`, :func:`sparse_sum`) on a CPU, not
    turned off by ``HVD_SLOWMO_NATIVE_CODECS=0``, and the library built.

    Args:
        codec: the codec's name.
        t: a tensor of the mean (its device decides).
    """
    if (codec not in CODECS and codec != "sparse") or t.device.type != "cpu":
        return False
    if os.environ.get("HVD_SLOWMO_NATIVE_CODECS", "1") == "0":
        return False
    return _load() is not None


def _threads(elements: int) -> int:
    """Threads for a phase over ``elements``: torch's intra-op count, one for a small phase."""
    return max(1, min(torch.get_num_threads(), elements // _MIN_PER_THREAD))


def _kernel(codec: str, phase: str) -> Any:
    """The C function of ``codec``'s ``phase``."""
    assert codec in CODECS
    return _kernel_named(f"hvd_{codec}_{phase}")


def _kernel_named(name: str) -> Any:
    """The C function ``name`` of the library."""
    lib = _load()
    assert lib is not None, "usable() first"
    return getattr(lib, name)


def _unit(codec: str, block: int) -> int:
    """Elements per unit of work: a scaled codec's block (int8, fp8), the casts'
    :data:`_CAST_UNIT`."""
    return block if codec in ("int8", "fp8") else _CAST_UNIT


def _rows(t: Tensor, dtype: torch.dtype, what: str) -> int:
    """The row stride of ``t``, a CPU matrix of ``dtype`` with contiguous rows."""
    assert t.dtype == dtype and t.device.type == "cpu", f"{what}: {t.dtype} on {t.device}"
    assert t.dim() == 2 and t.stride(1) == 1, f"{what}: rows must be contiguous"
    return t.stride(0)


def encode_rows(
    codec: str,
    rows: Tensor,
    block: int,
    out: Tensor,
    source: Tensor | None = None,
    feedback: bool = False,
) -> None:
    """Every row of a matrix encoded as a vector of its own into ``out``: the bits of
    :func:`~.codecs.encode_rows` (``decoded=False``).

    Args:
        codec: one of :data:`CODECS`.
        rows: float32 ``(count, size)``, rows packed one after the other: the values, or with
            ``feedback`` the residual's rows, which are set in place to ``source + rows`` less
            what the packets decode to.
        block: elements per scale (int8); the blocks restart at every row.
        out: uint8 ``(count, encoded_nbytes(size))`` with contiguous rows, the packets.
        source: with ``feedback``, the values added to the residual's rows first (``source +
            residual``, in this order; rows packed as ``rows``', another buffer); None:
            ``rows`` hold the values.
        feedback: error feedback on ``rows`` (the residual).
    """
    count, size = rows.shape
    if count * size == 0:  # empty chunks (fewer elements than workers): no packet bytes
        return
    assert _rows(rows, torch.float32, "rows") == size, "rows: packed one after the other"
    values = source if source is not None else rows
    assert _rows(values, torch.float32, "source") == size and values.shape == rows.shape
    stride = _rows(out, torch.uint8, "out")
    residual = rows.data_ptr() if feedback else None
    _kernel(codec, "encode_rows")(
        values.data_ptr(), residual, count, size, _unit(codec, block), out.data_ptr(), stride,
        _threads(count * size),
    )  # fmt: skip


def reduce(
    codec: str, packets: list[Tensor], size: int, block: int, out: Tensor | None = None
) -> Tensor:
    """The reduced packet of the received ones: decoded, summed in rank order, divided by their
    count, encoded; the bits of the eager reduce (:class:`~.exchange.PendingMean`).

    Args:
        codec: one of :data:`CODECS`.
        packets: uint8, ``encoded_nbytes(size)`` each, one per worker in rank order (read where
            they lie: no copy into one matrix).
        size: the chunk's elements.
        block: elements per scale (int8).
        out: a contiguous uint8 buffer of one packet's bytes to write it into, or None: a new one.

    Returns:
        The uint8 packet: ``out``, or a new one.
    """
    unit, m = _unit(codec, block), len(packets)
    if size == 0:
        return packets[0].new_empty(0)
    for p in packets:
        assert p.dtype == torch.uint8 and p.device.type == "cpu" and p.is_contiguous()
    reduced = packets[0].new_empty(packets[0].numel()) if out is None else out
    assert reduced.dtype == torch.uint8 and reduced.is_contiguous()
    assert reduced.numel() == packets[0].numel()
    threads = _threads(m * size)
    scratch = torch.empty(threads * unit, dtype=torch.float32)  # one unit's sum a thread
    pointers = (ctypes.c_void_p * m)(*(p.data_ptr() for p in packets))
    _kernel(codec, "reduce")(
        pointers, m, size, unit, reduced.data_ptr(), scratch.data_ptr(), threads
    )
    return reduced


def decode_rows(codec: str, packets: Tensor, size: int, block: int, out: Tensor) -> Tensor:
    """Packets of equal vectors decoded into ``out``, one a row: the bits of
    :func:`~.codecs.decode_rows`.

    Args:
        codec: one of :data:`CODECS`.
        packets: uint8 ``(count, encoded_nbytes(size))`` with contiguous rows.
        size: each vector's length.
        block: elements per scale (int8).
        out: float32 ``(count, size)``, rows packed one after the other (rows of a larger
            buffer, e.g.).

    Returns:
        ``out``.
    """
    count = packets.shape[0]
    if count * size == 0:
        return out
    stride = _rows(packets, torch.uint8, "packets")
    assert _rows(out, torch.float32, "out") == size and out.shape[0] == count
    _kernel(codec, "decode_rows")(
        packets.data_ptr(), stride, count, size, _unit(codec, block), out.data_ptr(),
        _threads(count * size),
    )  # fmt: skip
    return out


def sparse_sum(
    packets: Tensor,
    numel: int,
    chunk: int,
    k: int,
    bits: int,
    index_bits: int,
    out: Tensor,
    divisor: int = 1,
) -> Tensor:
    """The sum of sparse packets, decoded and added in row order from zeros a chunk at a time,
    divided by ``divisor`` and written into ``out``: the bits of :func:`~.sparse.sparse_sum`'s
    ``index_add_`` and :func:`~hvd_slowmo.divide.div_`.

    Args:
        packets: uint8 ``(m, nbytes)`` with contiguous rows, one packet each.
        numel: the encoded vectors' length.
        chunk: elements per chunk.
        k: entries kept per chunk.
        bits: bits per code.
        index_bits: bits per position.
        out: contiguous float32 of ``ceil(numel / chunk) * chunk`` elements.
        divisor: the sum is divided by it (an IEEE float32 division); 1: not divided.

    Returns:
        ``out``.
    """
    stride = _rows(packets, torch.uint8, "packets")
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert out.numel() == -(-numel // chunk) * chunk
    if numel:
        _kernel_named("hvd_sparse_sum")(
            packets.data_ptr(), stride, packets.shape[0], numel, chunk, k, bits, index_bits,
            float(divisor), out.data_ptr(), _threads(packets.shape[0] * numel),
        )  # fmt: skip
    return out


def sparse_encode(
    x: Tensor, chunk: int, k: int, bits: int, index_bits: int, nbytes: int,
    residual: Tensor | None = None, add: Tensor | None = None, decay: float = 1.0,
) -> Tensor:  # fmt: skip
    """The sparse codec's packet of ``x``: per chunk the ``k`` entries of the largest magnitudes
    (through a sampled threshold and the candidates' counted ranks; the lists of the eager
    ``topk`` of the codec's tie-free keys), their lo and step, positions and codes; the bits of
    :func:`~.sparse.sparse_encode`. With ``residual``, what the packet decodes to is subtracted
    from it in place (:func:`~.sparse.sparse_encode_feedback`).

    Args:
        x: contiguous 1-D float32 on the CPU, at least one element.
        chunk: elements per chunk (at most 2^16: the keys' low 16 bits are the position).
        k: entries kept per chunk, ``1 <= k <= chunk``.
        bits: bits per code.
        index_bits: bits per position.
        nbytes: the packet's bytes (:func:`~.sparse.packet_nbytes`).
        residual: contiguous float32 of ``x``'s shape (``x`` itself, or another), or None.
        add: with ``residual`` as ``x``: each chunk of the residual is set to ``decay *
            residual + add`` before it is encoded (:func:`~.sparse.with_feedback`, the bits of
            its ``mul_`` and ``add_``); None: no sum.
        decay: the residual's factor with ``add`` (1.0: no product).
    """
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
    assert 1 <= k <= chunk <= 1 << 16 and x.numel() > 0
    for t in (residual, add):
        assert t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.shape == x.shape)
    assert add is None or residual is x, "add: the residual is the encoded vector"
    entries = -(-x.numel() // chunk) * k
    packet = torch.empty(nbytes, dtype=torch.uint8)
    positions = torch.empty(entries, dtype=torch.int16)
    codes = torch.empty(entries, dtype=torch.uint8)
    threads = _threads(x.numel())
    scratch = torch.empty(threads * (2 * chunk + 2 * k), dtype=torch.int64)  # a thread's keys
    _kernel_named("hvd_sparse_encode")(
        x.data_ptr(), None if residual is None else residual.data_ptr(),
        None if add is None else add.data_ptr(), decay, x.numel(), chunk, k, bits, index_bits,
        packet.data_ptr(), positions.data_ptr(), codes.data_ptr(), scratch.data_ptr(), nbytes,
        threads,
    )  # fmt: skip
    return packet
