"""A hand-written reference of the compressed exact average, for ``m`` workers in one process.

Written from the description (quantize -> all-to-all -> fp32 sum -> requantize -> all-gather),
with plain loops over workers, chunks and blocks. Nothing here uses hvd_slowmo.

The codecs, as the docs define them: a cast (fp32, fp16, bf16) is the value in that dtype; int8
and fp8 split a chunk into blocks of ``block`` elements (the last one shorter), each with the
scale ``absmax / 127`` (int8) or ``absmax / 448`` (fp8) in float32; a value's int8 code is
``x / scale`` rounded to nearest (ties to even) and clipped to [-127, 127], its fp8 code is
``x / scale`` clipped to [-448, 448] and cast to float8_e4m3fn; a block whose scale is 0 has code
0 everywhere. Decoding multiplies the code by its block's scale.
"""

import torch

CAST = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
LIMIT = {"int8": 127.0, "fp8": 448.0}


def chunk_bounds(n: int, m: int) -> list[tuple[int, int]]:
    """Chunk ``j`` of ``n`` elements over ``m`` workers: ``n // m`` elements, one more for the
    first ``n % m`` chunks, in order."""
    bounds = []
    start = 0
    for j in range(m):
        length = n // m + (1 if j < n % m else 0)
        bounds.append((start, start + length))
        start += length
    return bounds


def quantize_dequantize(chunk: torch.Tensor, codec: str, block: int) -> tuple[torch.Tensor, int]:
    """What the receiver of ``chunk``'s codes decodes, and the bytes of the codes and scales."""
    if codec in CAST:
        codes = chunk.to(CAST[codec])
        return codes.to(torch.float32), codes.numel() * codes.element_size()
    out = torch.empty_like(chunk)
    nbytes = 0
    for start in range(0, chunk.numel(), block):
        values = chunk[start : start + block]
        scale = values.abs().max() / LIMIT[codec]  # a 0-d float32 tensor
        nbytes += 4 + values.numel()  # one float32 scale, one byte per code
        if scale.item() == 0.0:
            out[start : start + block] = 0.0
            continue
        ratio = values / scale
        if codec == "int8":
            codes = torch.clamp(torch.round(ratio), -127, 127).to(torch.int8)
        else:
            codes = torch.clamp(ratio, -448.0, 448.0).to(torch.float8_e4m3fn)
        out[start : start + block] = codes.to(torch.float32) * scale
    return out, nbytes


def reference_compressed_mean(
    vectors: list[torch.Tensor],
    codec: str,
    block: int = 256,
    residuals: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[int]]:
    """Simulate the compressed average of ``vectors`` (worker ``i``'s 1-D float32 vector).

    Returns:
        (each worker's result, each worker's new residual (None without error feedback),
        the bytes each worker sends: its codes and scales for the other workers' chunks in the
        all-to-all, plus ``(m - 1) / m`` of the gathered reduced chunks, as a ring all-gather)
    """
    m = len(vectors)
    bounds = chunk_bounds(vectors[0].numel(), m)
    sent_bytes = [0] * m
    # Each worker quantizes each of its chunks (with its residual added first).
    decoded = [[None] * m for _ in range(m)]  # decoded[i][j]: worker i's chunk j at worker j
    new_residuals = [] if residuals is not None else None
    for i in range(m):
        contribution = vectors[i].clone()
        if residuals is not None:
            contribution = contribution + residuals[i]
        lost = torch.empty_like(contribution)
        for j, (a, b) in enumerate(bounds):
            decoded[i][j], nbytes = quantize_dequantize(contribution[a:b], codec, block)
            lost[a:b] = contribution[a:b] - decoded[i][j]
            if j != i:
                sent_bytes[i] += nbytes
        if new_residuals is not None:
            new_residuals.append(lost)
    # Worker j sums the chunks it received in rank order, divides, requantizes.
    reduced = []
    gathered_bytes = 0
    for j in range(m):
        total = decoded[0][j].clone()
        for i in range(1, m):
            total = total + decoded[i][j]
        chunk, nbytes = quantize_dequantize(total / m, codec, block)
        reduced.append(chunk)
        gathered_bytes += nbytes
    result = torch.cat(reduced)
    for i in range(m):
        sent_bytes[i] += int((m - 1) / m * gathered_bytes)
    return [result.clone() for _ in range(m)], new_residuals, sent_bytes


