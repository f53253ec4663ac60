"""The TensorBoard pictures of docs/tensorboard.md: a small comparison trained on thread workers
(MNIST-1D, AR-SGD, Local SGD and Local SGD + SlowMo, two seeds each, a few epochs), served by
TensorBoard's own server and photographed by a headless browser (Debian's ``chromium``).

    python scripts/tensorboard_figures.py                  # writes docs/figures/tensorboard_*.png
    python scripts/tensorboard_figures.py --logdir runs/mnist1d   # pictures of runs you have

The runs are tiny and share this machine's cores: their times show what the dashboard draws,
not a measurement (docs/results/ holds those).
"""

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import common  # noqa: E402
import mnist1d_cnn  # noqa: E402

from slowmo_lab import dashboard  # noqa: E402

METHODS = {
    "allreduce": ["--algo", "allreduce", "--no-slowmo"],
    "localsgd": ["--algo", "localsgd", "--no-slowmo"],
    "localsgd-slowmo": ["--algo", "localsgd", "--slowmo", "--slow-momentum", "0.5"],
}
# page -> (picture, window size): the HParams table is wide (a column per setting and per tag).
PAGES = {
    "custom_scalars": ("tensorboard_custom_scalars.png", (1600, 1000)),
    "hparams": ("tensorboard_hparams.png", (3000, 700)),
}


def train(logdir: str, seeds: int, epochs: int) -> None:
    """The comparison: every method and seed on 4 thread workers of this process.

    Args:
        logdir: where the runs go (``<method>/seed<k>``).
        seeds: seeds per method.
        epochs: epochs per run.
    """
    for method, flags in METHODS.items():
        for seed in range(seeds):
            argv = ["--threads", "4", "--tau", "12", "--epochs", str(epochs), "--no-progress"]
            argv += ["--logdir", logdir, "--run-name", f"{method}/seed{seed}"]
            argv += ["--seed", str(seed), "--log-every", "12", *flags]
            if common.run_cli(mnist1d_cnn.main, argv) != 0:
                raise SystemExit(f"{method} seed {seed} failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--logdir", help="photograph these runs instead of training new ones")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"))
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        logdir = args.logdir or scratch
        if not args.logdir:
            train(logdir, args.seeds, args.epochs)
        with dashboard.serve(logdir) as url:
            for page, (png, size) in PAGES.items():
                path = os.path.join(args.out, png)
                dashboard.screenshot(f"{url}/#{page}", path, size=size)
                print(path)


if __name__ == "__main__":
    main()
