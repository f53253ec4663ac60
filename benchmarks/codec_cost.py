"""What each codec of a compressed exact average costs in arithmetic, per MB of float32 payload.

For every codec (fp16, bf16, int8, fp8, the sparse one with its defaults, and any other that
:mod:`hvd_slowmo.compression` has: each is tried, and one that does not work says why) on the
CPU and, where there is one, on the GPU, the median over repeats of:
  - encode: :func:`~hvd_slowmo.compression.encode` of the whole vector and its wire packet
    (sparse: :func:`~hvd_slowmo.compression.sparse_encode`);
  - decode: the packet back to float32 (sparse: ``sparse_decode_dense``);
  - mean: one worker's arithmetic in a compressed mean of ``--workers`` workers, without the
    wire: encode its vector in ``workers`` chunks, decode and sum ``workers`` received chunks
    of its own share, encode the mean, decode the ``workers`` gathered chunks (what
    :class:`~hvd_slowmo.compression.PendingMean` computes around its all-to-all and
    all-gather); sparse: the error feedback's update, the encode, the residual's correction,
    the decode and sum of ``workers`` gathered packets (what
    :class:`~hvd_slowmo.compression.PendingSparseMean` computes around its all-gather).
Times are ms per MB of the float32 input (GPU: after ``torch.cuda.synchronize``). Printed as a
Markdown table, and with ``--json PATH`` written as JSON (scripts/gpu_summary.py reads it).

Usage: python benchmarks/codec_cost.py [--mb 64] [--repeats 10] [--workers 4] [--device cpu,cuda]
       python benchmarks/codec_cost.py --mb 0.25 --repeats 2   # seconds on a CPU
"""

import argparse
import json
from collections.abc import Callable

import torch
from bench_timing import median_ms  # benchmarks/, beside this script

from hvd_slowmo.compression import (
    CODECS,
    SparseCodec,
    check_codec,
    decode,
    encode,
    sparse_decode_dense,
    sparse_encode,
)
from hvd_slowmo.compression import codecs as codec_module
from hvd_slowmo.compression.sparse import sparse_sum

#: The codecs measured first, in this order; others of CODECS follow (fp32 is the baseline, no
#: codec at all, and is left out).
PREFERRED = ("fp16", "bf16", "int8", "fp8", "sparse")


def codec_names() -> list[str]:
    """The codecs to measure: PREFERRED first, then any other the library lists, never fp32."""
    names = [c for c in PREFERRED if c in CODECS] + [
        c for c in CODECS if c not in PREFERRED and c != "fp32"
    ]
    if "sparse" not in names:
        names.append("sparse")
    return names


def local_mean(x: torch.Tensor, codec: str, workers: int) -> torch.Tensor:
    """One worker's arithmetic in a compressed mean of ``workers`` (the wire left out): every
    worker is assumed to send what this one sends."""
    chunks = list(x.tensor_split(workers))
    sent = [codec_module.to_bytes(encode(c, codec)) for c in chunks]
    mine = chunks[0].numel()
    total = decode(codec_module.from_bytes(sent[0], mine, codec), codec)
    for _ in range(1, workers):
        total += decode(codec_module.from_bytes(sent[0], mine, codec), codec)
    reduced = codec_module.to_bytes(encode(total / workers, codec))
    return torch.cat(
        [decode(codec_module.from_bytes(reduced, mine, codec), codec) for _ in range(workers)]
    )


def sparse_local_mean(x: torch.Tensor, residual: torch.Tensor, codec: SparseCodec, workers: int):
    """One worker's arithmetic in a sparse mean of ``workers`` with error feedback (the wire
    left out; every worker assumed to send this one's packet): the residual's update and
    encode, the residual's correction, the decode and sum of the gathered packets."""
    contribution = residual.mul_(codec.ef_decay).add_(x)
    packet = sparse_encode(contribution, codec)
    residual.sub_(sparse_decode_dense(packet, x.numel(), codec))
    gathered = packet.expand(workers, -1)
    return sparse_sum(gathered, x.numel(), codec).div_(workers)


def _steps(codec: str, x: torch.Tensor, workers: int) -> tuple[Callable, Callable, Callable, int]:
    """The codec's encode, decode and mean of ``x`` as functions, and its packet's bytes."""
    n = x.numel()
    spec = check_codec(codec, x.device)
    if isinstance(spec, SparseCodec):
        packet = sparse_encode(x, spec)
        residual = torch.zeros_like(x)
        return (
            lambda: sparse_encode(x, spec),
            lambda: sparse_decode_dense(packet, n, spec),
            lambda: sparse_local_mean(x, residual, spec, workers),
            packet.numel(),
        )
    packet = codec_module.to_bytes(encode(x, codec))
    return (
        lambda: codec_module.to_bytes(encode(x, codec)),
        lambda: decode(codec_module.from_bytes(packet, n, codec), codec),
        lambda: local_mean(x, codec, workers),
        packet.numel(),
    )


def measure(codec: str, device: torch.device, mb: float, repeats: int, workers: int) -> dict:
    """One row: ms per MB of encode, decode and mean, or the error that stopped it."""
    row: dict = {"codec": codec, "device": device.type}
    try:
        n = max(1, int(mb * 2**20 / 4))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, generator=g).to(device)
        enc, dec, mean, nbytes = _steps(codec, x, workers)
        per_mb = n * 4 / 2**20
        row["encode_ms_per_mb"] = median_ms(enc, repeats, device) / per_mb
        row["decode_ms_per_mb"] = median_ms(dec, repeats, device) / per_mb
        row["mean_ms_per_mb"] = median_ms(mean, repeats, device) / per_mb
        row["wire_bytes_per_fp32_byte"] = nbytes / (n * 4)
    except (ValueError, TypeError, RuntimeError, KeyError) as e:  # a codec this torch lacks
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=64.0, help="MB of float32 (default 64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats (default 10)")
    parser.add_argument("--workers", type=int, default=4, help="workers of the mean (default 4)")
    parser.add_argument(
        "--device", default=None, help="comma-separated (default: cpu, and cuda when available)"
    )
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if args.mb <= 0:
        parser.error(f"--mb must be > 0, got {args.mb}")
    for name in ("repeats", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    devices = (
        args.device.split(",")
        if args.device
        else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    )
    rows = [
        measure(codec, torch.device(d), args.mb, args.repeats, args.workers)
        for d in devices
        for codec in codec_names()
    ]
    where = ", ".join(
        torch.cuda.get_device_name(0) if d == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
        for d in devices
    )
    result = {
        "mb": args.mb,
        "repeats": args.repeats,
        "workers": args.workers,
        "devices": where,
        "torch": torch.__version__,
        "rows": rows,
    }
    print(
        f"codec cost: {args.mb:g} MB of float32, median of {args.repeats}, mean of "
        f"{args.workers} workers; {where}; torch {torch.__version__}"
    )
    print("| codec | device | encode ms/MB | decode ms/MB | mean ms/MB | wire bytes / fp32 bytes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['codec']} | {r['device']} | n/a: {r['error']} | | | |")
        else:
            print(
                f"| {r['codec']} | {r['device']} | {r['encode_ms_per_mb']:.4f} | "
                f"{r['decode_ms_per_mb']:.4f} | {r['mean_ms_per_mb']:.4f} | "
                f"{r['wire_bytes_per_fp32_byte']:.3f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
