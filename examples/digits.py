"""A small CNN on scikit-learn's 8x8 digits with SlowMo (arXiv 1910.00643): a fast option of
the main job (``examples/compare.py --task digits``), small enough for a laptop CPU. No
download: the data ships with scikit-learn. Every method reaches ~98.5% here, so it cannot
separate them: the main job's default is MNIST-1D (examples/mnist1d_cnn.py).

Launch (one algorithm; examples/compare.py runs them all and prints the tables):

    horovodrun -np 4 --gloo python examples/digits.py --algo localsgd --slowmo --tau 12 \\
        --slow-momentum 0.7

80/20 train/validation split (fixed seed); an epoch is the multiple of tau steps closest to one
pass over the training data (each worker reads its own shuffled stream), so the averaged
model is evaluated at an outer-step boundary; peak lr = --lr x workers (linear scaling of the
global batch) after a 2-epoch linear warm-up and divided by 10 for the last quarter of the
epochs; Nesterov SGD, momentum 0.9, weight decay 1e-4. TensorBoard scalars go to
runs/<run name>/.
"""

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_common_args, run_cli, setup, train_classifier, warmup_multistep

#: compare.py --task digits: one learning rate for every method (per worker; not tuned: this
#: task saturates), beta = 0.7; the baselines keep their local momentum, SlowMo resets it.
SETTINGS: dict[str, dict[str, Any]] = {
    method: (
        {"lr": 0.025, "slow_momentum": 0.7, "buffers": "reset"}
        if method.endswith("-slowmo")
        else {"lr": 0.025, "buffers": "maintain"}
    )
    for method in (
        "allreduce",
        "localsgd",
        "localsgd-slowmo",
        "sgp",
        "sgp-slowmo",
        "osgp",
        "osgp-slowmo",
    )
}


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, one pooling, two linear layers (38k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_digits_split(seed: int = 0) -> dict[str, TensorDataset]:
    """The 1797 digits as (N, 1, 8, 8) floats in [0, 1], split 80/20 by a fixed permutation.

    Args:
        seed: the permutation's seed (the same on every worker, so the split is too).
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = len(y) // 5
    val, train = perm[:n_val], perm[n_val:]
    return {"train": TensorDataset(x[train], y[train]), "val": TensorDataset(x[val], y[val])}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and return the final metrics.

    Args:
        argv: command-line arguments (default: sys.argv[1:]).
    """
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(
        parser,
        tau=12,
        slow_momentum=0.7,
        buffers="reset",
        epochs=10,
        batch_size=16,
        lr=0.025,
        data_flags=False,
        eval_train_loss=True,
    )
    args = parser.parse_args(argv)
    hvd, device = setup(args)
    data = load_digits_split()
    decay_at = [int(0.75 * args.epochs)]
    return train_classifier(
        args,
        hvd,
        device,
        "digits_cnn",
        DigitsCNN().to(device),
        data["train"],
        data["val"],
        peak_lr=args.lr * hvd.size(),
        lr_factor=lambda step, spe: warmup_multistep(step, spe, 2, decay_at),
        in_memory=True,
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
