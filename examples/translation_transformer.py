"""An encoder-decoder Transformer for translation with SlowMo over Adam (arXiv 1910.00643, the
WMT'16 En-De setting of Sec. 5 / Appendix B).

    horovodrun -np 8 python examples/translation_transformer.py --data wmt16_en_de \\
        --src-lang en --tgt-lang de --algo localsgd --slowmo --tau 12 --slow-momentum 0.5 --amp

    # seconds on a CPU: a toy "reverse the sentence" task and a tiny model (what the tests run):
    horovodrun -np 2 --gloo python examples/translation_transformer.py --synthetic --epochs 1

``--data`` holds parallel text files ``train.<src>``, ``train.<tgt>``, ``valid.<src>``,
``valid.<tgt>`` (one sentence per line, e.g. WMT'16 En-De as prepared by fairseq's
``prepare-wmt14en2de.sh``; no automatic download). Tokens are whitespace/punctuation pieces;
one joint vocabulary is built from the training files.

Recipe (Ott et al. 2018, as in the paper): Transformer-big (6+6 layers, d_model 1024, 16 heads,
FFN 4096, dropout 0.3, shared embeddings), Adam with betas (0.9, 0.98) and eps 1e-8, lr rising
linearly to 1e-3 over 4000 steps then decaying as 1/sqrt(step), label smoothing 0.1; SlowMo
keeps ("maintain") the Adam buffers at each outer step, alpha = 1. Validation reports the
per-token NLL (natural log, no smoothing) on TensorBoard as val/nll.
"""

import argparse
import math
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    Task,
    add_common_args,
    allreduce_sums,
    autocast,
    inverse_sqrt,
    log0,
    run_cli,
    setup,
    train,
)

# torch's encoder fast path (evaluation with a padding mask) warns that nested tensors are a
# prototype.
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
# That fast path also rejects bf16 inputs under CPU autocast (--amp on a CPU): use the plain path.
torch.backends.mha.set_fastpath_enabled(False)

PAD, UNK, BOS, EOS = 0, 1, 2, 3
SPECIALS = ["<pad>", "<unk>", "<bos>", "<eos>"]
_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def tokenize(line: str) -> list[str]:
    """Words and single punctuation marks (BPE-segmented input keeps its ``@@`` pieces apart)."""
    return _TOKEN.findall(line)


def build_vocab(lines: Sequence[str], max_size: int, min_freq: int) -> dict[str, int]:
    """One joint vocabulary, most frequent tokens first, after the four special tokens.

    Args:
        lines: all training sentences of both languages.
        max_size: at most this many entries (specials included).
        min_freq: drop rarer tokens.
    """
    counts = Counter(tok for line in lines for tok in tokenize(line))
    words = [w for w, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if c >= min_freq]
    return {w: i for i, w in enumerate(SPECIALS + words[: max(0, max_size - len(SPECIALS))])}


def encode(line: str, vocab: dict[str, int], max_len: int) -> list[int]:
    """Token ids of one sentence, truncated to ``max_len``."""
    return [vocab.get(t, UNK) for t in tokenize(line)][:max_len]


