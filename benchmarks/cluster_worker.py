"""One ``benchmarks/cluster.py`` worker: times every algorithm in this process, rank 0 writes JSON.

Started by cluster.py inside an emulated host's network namespace with Horovod's Gloo
environment set (and ``GLOO_SOCKET_IFNAME``/``MASTER_ADDR`` for ``torch.distributed``, which the
PyTorch peers use); not meant to be run by hand. ``--spec`` is a JSON object with ``workload``,
``params``, ``compute_ms``, ``backward_fraction``, ``batch_size``, ``algorithms``, ``iters``,
``windows``, ``output``.
"""

import argparse
import ctypes
import datetime
import gc
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(
    2, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)

import horovod
import horovod.torch as hvd
from cifar10_resnet18 import ResNet18
from cluster_algorithms import ALGORITHM_BY_KEY, WARMUP_ITERS, Algorithm
from cluster_stats import cluster_stamps, pool_repeats, ring_bytes, window_stats

import hvd_slowmo
from hvd_slowmo.memory import held_bytes, release_free_pages

Step = Callable[[nn.Module], None]


class Layer(nn.Module):
    """One synthetic layer: a weight vector (its own module, so ``fragments=P`` can split the
    model by layer as it splits a real one).

    Args:
        size: its parameter count.
    """

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size) * 0.01)


