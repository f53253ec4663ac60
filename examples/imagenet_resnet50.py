"""torchvision ResNet-50 on ImageNet with SlowMo (arXiv 1910.00643, Sec. 5 and Appendix B).

    horovodrun -np 32 -H host1:8,host2:8,host3:8,host4:8 python examples/imagenet_resnet50.py \\
        --data /datasets/imagenet --algo sgp --slowmo --tau 48 --slow-momentum 0.6 --amp

    # seconds on a CPU, random tensors and a tiny ResNet (what the tests run):
    horovodrun -np 2 --gloo python examples/imagenet_resnet50.py --synthetic --epochs 1

``--data`` is an ImageFolder tree with ``train/`` and ``val/`` (one folder per class; ImageNet
cannot be downloaded automatically). Goyal et al.'s schedule: peak lr = 0.1 per 256 samples of
global batch, linear warm-up over 5 epochs, divided by 10 at epochs 30, 60 and 80, 90 epochs;
Nesterov momentum 0.9, weight decay 1e-4; base buffers reset (the paper's default for SGD).
"""

import argparse
import os
import sys
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_common_args, run_cli, setup, train_classifier, warmup_multistep

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """torchvision's ResNet-50, or for --synthetic a one-block-per-stage bottleneck ResNet with
    narrow bottlenecks (same code path, a fraction of the compute).

    Args:
        args: the parsed flags.
    """
    import torchvision
    from torchvision.models.resnet import Bottleneck, ResNet

    if args.synthetic:
        return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=args.num_classes, width_per_group=8)
    return torchvision.models.resnet50(num_classes=args.num_classes)


def datasets(args: argparse.Namespace) -> dict[str, Dataset]:
    """ImageFolder train/val with the standard augmentation, or small random tensors.

    Args:
        args: the parsed flags.
    """
    if args.synthetic:
        g = torch.Generator().manual_seed(0)  # the same data on every worker
        n, s, c = 64, args.image_size, args.num_classes
        return {
            "train": TensorDataset(
                torch.randn(n, 3, s, s, generator=g), torch.randint(0, c, (n,), generator=g)
            ),
            "val": TensorDataset(
                torch.randn(16, 3, s, s, generator=g), torch.randint(0, c, (16,), generator=g)
            ),
        }
    import torchvision
    import torchvision.transforms as T

    for split in ("train", "val"):
        if not os.path.isdir(os.path.join(args.data, split)):
            raise ValueError(
                f"--data {args.data!r} has no {split}/ folder: ImageNet must be prepared as an "
                "ImageFolder tree (train/<class>/*.JPEG, val/<class>/*.JPEG); "
                "it cannot be downloaded"
            )
    norm = T.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    train_tf = T.Compose(
        [T.RandomResizedCrop(args.image_size), T.RandomHorizontalFlip(), T.ToTensor(), norm]
    )
    val_tf = T.Compose(
        [
            T.Resize(int(args.image_size * 256 / 224)),
            T.CenterCrop(args.image_size),
            T.ToTensor(),
            norm,
        ]
    )
    return {
        "train": torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), train_tf),
        "val": torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), val_tf),
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
        parser, tau=48, slow_momentum=0.6, buffers="reset", epochs=90, batch_size=32, lr=0.1
    )
    parser.add_argument("--warmup-epochs", type=float, default=5)
    parser.add_argument(
        "--decay-epochs", type=int, nargs="*", default=[30, 60, 80], help="lr / 10 at these"
    )
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.synthetic:  # seconds on a CPU
        args.image_size = 32 if args.image_size == 224 else args.image_size
        args.num_classes = 10 if args.num_classes == 1000 else args.num_classes
    if args.download:
        raise ValueError(
            "--download: ImageNet cannot be downloaded automatically; prepare an ImageFolder tree "
            "and pass it with --data"
        )
    hvd, device = setup(args)
    data = datasets(args)
    peak_lr = args.lr * args.batch_size * hvd.size() / 256  # Goyal et al.: 0.1 per 256 samples
    model = build_model(args).to(device)
    return train_classifier(
        args,
        hvd,
        device,
        "imagenet_resnet50",
        model,
        data["train"],
        data["val"],
        peak_lr,
        lambda step, spe: warmup_multistep(step, spe, args.warmup_epochs, args.decay_epochs),
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
