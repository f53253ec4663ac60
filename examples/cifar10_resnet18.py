"""ResNet-18 (CIFAR variant) on CIFAR-10 with SlowMo: the paper's recipe (arXiv 1910.00643, Sec. 5).

    horovodrun -np 4 python examples/cifar10_resnet18.py --data data --download \\
        --algo localsgd --slowmo --tau 12 --slow-momentum 0.7 --buffers reset

    # seconds on a CPU, random tensors and a tiny model (what the tests run):
    horovodrun -np 2 --gloo python examples/cifar10_resnet18.py --synthetic --epochs 1

Recipe: Nesterov momentum 0.9, weight decay 1e-4, peak lr = --lr x global batch / 256 (the
paper: 32 workers x 128 = 4096), linear warm-up over the first 5 epochs, lr divided by 10 at
epochs 100, 150 and 175, 200 epochs; alpha = 1, beta = 0.7, tau = 12, base buffers reset.
Standard augmentation (random crop with 4-pixel padding, horizontal flip).
"""

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_common_args, run_cli, setup, train_classifier, warmup_multistep

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs: 3x3 stem without max-pooling, four stages of two blocks.

    Args:
        width: channels of the first stage (64 in ResNet-18; the stages double it).
        num_classes: output classes.
    """

    def __init__(self, width: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        layers, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2**i
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1).flatten(1))


def datasets(args: argparse.Namespace, rank: int, hvd: Any) -> dict[str, Dataset]:
    """CIFAR-10 train/test from torchvision (rank 0 downloads first), or random tensors.

    Args:
        args: the parsed flags.
        rank: this worker's rank.
        hvd: the job (:class:`launch.Job`), for the barrier after the download.
    """
    if args.synthetic:
        g = torch.Generator().manual_seed(0)  # the same data on every worker
        return {
            "train": TensorDataset(
                torch.randn(256, 3, 32, 32, generator=g), torch.randint(0, 10, (256,), generator=g)
            ),
            "val": TensorDataset(
                torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
            ),
        }
    import torchvision
    import torchvision.transforms as T

    norm = T.Normalize(CIFAR_MEAN, CIFAR_STD)
    train_tf = T.Compose(
        [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), norm]
    )
    if rank == 0 and args.download:
        torchvision.datasets.CIFAR10(args.data, train=True, download=True)
        torchvision.datasets.CIFAR10(args.data, train=False, download=True)
    hvd.barrier()  # the others wait for rank 0's download
    return {
        "train": torchvision.datasets.CIFAR10(args.data, train=True, transform=train_tf),
        "val": torchvision.datasets.CIFAR10(
            args.data, train=False, transform=T.Compose([T.ToTensor(), norm])
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and return the final metrics.

    Args:
        argv: command-line arguments (default: sys.argv[1:]).
    """
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(
        parser, tau=12, slow_momentum=0.7, buffers="reset", epochs=200, batch_size=128, lr=0.1
    )
    parser.add_argument(
        "--width", type=int, default=64, help="first-stage channels (64: ResNet-18)"
    )
    parser.add_argument("--warmup-epochs", type=float, default=5)
    parser.add_argument(
        "--decay-epochs", type=int, nargs="*", default=[100, 150, 175], help="lr / 10 at these"
    )
    args = parser.parse_args(argv)
    if args.synthetic and args.width == 64:
        args.width = 4  # a tiny model: seconds on a CPU
    hvd, device = setup(args)
    data = datasets(args, hvd.rank(), hvd)
    peak_lr = args.lr * args.batch_size * hvd.size() / 256
    return train_classifier(
        args,
        hvd,
        device,
        "cifar10_resnet18",
        ResNet18(args.width).to(device),
        data["train"],
        data["val"],
        peak_lr,
        lambda step, spe: warmup_multistep(step, spe, args.warmup_epochs, args.decay_epochs),
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
