"""Cost of the SlowMo outer step on ResNet-18-sized parameters, on this machine's CPU.

Prints, measured in one run:
  - the slow step's time as a ratio to one base optimizer step (SGD, Nesterov momentum),
  - its amortized share of a Local SGD iteration (forward + backward + step) at tau=12,
  - the memory SlowMo adds over the base optimizer (anchor + slow buffer) as a multiple of the
    parameter bytes, and the temporary memory the slow step allocates (torch profiler);
  - the bytes each part of the optimizer holds (:func:`hvd_slowmo.memory.held_bytes`:
    parameters, gradients, base optimizer state, anchor, slow buffer, residual, in flight,
    codec scratch) as multiples of the parameter bytes.

Usage: python benchmarks/slowmo_overhead.py [--batch 32] [--repeats 20] [--tau 12]
The outer step runs on one worker here (no communication): this isolates the slow update's
own cost; communication is measured by benchmarks/cluster.py.
"""

import argparse
import statistics
import time

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import ThreadWorld
from hvd_slowmo.memory import held_bytes
from hvd_slowmo.slowmo import slow_momentum_step_


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tau", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    params = [p for p in model.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    base = torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    opt = DistributedOptimizer(
        base,
        named_parameters=model.named_parameters(),
        tau=args.tau,
        slow_lr=1.0,
        slow_momentum=0.7,
        communicator=ThreadWorld(1).communicator(0),
    )
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))

    def fwd_bwd() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    fwd_bwd()
    base_step_ms = median_ms(base.step, args.repeats)
    opt.step()  # captures the anchor
    (whole,) = opt.slow_states  # fragments=1: one slow state over every parameter
    anchor, buf = whole.anchor, whole.slow_buffer

    def slow_step() -> None:
        slow_momentum_step_([p.detach() for p in params], anchor, buf, 0.1, 1.0, 0.7)

    slow_ms = median_ms(slow_step, args.repeats)

    def iteration() -> None:
        fwd_bwd()
        base.step()

    iter_ms = median_ms(iteration, max(3, args.repeats // 4))
    state_bytes = sum(t.numel() * t.element_size() for t in anchor + buf)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        slow_step()
    temp_bytes = sum(max(e.cpu_memory_usage, 0) for e in prof.events())

    print(
        f"ResNet-18 (CIFAR-10 head): {sum(p.numel() for p in params) / 1e6:.2f}M parameters, "
        f"{param_bytes / 2**20:.1f} MiB; batch {args.batch}; torch {torch.__version__}; "
        f"{torch.get_num_threads()} threads"
    )
    print("| measure | value | target |")
    print("|---|---|---|")
    print(f"| base optimizer step (SGD Nesterov, wd) | {base_step_ms:.2f} ms | |")
    print(f"| slow momentum step | {slow_ms:.2f} ms | |")
    print(f"| slow step / base step | {slow_ms / base_step_ms:.2f}x | <= 1.5x |")
    print(f"| Local SGD iteration (fwd+bwd+step) | {iter_ms:.1f} ms | |")
    print(
        f"| slow step amortized over tau={args.tau} / iteration | "
        f"{100 * slow_ms / args.tau / iter_ms:.3f}% | |"
    )
    print(
        f"| SlowMo state (anchor + slow buffer) / parameter bytes | "
        f"{state_bytes / param_bytes:.2f}x | <= 2x |"
    )
    print(f"| temporary memory allocated by the slow step | {temp_bytes} bytes | |")
    held = held_bytes(opt)  # each part the optimizer keeps, each storage once
    for part, nbytes in held.items():
        print(f"| held: {part} / parameter bytes | {nbytes / param_bytes:.2f}x | |")
    print(f"| held: all parts / parameter bytes | {sum(held.values()) / param_bytes:.2f}x | |")


if __name__ == "__main__":
    main()
