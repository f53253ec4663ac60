"""The int8, fp16 and bf16 codecs' encode, reduce and decode as C loops (``kernels.c``), one
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
tensors only: on a GPU the eager path's kernels are already at memory speed. fp8 and the sparse
codec keep their eager paths.

The work of a phase is split between ``torch.get_num_threads()`` threads (ctypes releases the
GIL while C runs), as torch's own ops split theirs.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["CODECS", "decode_rows", "encode_rows", "reduce", "usable"]

#: The codecs with C kernels.
CODECS = ("int8", "fp16", "bf16")

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ["-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno"]
#: Elements below which a phase runs on the calling thread alone (a thread's hand-off costs
#: more than it saves).
_MIN_PER_THREAD = 65536
#: The casts' unit of work (they have no blocks): a thread's share is a whole number of them.
_CAST_UNIT = 256

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
#: The threads that run the shares of a phase beside the caller's, and their count.
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _forget_pool() -> None:
    """A forked child has none of its parent's threads: it makes its own pool."""
    global _POOL, _POOL_SIZE
    _POOL, _POOL_SIZE = None, 0


os.register_at_fork(after_in_child=_forget_pool)


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
    for flags in (_FLAGS + ["-march=native"], _FLAGS):
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
    with _LOCK:
        if not _TRIED:
            _TRIED = True
            try:
                lib = ctypes.CDLL(str(_build()))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(
                    f"hvd_slowmo: the int8 codec's C kernels could not be built ({e}); the eager "
                    "torch path runs instead (the same bits, slower on a CPU)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return None
            p, i64 = ctypes.c_void_p, ctypes.c_int64
            for codec in CODECS:
                encode, decode, reduce_ = (
                    getattr(lib, f"hvd_{codec}_{phase}") for phase in ("encode", "decode", "reduce")
                )
                encode.argtypes = [p, p, i64, i64, p, i64, i64]
                decode.argtypes = [p, i64, i64, p, i64, i64]
                reduce_.argtypes = [p, i64, i64, i64, p, p, i64, i64]
                for fn in (encode, decode, reduce_):
                    fn.restype = None
            _LIB = lib
    return _LIB


def usable(codec: str, t: Tensor) -> bool:
    """Whether the C kernels run ``codec``'s phases on ``t``'s device here: one of
    :data:`CODECS` on a CPU, not turned off by ``HVD_SLOWMO_NATIVE_CODECS=0``, and the library
    built.

    Args:
        codec: the codec's name.
        t: a tensor of the mean (its device decides).
    """
    if codec not in CODECS or t.device.type != "cpu":
        return False
    if os.environ.get("HVD_SLOWMO_NATIVE_CODECS", "1") == "0":
        return False
    return _load() is not None


def _run(work: Callable[[int, int], None], units: int, unit: int) -> None:
    """``work(u0, u1)`` over the units ``[0, units)`` of ``unit`` elements, split between
    torch's intra-op thread count of threads (the caller's thread takes the first share)."""
    global _POOL, _POOL_SIZE
    threads = max(1, min(torch.get_num_threads(), units * unit // _MIN_PER_THREAD))
    if threads == 1:
        work(0, units)
        return
    with _LOCK:
        if _POOL is None or _POOL_SIZE < threads - 1:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(threads - 1, thread_name_prefix="hvd_slowmo-codec")
            _POOL_SIZE = threads - 1
        pool = _POOL
    bounds = [units * k // threads for k in range(threads + 1)]
    futures = [pool.submit(work, bounds[k], bounds[k + 1]) for k in range(1, threads)]
    work(bounds[0], bounds[1])
    for f in futures:
        f.result()


def _kernel(codec: str, phase: str) -> Any:
    """The C function of ``codec``'s ``phase``."""
    lib = _load()
    assert lib is not None and codec in CODECS, "usable() first"
    return getattr(lib, f"hvd_{codec}_{phase}")


def _unit(codec: str, block: int) -> int:
    """Elements per unit of work: int8's scale block, the casts' :data:`_CAST_UNIT`."""
    return block if codec == "int8" else _CAST_UNIT


def _check(t: Tensor, dtype: torch.dtype, what: str) -> None:
    assert t.dtype == dtype and t.device.type == "cpu", f"{what}: {t.dtype} on {t.device}"
    assert t.dim() == 1 or t.stride(-1) == 1, f"{what}: rows must be contiguous"


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
        rows: float32 ``(count, size)``: the values, or with ``feedback`` the residual's rows,
            which are set in place to ``source + rows`` less what the packets decode to.
        block: elements per scale (int8); the blocks restart at every row.
        out: uint8 ``(count, encoded_nbytes(size))``, the packets' rows.
        source: with ``feedback``, the values whose rows are added to the residual's first
            (``source + residual``, in this order; another buffer than ``rows``); None:
            ``rows`` hold the values.
        feedback: error feedback on ``rows`` (the residual).
    """
    kernel, unit = _kernel(codec, "encode"), _unit(codec, block)
    count, size = rows.shape
    _check(rows, torch.float32, "rows")
    _check(out, torch.uint8, "out")
    for r in range(count):
        res = rows[r].data_ptr() if feedback else None
        x = (source[r] if source is not None else rows[r]).data_ptr()
        _run(partial(kernel, x, res, size, unit, out[r].data_ptr()), -(-size // unit), unit)


def reduce(codec: str, packets: list[Tensor], size: int, block: int) -> Tensor:
    """The reduced packet of the received ones: decoded, summed in rank order, divided by their
    count, encoded; the bits of the eager reduce (:class:`~.exchange.PendingMean`).

    Args:
        codec: one of :data:`CODECS`.
        packets: uint8, ``encoded_nbytes(size)`` each, one per worker in rank order (read where
            they lie: no copy into one matrix).
        size: the chunk's elements.
        block: elements per scale (int8).

    Returns:
        A new uint8 packet.
    """
    kernel, unit = _kernel(codec, "reduce"), _unit(codec, block)
    for p in packets:
        _check(p, torch.uint8, "packets")
    m = len(packets)
    reduced = packets[0].new_empty(packets[0].numel())
    pointers = (ctypes.c_void_p * m)(*(p.data_ptr() for p in packets))
    out = reduced.data_ptr()

    def work(u0: int, u1: int) -> None:
        scratch = torch.empty(unit, dtype=torch.float32)  # one unit's sum, per thread
        kernel(pointers, m, size, unit, out, scratch.data_ptr(), u0, u1)

    _run(work, -(-size // unit), unit)
    return reduced


def decode_rows(codec: str, packets: Tensor, size: int, block: int, out: Tensor) -> Tensor:
    """Packets of equal vectors decoded into ``out``, one a row: the bits of
    :func:`~.codecs.decode_rows`.

    Args:
        codec: one of :data:`CODECS`.
        packets: uint8 ``(count, encoded_nbytes(size))``.
        size: each vector's length.
        block: elements per scale (int8).
        out: float32 ``(count, size)`` (rows of a larger buffer, e.g.).

    Returns:
        ``out``.
    """
    kernel, unit = _kernel(codec, "decode"), _unit(codec, block)
    _check(packets, torch.uint8, "packets")
    _check(out, torch.float32, "out")
    for r in range(packets.shape[0]):
        work = partial(kernel, packets[r].data_ptr(), size, unit, out[r].data_ptr())
        _run(work, -(-size // unit), unit)
    return out