def pseudo_gradient_replay(mean, error_feedback: bool):
    """A fragment's average for ``reference_streaming(average=...)``: ``x0 - mean(x0 - s_i)``
    over the fragment's parameters concatenated in order, ``mean(grads, carried) -> (means,
    lost)`` a reference mean (the compressed one above, or the sparse one of
    reference_sparse.py). With error feedback each worker keeps one residual per parameter
    (zero at first), so what a parameter's codes lost is added to that parameter's next
    average."""
    residuals: dict[tuple[int, int], torch.Tensor] = {}  # (worker, parameter) -> residual

    def average(members, snapshots, anchor):
        m = len(snapshots)
        sizes = [a.numel() for a in anchor]
        flat_anchor = torch.cat([a.reshape(-1) for a in anchor])
        grads = [flat_anchor - torch.cat([s.reshape(-1) for s in snaps]) for snaps in snapshots]
        carried = None
        if error_feedback:
            carried = [
                torch.cat([residuals.get((i, j), torch.zeros(n)) for j, n in zip(members, sizes)])
                for i in range(m)
            ]
        means, lost = mean(grads, carried)
        if lost is not None:
            for i in range(m):
                for j, part in zip(members, lost[i].split(sizes)):
                    residuals[(i, j)] = part.clone()
        return [a - d.view_as(a) for a, d in zip(anchor, means[0].split(sizes))]

    return average


def pseudo_gradient_average(codec: str, error_feedback: bool, block: int = 256):
    """:func:`pseudo_gradient_replay` of the compressed average above."""
    return pseudo_gradient_replay(
        lambda grads, carried: reference_compressed_mean(grads, codec, block, carried)[:2],
        error_feedback,
    )


def reference_slowmo_compressed(
    m: int,
    steps: int,
    tau: int,
    slow_lr: float,
    slow_momentum: float,
    make_opt,
    codec: str,
    error_feedback: bool,
    block: int = 256,
    pseudo_mean=None,
):
    """Replay SlowMo over Local SGD for ``m`` workers, the exact average sent as compressed
    pseudo-gradients: ``x_avg = x0 - mean_c(x0 - x_i)`` with ``mean_c`` the compressed average
    above (each worker's residual carried over with error feedback), or ``pseudo_mean(grads,
    residuals) -> (means, new residuals)`` where given (residuals: None without error
    feedback, else a list of each worker's, each None at first); the model buffers are averaged
    exactly; buffers reset. The slow update is ``torch.optim.SGD(lr=slow_lr * lr,
    momentum=slow_momentum)`` on ``(x0 - x_avg) / lr``. Returns each worker's model."""
    from reference import loss_at, lr_at, make_model

    models = [make_model() for _ in range(m)]
    opts = [make_opt(mod.parameters()) for mod in models]
    anchor = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    slow = torch.optim.SGD(anchor, lr=1.0, momentum=slow_momentum)
    residuals = None
    for k in range(steps):
        for w in range(m):
            for g in opts[w].param_groups:
                g["lr"] = lr_at(k)
            opts[w].zero_grad()
            loss_at(models[w], w, k).backward()
            opts[w].step()
        if (k + 1) % tau:
            continue
        with torch.no_grad():
            plist = [list(mod.parameters()) for mod in models]
            flat_anchor = torch.cat([a.detach().reshape(-1) for a in anchor])
            grads = [flat_anchor - torch.cat([p.reshape(-1) for p in ps]) for ps in plist]
            if pseudo_mean is not None:
                if error_feedback and residuals is None:
                    residuals = [None] * m
                means, residuals = pseudo_mean(grads, residuals)
            else:
                if error_feedback and residuals is None:
                    residuals = [torch.zeros_like(g) for g in grads]
                means, residuals, _ = reference_compressed_mean(grads, codec, block, residuals)
            avg = (flat_anchor - means[0]).split([a.numel() for a in anchor])
            lr = lr_at(k)
            for a, x in zip(anchor, avg):
                a.grad = (a - x.view_as(a)) / lr
            slow.param_groups[0]["lr"] = slow_lr * lr
            slow.step()
            for ps in plist:
                for p, a in zip(ps, anchor):
                    p.copy_(a)
            blist = [[b for b in mod.buffers() if b.is_floating_point()] for mod in models]
            for i in range(len(blist[0])):
                mean = sum(blist[w][i] for w in range(m)) / m
                for w in range(m):
                    blist[w][i].copy_(mean)
            for o in opts:
                o.state.clear()
    return models


def worker_vector(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    """Worker ``rank``'s vector: magnitudes from 1e-3 to 10 across blocks, an all-zero block."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    v = torch.randn(n, generator=g) * torch.logspace(-3, 1, n)
    v[256:512] = 0.0  # a block of zeros on every worker (zero scale)
    return v + 0.01 * rank
