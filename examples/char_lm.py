"""A byte-level decoder-only transformer in DiLoCo's regime (issue 30): AdamW inside, and
AR-AdamW vs Local AdamW (plain average every tau steps) vs Local AdamW + SlowMo with DiLoCo's
outer Nesterov (outer lr 0.7, momentum 0.9), compared by validation loss at equal steps.

    python examples/char_lm.py --threads 4 --algo localsgd --slowmo --tau 64 \\
        --slow-lr 0.7 --slow-momentum 0.9 --outer-optimizer nesterov
    torchrun --nproc-per-node 8 examples/char_lm.py --device cuda --amp --amp-dtype bf16 ...
    torchrun --nproc-per-node 4 examples/char_lm.py --islands 2 --slowmo --tau 32 ...

``--islands N`` splits the job into N islands (docs/islands.md): each island shards the model
over its ranks with FSDP2 (``--islands-inner ddp``: replicates it with DDP), its ranks train on
different slices of the island's batch of ``--batch-size`` sequences, and the islands are the
SlowMo workers (Local AdamW inside, the outer step every tau steps between islands).

The corpus needs no download and is the same wherever the project's dependencies are
installed: the top-level ``*.py`` modules of the running CPython's standard library (the pinned
Python, 3.11.7 here), read from disk in sorted order; the last 10% of its bytes are the
validation text. The summary records the Python version, the corpus size and its SHA-256, so
runs on two machines can be checked to have read the same text.
"""

import argparse
import functools
import hashlib
import math
import os
import sys
import sysconfig
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    Task,
    add_common_args,
    allreduce_sums,
    run_cli,
    setup,
    shard_islands,
    train,
    write_summary,
)

#: Fraction of the corpus (its end) held out as the validation text.
VAL_FRACTION = 0.1
#: The size the regime map ran on CPU (docs/results/regimes.md: 137,216 parameters, 512 steps at 16
#: epochs): compare.py's ``--task char_lm`` starts from these flags (the defaults above are
#: the 1.9M-parameter model, for a GPU).
CPU_SIZE = ["--width", "64", "--layers", "2", "--heads", "4", "--context", "64"]
CPU_SIZE += ["--batch-size", "16", "--steps-per-epoch", "32", "--val-batches", "4"]
#: compare.py's settings per method: AdamW's lr 1e-3 for all (not tuned), its moments kept at
#: each average; SlowMo with an outer Nesterov, outer lr 0.7 and momentum 0.8: the best of
#: outer lr {0.4, 0.7, 1} x momentum {0.8, 0.9} on seeds 100-102 at tau 64 (docs/results/regimes.md;
#: DiLoCo's 0.7 / 0.9 was the starting point).
COMPARE_SETTINGS: dict[str, dict[str, Any]] = {
    "allreduce": {"lr": 1e-3, "buffers": "maintain"},
    "localsgd": {"lr": 1e-3, "buffers": "maintain"},
    "localsgd-slowmo": {
        "lr": 1e-3,
        "buffers": "maintain",
        "slow_lr": 0.7,
        "slow_momentum": 0.8,
        "flags": ("--outer-optimizer", "nesterov"),
    },
}


