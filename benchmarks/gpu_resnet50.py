"""SlowMo's cost on one GPU: torchvision ResNet-50, bf16 autocast, channels_last, synthetic data.

Prints, measured in one run (each optimizer on a fresh copy of the same model):
  - ms/iteration (forward + backward + step) of plain torch SGD, torch's DistributedDataParallel,
    Horovod's DistributedOptimizer (where Horovod is importable), hvd_slowmo Local SGD + SlowMo
    and AR-SGD + SlowMo (both tau=12): the median over windows of tau iterations, so each window
    holds one outer step (slow update, finite check, exact average);
  - the slow momentum step alone vs one base optimizer step (SGD, Nesterov, weight decay);
  - peak GPU memory of each over plain torch, and SlowMo's state (anchor + slow buffer) in
    parameter bytes;
  - the issue's targets: slow step <= 1.5x a base step, Local SGD + SlowMo within 2% of plain
    torch, SlowMo state exactly 2x the parameter bytes.

One process: Horovod (size 1) and hvd_slowmo skip their collectives, and DDP reduces over a
world of one (NCCL on a GPU, Gloo on a CPU), so the figures are the wrappers' own cost on the
GPU, not communication (benchmarks/cluster.py measures that).

Usage: python benchmarks/gpu_resnet50.py [--batch 128] [--windows 5] [--tau 12]
       python benchmarks/gpu_resnet50.py --tiny   # seconds on a CPU: two narrow bottlenecks, 16x16
"""

import argparse
import gc
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torchvision
from bench_timing import median_ms, sync  # benchmarks/, beside this script
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hvd_slowmo
from hvd_slowmo.comm.local import ThreadWorld
from hvd_slowmo.slowmo import slow_momentum_step_

try:
    import horovod.torch as hvd
except ImportError:  # the benchmark still runs; Horovod's row says why it is missing
    hvd = None

VARIANTS = (
    "plain torch",
    "torch DDP",
    "Horovod DistributedOptimizer",
    "Local SGD + SlowMo",
    "AR-SGD + SlowMo",
)


def init_ddp(device: torch.device) -> str | None:
    """A torch.distributed world of one for DDP's row; returns why not, or None when ready."""
    if not dist.is_available():
        return "torch.distributed is not available"
    with socket.socket() as s:  # a free port for the rendezvous of this one process
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    except (RuntimeError, ValueError) as e:
        return f"init_process_group({backend!r}) failed: {e}"
    return None


def build_model(tiny: bool, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    if tiny:  # two of ResNet-50's bottleneck blocks, narrow: thousands of parameters
        bottleneck = torchvision.models.resnet.Bottleneck
        down = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            bottleneck(16, 4),
            bottleneck(16, 8, stride=2, downsample=down),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )
    else:
        model = torchvision.models.resnet50()
    return model.to(device, memory_format=torch.channels_last)


def make_optimizer(variant: str, model: nn.Module, tau: int) -> torch.optim.Optimizer:
    base = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-5
    )
    if variant == "plain torch":
        return base
    if variant == "Horovod DistributedOptimizer":
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    # Horovod's communicator when Horovod is there (its collectives are skipped at size 1).
    comm = None if hvd is not None else ThreadWorld(1).communicator(0)
    return hvd_slowmo.DistributedOptimizer(
        base,
        named_parameters=model.named_parameters(),
        base="localsgd" if variant.startswith("Local") else "allreduce",
        tau=tau,
        slow_lr=1.0,
        slow_momentum=0.7,
        model_buffers=model.buffers(),
        communicator=comm,
    )


def run_variant(variant: str, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    """Train one optimizer on a fresh model; returns its ms/iteration, peak memory (over what was
    allocated before it: an earlier variant kept alive does not count) and optimizer."""
    gc.collect()  # the previous variant's model and optimizer
    before = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    model = build_model(args.tiny, device)
    opt = make_optimizer(variant, model, args.tau)
    if variant == "torch DDP":  # wrapped after its optimizer took the parameters, as usual
        model = DistributedDataParallel(
            model, device_ids=[device.index or 0] if device.type == "cuda" else None
        )
    size = 16 if args.tiny else 224
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(args.batch, 3, size, size, generator=g).to(
        device, memory_format=torch.channels_last
    )
    y = torch.randint(0, 10 if args.tiny else 1000, (args.batch,), generator=g).to(device)

    def iteration() -> None:
        opt.zero_grad()  # set_to_none (torch default; Horovod's zero_grad takes no argument)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(args.tau):  # warm-up: one outer step (captures the anchor), cuDNN autotuning
        iteration()
    windows = []
    for _ in range(args.windows):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.tau):
            iteration()
        sync(device)
        windows.append((time.perf_counter() - t0) * 1e3 / args.tau)
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return {
        "ms": statistics.median(windows),
        "spread": (min(windows), max(windows)),
        "peak": peak,
        "opt": opt,
        "model": model,
    }


