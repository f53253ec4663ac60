"""Sharded vs unsharded slow state (``shard_slow_state``) on ResNet-18-sized parameters (Horovod).

Launch:  horovodrun -np 4 --gloo python benchmarks/sharded_overhead.py [--repeats 10] [--micro]

Prints, measured in one run (rank 0 prints):
  - the SlowMo state each rank keeps (anchor + slow buffer, or their shards), in MiB and as a
    multiple of the parameter bytes;
  - the outer step's time (exact average or reduce-scatter/all-gather, plus the slow update),
    median over ``--repeats`` outer steps of the slowest rank, the variants taking turns so
    that machine load hits both alike;
  - the bytes each rank hands to the transport per outer step;
  - with ``--micro``: Horovod's bare allreduce, reducescatter and allgather on one flat vector of
    the parameters' size, and one local copy of it, to show where the time goes.
The base step is plain SGD on fixed random gradients (no forward/backward) with ``tau=1``, so
every ``step()`` is one outer step; ``opt.timings`` splits out the outer step's time.
Not measured: the sharded step's transient buffers (a flat copy of the parameters, the
transport's receive buffer and the gathered anchor, freed when the step ends; see
hvd_slowmo/slow_state/sharded.py).
"""

import argparse
import statistics
import time

import horovod
import horovod.torch as hvd
import torch
import torchvision

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.horovod import HorovodCommunicator


def build(shard: bool, reduce_scatter: str = "auto") -> DistributedOptimizer:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    for p in model.parameters():  # rank-dependent gradients: the average has real work to do
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        tau=1,
        slow_lr=1.0,
        slow_momentum=0.7,
        nonfinite="ignore",
        shard_slow_state=shard,
        communicator=HorovodCommunicator(reduce_scatter=reduce_scatter),
    )
    opt.step()  # captures the anchor
    return opt


def state_bytes(opt: DistributedOptimizer) -> int:
    tensors = [t for s in opt.slow_states for t in s.state_tensors()]
    return sum(t.numel() * t.element_size() for t in tensors)


def outer_step_s(opt: DistributedOptimizer) -> tuple[float, float, float]:
    """One step (= one outer step, tau=1); returns the slowest rank's (outer step, communication,
    local work) seconds. Communication: the exact average, or reduce-scatter + all-gather (plus
    the flatten/unflatten copies around them)."""
    before = dict(opt.timings)
    opt.step()
    comm = opt.timings["average"] - before["average"]
    local = opt.timings["slow_update"] - before["slow_update"]
    return max(hvd.allgather_object((comm + local, comm, local), name="bench.time"))


def collectives_ms(numel: int, repeats: int) -> dict[str, float]:
    """Median ms (slowest rank) of Horovod's bare collectives on one flat float32 vector."""
    x = torch.randn(numel)
    shard = x[: numel // hvd.size()].clone()
    ops = {
        "allreduce (Average)": lambda: hvd.grouped_allreduce_(
            [x.clone()], op=hvd.Average, name="bench.ar"
        ),
        "reducescatter (Average)": lambda: hvd.grouped_reducescatter(
            [x], op=hvd.Average, name="bench.rs"
        ),
        "allgather": lambda: hvd.grouped_allgather([shard], name="bench.ag"),
        "local clone (a memory pass)": lambda: x.clone(),
    }
    out = {}
    for name, fn in ops.items():
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(max(hvd.allgather_object(time.perf_counter() - t0, name="bench.micro")))
        out[name] = 1e3 * statistics.median(ts)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--micro",
        action="store_true",
        help="also time the bare collectives on one flat vector of the parameters' size",
    )
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    opts = {
        "unsharded": build(False),
        "sharded (alltoall, the CPU default)": build(True, "alltoall"),
        "sharded (hvd reducescatter)": build(True, "reducescatter"),
    }
    params = opts["unsharded"].params
    numel = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in opts}
    sent: dict[str, int] = {}
    for _, opt in opts.items():
        outer_step_s(opt)  # warm-up (Horovod negotiates a new collective once)
    for i in range(args.repeats):
        # Rotate: load hits all alike
        order = list(opts)[i % len(opts) :] + list(opts)[: i % len(opts)]
        for name in order:
            b0 = opts[name].bytes_sent
            times[name].append(outer_step_s(opts[name]))
            sent[name] = opts[name].bytes_sent - b0
    micro = (
        collectives_ms(sum(p.numel() for p in opts["unsharded"].params), args.repeats)
        if args.micro
        else {}
    )
    states = {
        name: hvd.allgather_object(state_bytes(opt), name=f"bench.state.{i}")
        for i, (name, opt) in enumerate(opts.items())
    }
    if hvd.rank() != 0:
        return
    m = hvd.size()
    print(
        f"ResNet-18 (10 classes): {numel / 1e6:.2f}M parameters, "
        f"{param_bytes / 2**20:.1f} MiB; m={m} ranks "
        f"(Horovod {horovod.__version__}, {'Gloo' if hvd.gloo_enabled() else 'MPI'}); "
        f"torch {torch.__version__}, "
        f"1 thread per rank; {args.repeats} outer steps each, taking turns; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        "| variant | SlowMo state per rank (MiB, max over ranks) | x parameter bytes "
        "| outer step (ms, median) "
        "| min..max (ms) | of which communication (ms, median) | slow update (ms, median) "
        "| sent per outer step (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in opts:
        worst = max(states[name])
        total, comm, local = ([1e3 * t[j] for t in times[name]] for j in range(3))
        print(
            f"| {name} | {worst / 2**20:.2f} | {worst / param_bytes:.3f} "
            f"| {statistics.median(total):.1f} "
            f"| {min(total):.1f}..{max(total):.1f} | {statistics.median(comm):.1f} "
            f"| {statistics.median(local):.1f} "
            f"| {sent[name] / 2**20:.2f} |"
        )
    for name, ms in micro.items():
        print(f"bare {name} of the flat parameters: {ms:.1f} ms (median of the slowest rank)")
    print(
        f"expected state: unsharded 2.000x, sharded 2/m = {2 / m:.3f}x; "
        "bytes sent: 2(m-1)/m x parameters = "
        f"{2 * (m - 1) / m * param_bytes / 2**20:.2f} MiB for both"
    )


if __name__ == "__main__":
    main()