@functools.cache
def load_corpus(max_bytes: int = 0) -> tuple[torch.Tensor, str]:
    """The running Python's top-level stdlib modules, concatenated (sorted by name), as bytes.

    Args:
        max_bytes: keep only the first this many bytes (0: all).

    Returns:
        (uint8 tensor of the bytes, its SHA-256 hex digest).
    """
    lib = sysconfig.get_paths()["stdlib"]
    data = b"".join(
        open(os.path.join(lib, f), "rb").read()
        for f in sorted(os.listdir(lib))
        if f.endswith(".py")
    )
    if max_bytes:
        data = data[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long(), hashlib.sha256(
        data
    ).hexdigest()


class ByteLM(nn.Module):
    """A small GPT: byte embeddings, learned positions, pre-norm causal transformer layers.

    Args:
        width: model width.
        layers: transformer layers.
        heads: attention heads.
        context: the longest sequence.
    """

    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=x.device)
        h = self.blocks(self.embed(x) + self.pos[:n], mask=mask, is_causal=True)
        return self.head(self.norm(h))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and return the final metrics (``val_loss``: mean cross-entropy in nats per byte).

    Args:
        argv: command-line arguments (default: sys.argv[1:]).
    """
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(
        parser,
        tau=64,
        slow_momentum=0.9,
        buffers="maintain",
        epochs=8,
        batch_size=16,
        lr=1e-3,
        data_flags=False,
    )
    g = parser.add_argument_group("language model")
    g.add_argument("--outer-optimizer", default="heavyball", choices=("heavyball", "nesterov"))
    g.add_argument("--amp-dtype", default="auto", choices=("auto", "bf16"))
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    g.add_argument("--width", type=int, default=192)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--context", type=int, default=128)
    g.add_argument("--steps-per-epoch", type=int, default=64)
    g.add_argument(
        "--val-batches", type=int, default=16, help="validation windows / 16, per worker"
    )
    g.add_argument("--corpus-bytes", type=int, default=0, help="0: the whole corpus")
    g.add_argument(
        "--islands",
        type=int,
        default=0,
        help="SlowMo between this many islands of ranks (torchrun; must divide the world size), "
        "each training one model sharded with FSDP2 over its ranks; --batch-size is then per "
        "island (0: every process is one worker)",
    )
    g.add_argument(
        "--islands-inner",
        default="fsdp",
        choices=("fsdp", "ddp"),
        help="inside an island: shard the model with FSDP2 or replicate it with DDP",
    )
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # setup() picks a GPU whenever one is visible
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no GPU is visible here; use --device cpu")
    hvd, device = setup(args)
    data, digest = load_corpus(args.corpus_bytes)
    split = int(len(data) * (1 - VAL_FRACTION))
    train_text, val_text = data[:split], data[split:]
    model = ByteLM(args.width, args.layers, args.heads, args.context).to(device)
    rank, size, n = hvd.rank(), hvd.size(), args.context
    islands = shard_islands(model, args, hvd, device, model.blocks.layers) if args.islands else None
    net = islands.module if islands is not None else model  # what the forward pass calls
    # Each worker (a process, or an island) draws its own batches; an island's ranks each take
    # their slice of the island's batch.
    worker = islands.index if islands is not None else rank
    rows = islands.rows(args.batch_size) if islands is not None else slice(None)

    def batches(epoch: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed((args.seed * 1_000_003 + epoch) * 4099 + worker)
        starts = torch.randint(
            0, len(train_text) - n - 1, (args.steps_per_epoch, args.batch_size), generator=g
        )
        return [
            torch.stack([train_text[s : s + n + 1] for s in row.tolist()])
            for row in starts[:, rows]
        ]

    def loss(b: torch.Tensor) -> torch.Tensor:
        logits = net(b[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, 256), b[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        # Fixed windows spread over the validation text, dealt to the processes (with islands
        # every rank of an island evaluates the island's model, FSDP gathering each block in
        # turn: the same number of windows each, so their collectives pair up); summed exactly.
        total = args.val_batches * 16 * size
        stride = max(1, (len(val_text) - n - 1) // total)
        mine = range(rank, total, size)
        model.eval()
        loss_sum, count = 0.0, 0
        for chunk in range(0, len(mine), 16):
            idx = mine[chunk : chunk + 16]
            b = torch.stack([val_text[i * stride : i * stride + n + 1] for i in idx]).to(device)
            loss_sum += loss(b).item() * len(idx) * n
            count += len(idx) * n
        model.train()
        loss_sum, count = allreduce_sums([loss_sum, count], hvd, "char_lm.val")
        return {"val_loss": loss_sum / count}

    task = Task(
        name="char_lm",
        optimizer="adam",
        steps_per_epoch=args.steps_per_epoch,
        batches=batches,
        loss=loss,
        evaluate=evaluate,
        to_device=lambda b: b.to(device, non_blocking=True),
        target="val_loss",
    )
    base = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    total_steps = args.epochs * args.steps_per_epoch
    warmup = max(1, total_steps // 20)

    def lr_factor(step: int) -> float:  # linear warm-up, cosine to 10%
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (
            1 + math.cos(math.pi * min(1.0, (step - warmup) / (total_steps - warmup)))
        )

    summary = train(args, hvd, device, task, model, base, lr_factor, islands)
    summary.update(
        corpus=f"CPython {sys.version.split()[0]} stdlib top-level *.py",
        corpus_bytes=len(data),
        corpus_sha256=digest,
        params=sum(p.numel() for p in model.parameters()),
        outer_optimizer=args.outer_optimizer,
        slow_lr=args.slow_lr if args.slowmo else 1.0,
        **(islands.summary() if islands is not None else {}),
    )
    write_summary(args.summary_json, summary, rank)  # again, with the corpus and the model named
    return summary


if __name__ == "__main__":
    sys.exit(run_cli(main))
