"""What the host allocator's settings cost a CPU training step (docs/results/memory-rows.md).

The SlowMo rows' resident peak comes within one model copy of what the optimizer holds either
with glibc's mmap threshold fixed low (``MALLOC_MMAP_THRESHOLD_=1048576``: every block of 1 MiB
or more mapped on its own and unmapped when freed) or with
:func:`hvd_slowmo.memory.release_free_pages` after every step. This prints the mean step time
(24 steps after 5 of warm-up) of torchvision's ResNet-18 (batch 32, 64x64 images) and of a
10.5M-parameter stack of linear layers (batch 256), SGD with momentum, under the process's
environment and with ``--release-every N`` (the release after every N-th step; 0: never). Run
it alone, alternating the settings:

    for i in 1 2 3; do
      python benchmarks/allocator_cost.py
      MALLOC_MMAP_THRESHOLD_=1048576 python benchmarks/allocator_cost.py
      python benchmarks/allocator_cost.py --release-every 12
      python benchmarks/allocator_cost.py --release-every 1
    done
"""

import argparse
import os
import statistics
import time

import torch
import torchvision

from hvd_slowmo.memory import release_free_pages


def mean_step_ms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, every: int) -> float:
    """Mean ms per training step of ``model`` on one batch, steps 6 to 29.

    Args:
        model: the model.
        x: the batch.
        y: its labels.
        every: release_free_pages() after every ``every``-th step; 0: never.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for i in range(29):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
        if every and (i + 1) % every == 0:
            release_free_pages()
        times.append(time.perf_counter() - start)
    return statistics.mean(times[5:]) * 1000


def main() -> None:
    """Time both models and print one line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--release-every", type=int, default=0, help="steps between releases; 0: never")
    args = p.parse_args()
    if args.release_every < 0:
        raise ValueError(f"--release-every must be >= 0, got {args.release_every}")
    torch.manual_seed(0)
    resnet = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 10, (32,))
    ms_resnet = mean_step_ms(resnet, x, y, args.release_every)
    layers = [torch.nn.Linear(1024, 1024) for _ in range(10)] + [torch.nn.Linear(1024, 10)]
    x, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    ms_linear = mean_step_ms(torch.nn.Sequential(*layers), x, y, args.release_every)
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "unset")
    print(
        f"MALLOC_MMAP_THRESHOLD_={threshold} release every {args.release_every or 'never'}: "
        f"resnet18 {ms_resnet:.1f} ms/step, linear stack {ms_linear:.1f} ms/step (mean of 24), "
        f"1-minute load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