class Synthetic(nn.Module):
    """``num_params`` parameters in up to 8 layers of one tensor each; compute is a sleep.

    Args:
        num_params: total parameter count.
    """

    def __init__(self, num_params: int) -> None:
        super().__init__()
        layers = min(8, num_params)
        sizes = [num_params // layers] * layers
        sizes[-1] += num_params - sum(sizes)
        self.layers = nn.ModuleList(Layer(s) for s in sizes)

    def forward(self, backward_s: float = 0.0) -> torch.Tensor:
        """A cheap loss that gives every parameter a gradient (through ``forward``, so DDP's
        reducer expects the backward's hooks), built as a chain of layers: the backward pass
        reaches the last chunk first and the first chunk last.

        Args:
            backward_s: seconds the backward pass sleeps, split evenly between the layers (each
                layer's share before its gradient is ready), so gradient-ready hooks fire while
                the backward pass goes on.
        """
        loss = torch.zeros(())
        for i, layer in enumerate(self.layers):
            loss = loss + layer.weight.sum() * (1e-3 * (i + 1))
            if backward_s > 0:
                loss = SleepInBackward.apply(loss, backward_s / len(self.layers))
        return loss


class SleepInBackward(torch.autograd.Function):
    """The identity whose backward sleeps: one layer's backward compute without using the CPU
    (co-located emulated hosts do not contend for it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


def synthetic_step(compute_ms: float, backward_fraction: float = 0.0) -> Step:
    """Sleep (no CPU used, so co-located hosts do not contend) ``compute_ms`` in all: the share
    ``backward_fraction`` inside the backward pass, between layers (gradient-ready hooks of
    Horovod, DDP and hvd_slowmo's AR-SGD fire during it), the rest before it.

    Args:
        compute_ms: the emulated forward + backward time.
        backward_fraction: the share of it spent in the backward pass, in [0, 1).
    """
    backward_s = compute_ms * backward_fraction / 1e3

    def step(model: nn.Module) -> None:
        time.sleep(compute_ms / 1e3 - backward_s)
        model(backward_s).backward()

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
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(
            self.encoder(h, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        )


def host_compute_ms(spec: dict[str, Any], rank: int, size: int) -> float:
    """This host's synthetic compute per iteration: ``compute_ms``, times ``slow_factor`` on
    the last host (an unequal host; every algorithm of the run then waits for it at its
    synchronizations).

    Args:
        spec: the harness's workload description.
        rank: this host's rank.
        size: the number of hosts.
    """
    slow = spec.get("slow_factor", 1.0) if rank == size - 1 else 1.0
    return float(spec["compute_ms"]) * slow


def host_pause(spec: dict[str, Any], rank: int, size: int) -> tuple[int, float]:
    """This host's pause: (the timed iteration it pauses before, seconds); ``(-1, 0.0)`` for
    every host but the last, or when the spec has none (a stalled host: a sleep, its sockets
    open, the others wait for it at their next synchronization).

    Args:
        spec: the harness's workload description (``pause_at``, ``pause_ms``).
        rank: this host's rank.
        size: the number of hosts.
    """
    if rank != size - 1 or not spec.get("pause_ms"):
        return -1, 0.0
    return int(spec["pause_at"]), float(spec["pause_ms"]) / 1e3


def build(spec: dict[str, Any]) -> tuple[nn.Module, Step]:
    """A fresh model (same on every rank) and its training-step function for the spec's workload.

    Args:
        spec: the harness's workload description.
    """
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + hvd.rank())  # each worker its own fixed batch
    b = spec["batch_size"]
    if spec["workload"] == "synthetic":
        compute_ms = host_compute_ms(spec, hvd.rank(), hvd.size())
        step = synthetic_step(compute_ms, spec.get("backward_fraction", 0.0))
        return Synthetic(spec["params"]), step
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
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            ).backward()

        return model, step
    raise ValueError(f"unknown workload {spec['workload']!r}")


def barrier() -> None:
    """Every rank waits for every other (a one-element allreduce: any Horovod version has it)."""
    hvd.allreduce(torch.zeros(1), name="cluster.barrier")


#: The kinds of :data:`cluster.ALGORITHMS` that communicate over ``torch.distributed``.
TORCH_KINDS = ("ddp", "postlocal")
#: "step" ("outer") in the environment: hvd_slowmo.memory.release_free_pages() after every
#: step of every row (after every outer step of the SlowMo rows;
#: benchmarks/memory_rows.py --release-free-pages).
RELEASE_FREE_PAGES = "CLUSTER_RELEASE_FREE_PAGES"


def uses_torch_distributed(algo: Algorithm) -> bool:
    """A PyTorch peer, or hvd_slowmo over its torch.distributed engine."""
    return algo.kind in TORCH_KINDS or algo.options.get("engine") == "torch"


def init_torch_distributed() -> None:
    """Join every worker into one ``torch.distributed`` Gloo group, the PyTorch peers' transport.

    Rank 0 opens the group's store at its own address (``MASTER_ADDR``) on a port the kernel
    picks, and tells the others over Horovod, so no port is guessed; ``GLOO_SOCKET_IFNAME``
    (set by the harness) keeps Gloo's traffic on the host's shaped link.
    """
    addr, size = os.environ["MASTER_ADDR"], hvd.size()
    store = (
        dist.TCPStore(addr, 0, size, is_master=True, wait_for_workers=False)
        if hvd.rank() == 0
        else None
    )
    port = hvd.broadcast_object(
        store.port if store is not None else None, root_rank=0, name="cluster.torch_store_port"
    )
    if store is None:
        store = dist.TCPStore(addr, port, size, is_master=False)
    dist.init_process_group(
        "gloo",
        store=store,
        rank=hvd.rank(),
        world_size=size,
        timeout=datetime.timedelta(minutes=30),
    )


def _optimizer(
    algo: Algorithm, model: torch.nn.Module
) -> tuple[torch.optim.Optimizer | None, Any, str]:
    """The optimizer ``algo`` measures, its hvd_slowmo communicator (None for the others), and
    why it is unavailable (an empty string when it is)."""
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if algo.kind in ("compute", "ddp"):
        return inner, None, ""
    if algo.kind == "horovod":
        return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters()), None, ""
    if algo.kind == "postlocal":
        # torch's documented set-up adds DDP with post_localSGD_hook, which after its warm-up
        # allreduces gradients only within each host's subgroup: one worker per host here, so
        # nothing. The honest equivalent is the plain model, and the averager alone communicates:
        # every `tau` optimizer steps one flat allreduce of all parameters (momentum stays local).
        averager = PeriodicModelAverager(period=algo.tau, warmup_steps=0)
        return PostLocalSGDOptimizer(inner, averager), None, ""
    # BatchNorm running statistics are averaged with the parameters, as in training.
    running_stats = [b for name, b in model.named_buffers() if "running_" in name]
    try:
        opt = hvd_slowmo.DistributedOptimizer(
            inner,
            named_parameters=model.named_parameters(),
            base=algo.base,
            tau=algo.tau,
            model_buffers=running_stats,
            **algo.options,
        )
    except TypeError as e:
        # A library without the option refuses the keyword before any collective, on every
        # rank alike; any other TypeError is a bug and propagates.
        if algo.overlap and "overlap" in str(e):
            return None, None, f"this hvd_slowmo has no overlap option: {e}"
        raise
    except ValueError as e:
        # fragments=P needs P layers (the synthetic model has up to 8).
        if "fragments" in str(e):
            return None, None, f"not for this workload: {e}"
        raise
    return opt, opt.comm, ""


def _timed(
    iteration: Callable[[], None], n: int, comm: Any, pause: tuple[int, float]
) -> tuple[list[float], list[int]]:
    """Run ``n`` timed iterations; returns the stamps (the start, then each end) and the bytes
    sent by then (0 without a communicator).

    Args:
        iteration: one training iteration.
        n: how many.
        comm: the optimizer's communicator, or None.
        pause: (the iteration this host pauses before, seconds): :func:`host_pause`.
    """
    stamps, sent = [time.perf_counter()], [comm.bytes_sent if comm is not None else 0]
    for i in range(n):
        if i == pause[0]:
            time.sleep(pause[1])
        iteration()
        stamps.append(time.perf_counter())
        sent.append(comm.bytes_sent if comm is not None else 0)
    return stamps, sent


def measure(algo: Algorithm, spec: dict[str, Any]) -> dict[str, Any]:
    """Time ``algo`` over whole outer periods, after ``WARMUP_ITERS`` warm-up iterations.

    Args:
        algo: the configuration.
        spec: the workload description (``iters``, ``windows``).
    """
    if algo.kind == "slowmo" and algo.base not in hvd_slowmo.BASES:
        return {"available": False, "reason": f"base {algo.base!r} not in hvd_slowmo.BASES"}
    model, step = build(spec)
    if algo.kind == "ddp":
        # DDP's reducer allreduces gradient buckets over Gloo during the backward, as in training.
        model = DistributedDataParallel(model)
    opt, comm, unavailable = _optimizer(algo, model)
    if opt is None:
        return {"available": False, "reason": unavailable}

    # memory_rows.py --release-free-pages: glibc's free pages returned after every step (every
    # row, compute-only included, so that the baseline is taken alike), or after each outer step.
    release = os.environ.get(RELEASE_FREE_PAGES, "no")
    release = "no" if release == "outer" and comm is None else release

    def iteration() -> None:
        opt.zero_grad()
        step(model)
        outer_steps = opt.outer_steps if release == "outer" else 0
        opt.step()
        if release == "step" or (release == "outer" and opt.outer_steps != outer_steps):
            release_free_pages()

    tau = algo.tau
    # Whole outer periods: any tau consecutive iterations hold exactly one outer step.
    n = -(-max(spec["iters"], spec["windows"] * tau) // tau) * tau
    for _ in range(WARMUP_ITERS):  # allocations, Horovod's first negotiation of each tensor
        iteration()
    barrier()
    bytes0 = comm.bytes_sent if comm is not None else 0
    timings0 = dict(opt.timings) if comm is not None else {}
    stamps, sent = _timed(iteration, n, comm, host_pause(spec, hvd.rank(), hvd.size()))
    timings1 = dict(opt.timings) if comm is not None else {}
    # What each part of the optimizer holds at the end of the timed steps (an average in flight
    # included), beside the process's peak resident memory (measured after the row).
    held = held_bytes(opt) if comm is not None else None
    if comm is not None:
        # Untimed: land what is still in flight, so the next row's collectives (same names) never
        # meet this row's, and its buffers are freed with the optimizer.
        opt.flush()
    flushed = comm.bytes_sent if comm is not None else 0
    barrier()
    everyone = hvd.allgather_object(stamps, name=f"cluster.stamps.{algo.key}")
    merged = cluster_stamps(everyone)
    out = window_stats(merged, tau)
    out["iteration_ms"] = [1e3 * (b - a) for a, b in zip(merged, merged[1:])]
    out["iterations"] = n
    out["rank_median_ms"] = [window_stats(s, tau)["median_ms"] for s in everyone]
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if comm is not None:
        out["bytes_per_iter"] = (sent[-1] - bytes0) / n
        # Whole averages: a collective's bytes may be counted when it completes (an all-gather),
        # after the timed steps for the one still in flight, so the flush's are added here. The
        # averages started in the n / tau timed periods (the first starts after the warm-up).
        out["bytes_per_outer_step"] = (flushed - bytes0) / (n // tau)
        # hvd_slowmo has at most one exact average (or fragment's) in flight, so the most bytes
        # started in one step is the most in flight at once: what the link must carry per phase.
        out["peak_bytes_per_step"] = max(b - a for a, b in zip(sent, sent[1:]))
        out["bytes_computed"] = False
        out["phase_ms_per_iter"] = {k: 1e3 * (v - timings0[k]) / n for k, v in timings1.items()}
        out["held_bytes"] = held
    elif algo.kind in ("horovod", "ddp", "postlocal"):
        # Gloo's ring volume (not counted): every step, or one parameter average per `tau` steps.
        out["bytes_per_iter"] = ring_bytes(grad_bytes, hvd.size()) / algo.tau
        out["peak_bytes_per_step"] = ring_bytes(grad_bytes, hvd.size())  # all at once
        out["bytes_computed"] = True
    else:
        out["bytes_per_iter"], out["bytes_computed"] = 0, False
        out["peak_bytes_per_step"] = 0
    return out


def _release_freed_memory() -> None:
    """Hand the finished row's freed tensors back to the OS: the rows share one process, and
    glibc keeps freed heap pages, so each row would start near the last one's peak (measured
    with 16M parameters over 2 Horovod workers: after five rows a worker held 25 model copies
    resident without this, 13 with it; a 50M-parameter run at 4 workers was OOM-killed)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def main() -> None:
    """Measure every requested algorithm; rank 0 writes the JSON the harness reads."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    spec = json.loads(parser.parse_args().spec)
    torch.set_num_threads(1)
    hvd.init()
    if any(uses_torch_distributed(ALGORITHM_BY_KEY[key]) for key in spec["algorithms"]):
        init_torch_distributed()
    raw: dict[str, list[dict[str, Any]]] = {key: [] for key in spec["algorithms"]}
    unavailable: dict[str, dict[str, Any]] = {}
    for rep in range(spec["repeats"]):
        # Forward, then backward, ...: a slow drift of the machine's load then hits every algorithm
        # alike.
        order = spec["algorithms"] if rep % 2 == 0 else spec["algorithms"][::-1]
        for key in order:
            t0 = time.perf_counter()
            r = measure(ALGORITHM_BY_KEY[key], spec)
            _release_freed_memory()
            # The workers' peak resident memory so far (the process's high-water mark, so a row
            # that raises it shows as a step): what decides how many workers fit on a host.
            peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            r["max_rss_mb"] = max(hvd.allgather_object(peak_kb, name=f"cluster.rss.{key}")) / 1024
            if r.get("available", True):
                raw[key].append(r)
            else:
                unavailable[key] = r
            if hvd.rank() == 0:
                msg = (
                    f"{r['median_ms']:.1f} ms/it [{r['min_ms']:.1f}-{r['max_ms']:.1f}] "
                    f"over {r['windows']} windows, peak RSS {r['max_rss_mb']:.0f} MB"
                    + (
                        "; held: "
                        + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r["held_bytes"].items())
                        + f" (sum {sum(r['held_bytes'].values()) / 2**20:.0f} MB)"
                        if r.get("held_bytes")
                        else ""
                    )
                    if r.get("available", True)
                    else "not available: " + r["reason"]
                )
                print(f"  {key:18s} {msg} ({time.perf_counter() - t0:.0f} s)", flush=True)
    results = {
        key: pool_repeats(raw[key]) if raw[key] else unavailable[key] for key in spec["algorithms"]
    }
    if hvd.rank() == 0:
        model, _ = build(spec)
        header = {
            "workload": spec["workload"],
            "compute_ms": spec.get("compute_ms"),
            "backward_fraction": spec.get("backward_fraction", 0.0),
            "params": sum(p.numel() for p in model.parameters()),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "batch_size": None if spec["workload"] == "synthetic" else spec["batch_size"],
            "horovod": horovod.__version__,
            "torch": torch.__version__,
            "size": hvd.size(),
            "repeats": spec["repeats"],
        }
        tmp = spec["output"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=1)
        os.replace(tmp, spec["output"])
    if dist.is_initialized():
        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
