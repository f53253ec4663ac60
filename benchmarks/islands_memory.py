"""The outer state each rank keeps with islands (``worker=hvd_slowmo.Islands(mesh)``), for S = 1, 2
and 4 shards per island: 4 ranks as meshes (4, 1), (2, 2) and (1, 4) (islands x ranks per
island; with (1, 4) one island, i.e. SlowMo with one worker). The model is sharded with FSDP2
inside each island, so the outer state should be 1/S of S = 1's (docs/islands.md).

Launch:  torchrun --nproc-per-node 4 benchmarks/islands_memory.py [--width 512 --layers 8]

Counted, in bytes, on every rank (rank 0 prints the largest over ranks, per component):
  - slow state: each fragment's ``state_tensors()`` (``opt.slow_states``: anchor and slow buffer);
  - residual: the codec's error-feedback residual (each fragment's exchange's ``state_dict()``,
    ``opt.exchanges``; int8 codec with ``error_feedback=True``);
  - in flight: the copies an overlapped outer step keeps until it lands (``opt.outer.in_flight``:
    the parameters sent, their snapshot, the model buffers'; ``fragments=2, overlap=1``), the
    largest seen over the run.
The settings: Local AdamW, ``tau=4, fragments=2, overlap=1, codec="int8",
error_feedback=True``, 12 steps of fixed random batches. Bytes, not time: deterministic, so this
may run on a busy machine.
"""

import argparse
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hvd_slowmo

SETTINGS: dict[str, Any] = dict(
    base="localsgd", tau=4, fragments=2, overlap=1, codec="int8", error_feedback=True
)
IN_FLIGHT_COPIES = ("sent", "snapshot", "extra_sent", "extra_snapshot", "state_sent")


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nest of lists, tuples and dicts (each counted once)."""
    seen: set[int] = set()

    def walk(o: Any) -> Iterable[Tensor]:
        if isinstance(o, Tensor):
            yield o
        elif isinstance(o, dict):
            for v in o.values():
                yield from walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                yield from walk(v)

    total = 0
    for t in walk(obj):
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def measure(islands: int, width: int, layers: int, steps: int) -> dict[str, int]:
    """Train ``steps`` steps on a mesh of ``islands`` x ``4 / islands``; count the outer state."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (islands, world // islands), mesh_dim_names=("islands", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        named_parameters=model.named_parameters(),
        worker=hvd_slowmo.Islands(mesh),
        **SETTINGS,
    )
    g = torch.Generator().manual_seed(dist.get_rank())
    in_flight = 0
    for _ in range(steps):
        x = torch.randn(8, width, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        flight = opt.outer.in_flight
        if flight is not None:
            copies = [getattr(flight, name) for name in IN_FLIGHT_COPIES]
            in_flight = max(in_flight, tensor_bytes(copies))
    opt.flush()
    out = {
        "params": sum(p.to_local().numel() for p in model.parameters()),
        "slow_state": tensor_bytes([t for s in opt.slow_states for t in s.state_tensors()]),
        "residual": tensor_bytes([e.state_dict() for e in opt.exchanges]),
        "in_flight": in_flight,
    }
    out["total"] = out["slow_state"] + out["residual"] + out["in_flight"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4:
        raise ValueError(f"run under torchrun --nproc-per-node 4 (got {dist.get_world_size()})")
    rows = []
    for islands in (4, 2, 1):
        mine = measure(islands, args.width, args.layers, args.steps)
        everyone: list[Any] = [None] * 4
        dist.all_gather_object(everyone, mine)
        rows.append((islands, {k: max(r[k] for r in everyone) for k in mine}))
    if dist.get_rank() == 0:
        n = args.width * args.width * args.layers
        print(
            f"model: {args.layers} x Linear({args.width}, {args.width}), {n:,} float32 parameters "
            f"({4 * n / 2**20:.1f} MiB); settings {SETTINGS}; largest rank, bytes"
        )
        print(
            "| S (ranks per island) | mesh | params / rank | slow state | residual | in flight "
            "| total | total / S=1's |"
        )
        print("|---|---|---|---|---|---|---|---|")
        base = rows[0][1]["total"]
        for islands, r in rows:
            s = 4 // islands
            print(
                f"| {s} | ({islands}, {s}) | {r['params']:,} | {r['slow_state']:,} | "
                f"{r['residual']:,} | {r['in_flight']:,} | {r['total']:,} | "
                f"{r['total'] / base:.3f} (1/S = {1 / s:.3f}) |"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