def slow_vs_base_step(
    result: dict[str, object], repeats: int, device: torch.device
) -> dict[str, float]:
    """Median ms of the slow momentum step alone and of one base optimizer step (with gradients)."""
    opt = result["opt"]
    params = [
        p.detach() for p in result["model"].parameters()
    ]  # the optimizer's order: one param group
    (whole,) = opt.slow_states  # fragments=1: one slow state over every parameter
    anchor, buf = whole.anchor, whole.slow_buffer
    base_ms = median_ms(opt.optimizer.step, repeats, device)
    slow_ms = median_ms(
        lambda: slow_momentum_step_(params, anchor, buf, 0.1, 1.0, 0.7), repeats, device
    )
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(t.numel() * t.element_size() for t in anchor + buf)
    return {
        "base_ms": base_ms,
        "slow_ms": slow_ms,
        "state_ratio": state_bytes / param_bytes,
        "param_bytes": param_bytes,
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with the defaults of the full or the --tiny run filled in."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="images per iteration (default 128; 4 with --tiny)"
    )
    parser.add_argument(
        "--tau", type=int, default=None, help="SlowMo's tau (default 12; 3 with --tiny)"
    )
    parser.add_argument(
        "--windows",
        type=int,
        default=None,
        help="timed windows of tau iterations per optimizer (default 5; 2 with --tiny)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timings of the slow step and of a base step (default 20; 3 with --tiny)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny ResNet on 16x16 images: for CPU tests"
    )
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = parser.parse_args(argv)
    args.batch = args.batch or (4 if args.tiny else 128)
    args.tau = args.tau or (3 if args.tiny else 12)
    args.windows = args.windows or (2 if args.tiny else 5)
    args.repeats = args.repeats or (3 if args.tiny else 20)
    for name in ("batch", "tau", "windows", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def _print_tables(
    results: dict[str, dict[str, object]],
    steps: dict[str, float],
    header: str,
    missing: dict[str, str],
) -> None:
    """The per-optimizer table and the targets' table (Markdown); ``missing`` says why a row
    did not run."""
    print(header)
    plain = results["plain torch"]
    print(
        "| optimizer | ms/iter (median of windows) | min-max | vs plain torch "
        "| peak memory over plain torch |"
    )
    print("|---|---|---|---|---|")
    for variant in VARIANTS:
        if variant not in results:
            print(f"| {variant} | not run: {missing.get(variant, 'not run')} | | | |")
            continue
        r = results[variant]
        lo, hi = r["spread"]
        if r["peak"] is None:
            mem = "n/a (CPU)"
        else:
            extra = r["peak"] - plain["peak"]
            mem = f"{extra / 2**20:+.1f} MiB ({extra / steps['param_bytes']:+.2f}x parameter bytes)"
        vs_plain = r["ms"] / plain["ms"]
        print(f"| {variant} | {r['ms']:.2f} | {lo:.2f}-{hi:.2f} | {vs_plain:.3f}x | {mem} |")
    ratio = steps["slow_ms"] / steps["base_ms"]
    overhead = results["Local SGD + SlowMo"]["ms"] / plain["ms"] - 1
    print()
    print("| measure | value | target | met |")
    print("|---|---|---|---|")
    print(
        f"| slow momentum step / one base step | {ratio:.2f}x ({steps['slow_ms']:.2f} ms vs "
        f"{steps['base_ms']:.2f} ms) | <= 1.5x | {'yes' if ratio <= 1.5 else 'no'} |"
    )
    print(
        f"| Local SGD + SlowMo vs plain torch, per iteration | {overhead * 100:+.2f}% "
        "| within 2% | "
        f"{'yes' if overhead <= 0.02 else 'no'} |"
    )
    print(
        f"| SlowMo state / parameter bytes | {steps['state_ratio']:.2f}x | exactly 2x | "
        f"{'yes' if steps['state_ratio'] == 2.0 else 'no'} |"
    )


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    if hvd is not None:
        hvd.init()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    model_name = (
        "tiny ResNet (2 bottlenecks), 16x16" if args.tiny else "torchvision ResNet-50, 224x224"
    )

    results: dict[str, dict[str, object]] = {}
    missing: dict[str, str] = {}  # variant -> why it did not run
    if hvd is None:
        missing["Horovod DistributedOptimizer"] = "horovod.torch is not importable"
    ddp_missing = init_ddp(device)
    if ddp_missing:
        missing["torch DDP"] = ddp_missing
    for variant in VARIANTS:
        if variant in missing:
            continue
        results[variant] = run_variant(variant, args, device)
        if variant == "torch DDP":
            dist.destroy_process_group()  # hvd_slowmo's rows then pick Horovod or threads
        if variant != "Local SGD + SlowMo":
            del results[variant]["opt"], results[variant]["model"]  # free it before the next one
    steps = slow_vs_base_step(results["Local SGD + SlowMo"], args.repeats, device)
    n_params = sum(p.numel() for p in results["Local SGD + SlowMo"]["model"].parameters())

    header = (
        f"{model_name}: {n_params:,} parameters ({steps['param_bytes'] / 2**20:.1f} MiB fp32), "
        f"batch {args.batch}, bf16 autocast, channels_last, tau={args.tau}; {where}; "
        f"torch {torch.__version__}; one process (Horovod and hvd_slowmo skip their collectives at "
        "size 1; DDP reduces over a world of one)"
    )
    _print_tables(results, steps, header, missing)


if __name__ == "__main__":
    main()
