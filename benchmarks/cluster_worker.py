"""One worker of ``benchmarks/cluster.py``: times every algorithm in this process, rank 0 writes JSON.

Started by cluster.py inside an emulated host's network namespace with Horovod's Gloo
environment set; not meant to be run by hand. ``--spec`` is a JSON object with ``workload``,
``params``, ``compute_ms``, ``batch_size``, ``algorithms``, ``iters``, ``windows``, ``output``.
"""
import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(2, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import horovod  # noqa: E402
import horovod.torch as hvd  # noqa: E402

import hvd_slowmo  # noqa: E402
from cifar10_resnet18 import ResNet18  # noqa: E402  (the example's model: one definition)
from cluster import ALGORITHM_BY_KEY, Algorithm, cluster_stamps, pool_repeats, ring_bytes, window_stats  # noqa: E402

Step = Callable[[nn.Module], None]


class Synthetic(nn.Module):
    """``num_params`` parameters in up to 8 tensors (like layers); compute is a sleep.

    Args:
        num_params: total parameter count.
    """

    def __init__(self, num_params: int) -> None:
        super().__init__()
        chunks = min(8, num_params)
        sizes = [num_params // chunks] * chunks
        sizes[-1] += num_params - sum(sizes)
        self.chunks = nn.ParameterList(nn.Parameter(torch.randn(s) * 0.01) for s in sizes)


def synthetic_step(compute_ms: float) -> Step:
    """Sleep ``compute_ms`` (no CPU used, so co-located hosts do not contend), then a cheap
    backward that gives every parameter a gradient and fires Horovod's allreduce hooks.

    Args:
        compute_ms: the emulated forward/backward time.
    """
    def step(model: nn.Module) -> None:
        time.sleep(compute_ms / 1e3)
        loss = sum(p.sum() * (1e-3 * (i + 1)) for i, p in enumerate(model.parameters()))
        loss.backward()
    return step


class TinyLM(nn.Module):
    """A 4-layer transformer language model (d=256), the paper's WMT workload scaled to a CPU."""

    def __init__(self, vocab: int = 2000, d: int = 256, layers: int = 4, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.encoder(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def build(spec: Dict[str, Any]) -> Tuple[nn.Module, Step]:
    """A fresh model (same on every rank) and its training-step function for the spec's workload.

    Args:
        spec: the harness's workload description.
    """
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + hvd.rank())  # each worker its own fixed batch
    b = spec["batch_size"]
    if spec["workload"] == "synthetic":
        return Synthetic(spec["params"]), synthetic_step(spec["compute_ms"])
    if spec["workload"] == "resnet18":
        model = ResNet18()
        x, y = torch.randn(b, 3, 32, 32, generator=gen), torch.randint(0, 10, (b,), generator=gen)

        def step(m: nn.Module) -> None:
            F.cross_entropy(m(x), y).backward()
        return model, step
    if spec["workload"] == "transformer":
        model = TinyLM()
        tokens = torch.randint(0, 2000, (b, 65), generator=gen)

        def step(m: nn.Module) -> None:
            logits = m(tokens[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        return model, step
    raise ValueError(f"unknown workload {spec['workload']!r}")


def barrier() -> None:
    """Every rank waits for every other (a one-element allreduce: works on every Horovod version)."""
    hvd.allreduce(torch.zeros(1), name="cluster.barrier")


def measure(algo: Algorithm, spec: Dict[str, Any]) -> Dict[str, Any]:
    """Time ``algo`` over whole outer periods, after two warm-up iterations.

    Args:
        algo: the configuration.
        spec: the workload description (``iters``, ``windows``).
    """
    if algo.kind == "slowmo" and algo.base not in hvd_slowmo.BASES:
        return {"available": False, "reason": f"base {algo.base!r} not in hvd_slowmo.BASES"}
    model, step = build(spec)
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    comm = None
    if algo.kind == "compute":
        opt: torch.optim.Optimizer = inner
    elif algo.kind == "horovod":
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    else:
        # BatchNorm running statistics are averaged with the parameters, as in training.
        running_stats = [b for name, b in model.named_buffers() if "running_" in name]
        opt = hvd_slowmo.DistributedOptimizer(inner, named_parameters=model.named_parameters(), base=algo.base,
                                              tau=algo.tau, model_buffers=running_stats, **algo.options)
        comm = opt.comm

    def iteration() -> None:
        opt.zero_grad()
        step(model)
        opt.step()

    tau = algo.tau
    n = max(spec["iters"], spec["windows"] * tau)
    n = -(-n // tau) * tau  # whole outer periods: any tau consecutive iterations hold exactly one outer step
    for _ in range(2):  # warm-up: allocations, Horovod's first negotiation of each tensor
        iteration()
    barrier()
    bytes0 = comm.bytes_sent if comm is not None else 0
    timings0 = dict(opt.timings) if comm is not None else {}
    stamps = [time.perf_counter()]
    for _ in range(n):
        iteration()
        stamps.append(time.perf_counter())
    barrier()
    everyone = hvd.allgather_object(stamps, name=f"cluster.stamps.{algo.key}")
    merged = cluster_stamps(everyone)
    out = window_stats(merged, tau)
    out["iteration_ms"] = [1e3 * (b - a) for a, b in zip(merged, merged[1:])]
    out["iterations"] = n
    out["rank_median_ms"] = [window_stats(s, tau)["median_ms"] for s in everyone]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if comm is not None:
        out["bytes_per_iter"] = (comm.bytes_sent - bytes0) / n
        out["bytes_computed"] = False
        out["phase_ms_per_iter"] = {k: 1e3 * (v - timings0[k]) / n for k, v in opt.timings.items()}
    elif algo.kind == "horovod":
        out["bytes_per_iter"] = ring_bytes(grad_bytes, hvd.size())  # Gloo ring volume, not counted
        out["bytes_computed"] = True
    else:
        out["bytes_per_iter"], out["bytes_computed"] = 0, False
    return out


def main() -> None:
    """Measure every requested algorithm; rank 0 writes the JSON the harness reads."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(parser.parse_args().spec)
    torch.set_num_threads(1)
    hvd.init()
    raw: Dict[str, List[Dict[str, Any]]] = {key: [] for key in spec["algorithms"]}
    unavailable: Dict[str, Dict[str, Any]] = {}
    for rep in range(spec["repeats"]):
        # Forward, then backward, ...: a slow drift of the machine's load then hits every algorithm alike.
        order = spec["algorithms"] if rep % 2 == 0 else spec["algorithms"][::-1]
        for key in order:
            t0 = time.perf_counter()
            r = measure(ALGORITHM_BY_KEY[key], spec)
            if r.get("available", True):
                raw[key].append(r)
            else:
                unavailable[key] = r
            if hvd.rank() == 0:
                msg = (f"{r['median_ms']:.1f} ms/it [{r['min_ms']:.1f}-{r['max_ms']:.1f}] over {r['windows']} windows"
                       if r.get("available", True) else "not available: " + r["reason"])
                print(f"  {key:18s} {msg} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = {key: pool_repeats(raw[key]) if raw[key] else unavailable[key] for key in spec["algorithms"]}
    if hvd.rank() == 0:
        model, _ = build(spec)
        header = {"workload": spec["workload"], "compute_ms": spec.get("compute_ms"),
                  "params": sum(p.numel() for p in model.parameters()),
                  "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "batch_size": None if spec["workload"] == "synthetic" else spec["batch_size"],
                  "horovod": horovod.__version__,
                  "torch": torch.__version__, "size": hvd.size(), "repeats": spec["repeats"]}
        tmp = spec["output"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=1)
        os.replace(tmp, spec["output"])
    hvd.shutdown()


if __name__ == "__main__":
    main()
