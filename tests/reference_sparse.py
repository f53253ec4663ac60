"""A hand-written reference of the sparse codec and its all-gather average, for ``m`` workers in
one process. Nothing here uses hvd_slowmo: written from docs/sparse.md with plain loops over
workers, chunks and entries, and its own bit packing.

The codec, as the docs define it: a vector is zero-padded to chunks of ``chunk`` elements; each
chunk keeps the ``k = max(1, round(density * chunk))`` entries of largest magnitude (ties: lower
position first), in that order; with ``L = 2 ** (bits - 1)``, ``lo``/``hi`` the smallest/largest
kept magnitude and ``step = (hi - lo) / (L - 1)`` in float32, a kept value's level is ``round(
(|v| - lo) / step)`` (0 if ``step`` is 0) clipped to ``[0, L - 1]``, its code the level plus
``L`` if ``v < 0``, and it decodes to ``±(lo + level * step)``. The packet: every chunk's ``lo``,
every chunk's ``step`` (float32, little-endian), the positions (``w = ceil(log2(chunk))`` bits;
above 8 bits the low bytes first, then the high bits), the codes, zeros to a multiple of 4
bytes; bits are packed least significant first.

The average: worker ``i`` sets ``e_i <- decay * e_i + v_i`` (with error feedback), sends the
packet of ``e_i`` and keeps ``e_i - decoded``; every worker adds every worker's decoded entries,
in rank order, to zeros and divides by ``m``.
"""

import struct

import torch
from reference_compression import pseudo_gradient_replay


def kept_per_chunk(density: float, chunk: int) -> int:
    return min(chunk, max(1, round(density * chunk)))


def index_width(chunk: int) -> int:
    width = 0
    while (1 << width) < chunk:
        width += 1
    return width


def bits_to_bytes(bits: list[int]) -> list[int]:
    """Bit ``t`` of the list is bit ``t % 8`` of byte ``t // 8``; the last byte zero-padded."""
    out = []
    for start in range(0, len(bits), 8):
        byte = 0
        for j, bit in enumerate(bits[start : start + 8]):
            byte |= bit << j
        out.append(byte)
    return out


def pack(values: list[int], width: int) -> list[int]:
    bits = []
    for v in values:
        for j in range(width):
            bits.append((v >> j) & 1)
    return bits_to_bytes(bits)


def encode(x: torch.Tensor, density: float, bits: int, chunk: int):
    """The packet of ``x`` (a uint8 tensor) and the vector it decodes to (float32)."""
    n = x.numel()
    k = kept_per_chunk(density, chunk)
    levels = 2 ** (bits - 1)
    n_chunks = -(-n // chunk)
    padded = torch.zeros(n_chunks * chunk)
    padded[:n] = x
    decoded = torch.zeros(n_chunks * chunk)
    los, steps, positions, codes = [], [], [], []
    for c in range(n_chunks):
        v = padded[c * chunk : (c + 1) * chunk]
        order = sorted(range(chunk), key=lambda i: (-abs(float(v[i])), i))[:k]
        lo = v[order[-1]].abs()
        hi = v[order[0]].abs()
        step = (hi - lo) / (levels - 1)
        los.append(float(lo))
        steps.append(float(step))
        for i in order:
            if float(step) > 0:
                level = round(float((v[i].abs() - lo) / step))
            else:
                level = 0
            level = min(max(level, 0), levels - 1)
            negative = float(v[i]) < 0
            size = lo + level * step
            decoded[c * chunk + i] = -size if negative else size
            positions.append(i)
            codes.append(level + (levels if negative else 0))
    out = []
    for f in los + steps:
        out.extend(struct.pack("<f", f))
    w = index_width(chunk)
    if w <= 8:
        out.extend(pack(positions, w))
    else:
        out.extend(p & 255 for p in positions)
        out.extend(pack([p >> 8 for p in positions], w - 8))
    out.extend(pack(codes, bits))
    out.extend([0] * (-len(out) % 4))
    return torch.tensor(out, dtype=torch.uint8), decoded[:n]


def sparse_mean(
    vectors: list[torch.Tensor],
    density: float,
    bits: int,
    chunk: int,
    residuals: list[torch.Tensor] | None = None,
    decay: float = 1.0,
):
    """Simulate the sparse average of ``vectors`` (worker ``i``'s 1-D float32 vector).

    Returns:
        (each worker's result, each worker's new residual (None without error feedback), the
        bytes each worker sends on a ring all-gather: ``m - 1`` packets)
    """
    m, n = len(vectors), vectors[0].numel()
    if m == 1:
        return [vectors[0].clone()], residuals, [0]
    sent = []
    new_residuals = [] if residuals is not None else None
    packet_bytes = 0
    for i in range(m):
        e = vectors[i] if residuals is None else residuals[i] * decay + vectors[i]
        packet, decoded = encode(e, density, bits, chunk)
        packet_bytes = packet.numel()
        sent.append(decoded)
        if new_residuals is not None:
            new_residuals.append(e - decoded)
    total = torch.zeros(n)
    for i in range(m):
        for j in range(n):
            # A decoded zero is skipped: the totals start at +0 and never become -0, and
            # x + 0 = x for every other x, so adding it would change nothing.
            if sent[i][j] != 0:
                total[j] = total[j] + sent[i][j]
    result = total / m
    return [result.clone() for _ in range(m)], new_residuals, [(m - 1) * packet_bytes] * m


def sparse_pseudo_gradient_average(
    density: float, bits: int, chunk: int, error_feedback: bool, decay: float = 1.0
):
    """A fragment's average for ``reference_streaming(average=...)``: ``x0 - mean_s(x0 - s_i)``
    with ``mean_s`` the sparse average above (the replay of the pseudo-gradients and their
    residuals: reference_compression.py's :func:`pseudo_gradient_replay`)."""
    return pseudo_gradient_replay(
        lambda grads, carried: sparse_mean(grads, density, bits, chunk, carried, decay)[:2],
        error_feedback,
    )


def vector(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    """Magnitudes from 1e-3 to 10, exact zeros, a tie in magnitude of opposite signs."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    v = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
    v[::9] = 0.0
    v[n // 2] = -v[n // 2 + 1]
    return v