def read_lines(path: str) -> list[str]:
    """The lines of a text file (no trailing newlines)."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def make_batches(
    pairs: list[tuple[list[int], list[int]]], batch_size: int
) -> list[tuple[Tensor, Tensor]]:
    """Sort sentence pairs by length and pad them into batches of ``batch_size`` pairs (length
    bucketing keeps the padding small).

    Args:
        pairs: (source ids, target ids).
        batch_size: sentences per batch.

    Returns:
        (source [B, S], target [B, T+1] = target ids + EOS) tensors, padded with PAD.
    """
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = [pairs[i] for i in order[start : start + batch_size]]
        src = torch.full((len(chunk), max(len(s) for s, _ in chunk) or 1), PAD, dtype=torch.long)
        tgt = torch.full((len(chunk), max(len(t) for _, t in chunk) + 1), PAD, dtype=torch.long)
        for i, (s, t) in enumerate(chunk):
            src[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            tgt[i, : len(t) + 1] = torch.tensor(t + [EOS], dtype=torch.long)
        batches.append((src, tgt))
    return batches


def load_data(
    args: argparse.Namespace,
) -> tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]], int]:
    """Training and validation batches and the vocabulary size.

    Args:
        args: the parsed flags.
    """
    if args.synthetic:
        # Reverse a random sentence: learnable, so the loss visibly falls within seconds.
        g = torch.Generator().manual_seed(0)
        vocab = 32

        def sample(n: int) -> list[tuple[list[int], list[int]]]:
            out = []
            for _ in range(n):
                s = torch.randint(
                    len(SPECIALS),
                    vocab,
                    (int(torch.randint(3, 9, (1,), generator=g)),),
                    generator=g,
                ).tolist()
                out.append((s, s[::-1]))
            return out

        return (
            make_batches(sample(256), args.batch_size),
            make_batches(sample(64), args.batch_size),
            vocab,
        )
    if args.download:
        raise ValueError(
            "--download: WMT'16 is not downloaded by this script; prepare the parallel text files "
            "(e.g. fairseq's examples/translation/prepare-wmt14en2de.sh) "
            "and pass their folder as --data"
        )
    files = {
        f"{split}.{lang}": os.path.join(args.data, f"{split}.{lang}")
        for split in ("train", "valid")
        for lang in (args.src_lang, args.tgt_lang)
    }
    missing = [p for p in files.values() if not os.path.exists(p)]
    if missing:
        raise ValueError(
            f"--data {args.data!r} lacks {missing}; "
            "it needs train.{src,tgt} and valid.{src,tgt} "
            "parallel text files (one sentence per line)"
        )
    text = {k: read_lines(p) for k, p in files.items()}
    vocab = build_vocab(
        text[f"train.{args.src_lang}"] + text[f"train.{args.tgt_lang}"], args.vocab_size, 2
    )

    def pairs(split: str) -> list[tuple[list[int], list[int]]]:
        src, tgt = text[f"{split}.{args.src_lang}"], text[f"{split}.{args.tgt_lang}"]
        if len(src) != len(tgt):
            raise ValueError(
                f"{split}.{args.src_lang} has {len(src)} lines "
                f"but {split}.{args.tgt_lang} {len(tgt)}"
            )
        return [
            (encode(s, vocab, args.max_len), encode(t, vocab, args.max_len))
            for s, t in zip(src, tgt)
        ]

    return (
        make_batches(pairs("train"), args.batch_size),
        make_batches(pairs("valid"), args.batch_size),
        len(vocab),
    )


class Seq2SeqTransformer(nn.Module):
    """torch.nn.Transformer with a shared (tied) embedding and sinusoidal positions.

    Args:
        vocab: vocabulary size.
        d_model: model width.
        heads: attention heads.
        layers: encoder and decoder layers (each).
        ffn: feed-forward width.
        dropout: dropout probability.
        max_len: longest sequence the positional table covers.
    """

    def __init__(
        self,
        vocab: int,
        d_model: int,
        heads: int,
        layers: int,
        ffn: int,
        dropout: float,
        max_len: int = 1024,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("positions", table, persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(
            d_model, heads, layers, layers, ffn, dropout, batch_first=True
        )

    def _embed(self, ids: Tensor) -> Tensor:
        return self.dropout(
            self.embed(ids) * math.sqrt(self.d_model) + self.positions[: ids.shape[1]]
        )

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        # Boolean like the padding masks (True = masked): mixing mask types is deprecated in torch.
        t = tgt_in.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=src.device).triu(1)
        out = self.transformer(
            self._embed(src),
            self._embed(tgt_in),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src == PAD,
            tgt_key_padding_mask=tgt_in == PAD,
            memory_key_padding_mask=src == PAD,
        )
        return out @ self.embed.weight.t()  # tied output projection


def teacher_forcing(tgt: Tensor) -> Tensor:
    """The decoder input: BOS followed by the target shifted right (its last position dropped)."""
    return torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)


@torch.no_grad()
def validate(
    model: nn.Module,
    batches: list[tuple[Tensor, Tensor]],
    hvd: Any,
    device: torch.device,
    args: argparse.Namespace,
) -> dict[str, float]:
    """Per-token NLL of the validation set; each worker scores every size-th batch (the training
    loop hands in the workers' averaged model). Collective.

    Args:
        model: the model to score.
        batches: all validation batches.
        hvd: the job (:class:`launch.Job`, from :func:`common.setup`).
        device: the device.
        args: the parsed flags.
    """
    model.eval()
    nll, tokens = 0.0, 0.0
    for src, tgt in batches[hvd.rank() :: hvd.size()]:
        src, tgt = src.to(device), tgt.to(device)
        with autocast(args, device):
            logits = model(src, teacher_forcing(tgt))
        nll += F.cross_entropy(
            logits.float().flatten(0, 1), tgt.flatten(), ignore_index=PAD, reduction="sum"
        ).item()
        tokens += (tgt != PAD).sum().item()
    model.train()
    nll, tokens = allreduce_sums([nll, tokens], hvd, "translation.eval")
    return {"val_nll": nll / max(tokens, 1.0)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and return the final metrics.

    Args:
        argv: command-line arguments (default: sys.argv[1:]).
    """
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(
        parser, tau=12, slow_momentum=0.5, buffers="maintain", epochs=25, batch_size=64, lr=1e-3
    )
    m = parser.add_argument_group("model and data")
    m.add_argument("--src-lang", default="en")
    m.add_argument("--tgt-lang", default="de")
    m.add_argument("--vocab-size", type=int, default=32000)
    m.add_argument("--max-len", type=int, default=256, help="tokens kept per sentence")
    m.add_argument("--d-model", type=int, default=1024)
    m.add_argument("--heads", type=int, default=16)
    m.add_argument("--layers", type=int, default=6)
    m.add_argument("--ffn", type=int, default=4096)
    m.add_argument("--dropout", type=float, default=0.3)
    m.add_argument("--warmup-steps", type=int, default=4000)
    m.add_argument("--label-smoothing", type=float, default=0.1)
    args = parser.parse_args(argv)
    if args.synthetic:  # a tiny model and a short warm-up: seconds on a CPU
        args.d_model, args.heads, args.layers, args.ffn, args.dropout = 32, 2, 1, 64, 0.0
        args.warmup_steps = min(args.warmup_steps, 20)
    hvd, device = setup(args)
    rank, size = hvd.rank(), hvd.size()
    train_batches, val_batches, vocab = load_data(args)

    # Shard whole (length-bucketed) batches; the sampler pads so every worker takes the same
    # number of steps, which the local methods' exact averages rely on.
    sampler = DistributedSampler(
        train_batches, num_replicas=size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_batches, batch_size=None, sampler=sampler)

    def batches(epoch: int) -> DataLoader:
        sampler.set_epoch(epoch)
        return loader

    def loss(batch: tuple[Tensor, Tensor]) -> Tensor:
        src, tgt = batch
        logits = model(src, teacher_forcing(tgt))
        return F.cross_entropy(
            logits.float().flatten(0, 1),
            tgt.flatten(),
            ignore_index=PAD,
            label_smoothing=args.label_smoothing,
        )

    model = Seq2SeqTransformer(
        vocab, args.d_model, args.heads, args.layers, args.ffn, args.dropout
    ).to(device)
    steps = len(sampler) if args.max_steps <= 0 else min(len(sampler), args.max_steps)
    task = Task(
        name="translation_transformer",
        optimizer="adam",
        steps_per_epoch=steps,
        batches=batches,
        loss=loss,
        evaluate=lambda: validate(model, val_batches, hvd, device, args),
        to_device=lambda b: (
            b[0].to(device, non_blocking=True),
            b[1].to(device, non_blocking=True),
        ),
        target="val_nll",
    )
    log0(rank, f"vocabulary: {vocab} tokens")
    base = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    return train(
        args, hvd, device, task, model, base, lambda step: inverse_sqrt(step, args.warmup_steps)
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
