"""Per-iteration communication time and bytes of SGP, OSGP, Local SGD and AR-SGD at one model size.

Run (4 workers; Gloo, or add --mpi for MPI neighbour collectives as the gossip transport)::

    horovodrun -np 4 -H localhost:4 --gloo python benchmarks/gossip_comm.py
    horovodrun -np 4 -H localhost:4 --mpi --mpi-args="--oversubscribe --allow-run-as-root" \\
        python benchmarks/gossip_comm.py

The model is ``--params`` float32 parameters (default 11.2M, ResNet-18's size) in a few flat
tensors; "compute" is a synthetic ``--compute-ms`` sleep per iteration standing in for
forward/backward (it releases the CPU, so Horovod's background thread and MPI can move
gossip meanwhile, as a GPU kernel would). Gradients are constant, so only communication and
the optimizer step cost anything.

Printed per method (rank 0; times are the slowest rank's mean over the timed iterations):
``comm ms/it`` = the time ``step()`` spends in base communication and exact averages,
``MB sent/it`` = payload bytes this worker handed to the transport per iteration,
``iter ms`` = wall time per iteration including the compute delay. The last line gives the
fraction of SGP's gossip time that OSGP hides behind compute: ``1 - comm(OSGP) / comm(SGP)``.
All methods run in the same processes, one after the other, so their numbers are comparable.
"""

import argparse
import statistics
import time

import horovod.torch as hvd
import torch

from hvd_slowmo import DistributedOptimizer

METHODS = {
    # name: (base, tau, extra options)
    "AR-SGD": ("allreduce", 1, {}),
    "Local SGD (tau=12)": ("localsgd", 12, {}),
    "SGP": ("sgp", 10**9, {}),
    "OSGP (staleness=1)": ("osgp", 10**9, {"staleness": 1}),
}


def make_params(total: int, pieces: int = 8) -> list[torch.nn.Parameter]:
    sizes = [total // pieces] * (pieces - 1) + [total - (total // pieces) * (pieces - 1)]
    return [torch.nn.Parameter(torch.full((n,), 0.01)) for n in sizes]


def run(
    method: str, params_total: int, iters: int, warmup: int, compute_ms: float
) -> dict[str, float]:
    base, tau, opts = METHODS[method]
    params = make_params(params_total)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = DistributedOptimizer(
        torch.optim.SGD(params, lr=0.1),
        named_parameters=[(f"w{i}", p) for i, p in enumerate(params)],
        base=base,
        tau=tau,
        slow_lr=1.0,
        slow_momentum=0.0,
        **opts,
    )
    comm_times, iter_times = [], []
    bytes0 = 0
    for k in range(warmup + iters):
        if k == warmup:
            hvd.allreduce(torch.zeros(1), name=f"sync.{method}")  # start the timed part together
            bytes0 = opt.bytes_sent
        t0 = time.perf_counter()
        before = opt.timings["base_comm"] + opt.timings["average"]
        time.sleep(compute_ms / 1000.0)  # forward/backward stand-in
        opt.step()
        if k >= warmup:
            comm_times.append(opt.timings["base_comm"] + opt.timings["average"] - before)
            iter_times.append(time.perf_counter() - t0)
    if hasattr(opt.base, "flush"):
        opt.base.flush()
    mine = {
        "comm_ms": 1000 * statistics.mean(comm_times),
        "iter_ms": 1000 * statistics.mean(iter_times),
        "mb_per_iter": (opt.bytes_sent - bytes0) / iters / 1e6,
        "transport": type(getattr(opt.base, "transport", None) or opt.comm).__name__,
    }
    everyone = hvd.allgather_object(mine)
    return {
        "comm_ms": max(e["comm_ms"] for e in everyone),
        "iter_ms": max(e["iter_ms"] for e in everyone),
        "mb_per_iter": max(e["mb_per_iter"] for e in everyone),
        "transport": mine["transport"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--params", type=float, default=11.2e6, help="model size in float32 parameters"
    )
    parser.add_argument(
        "--iters", type=int, default=24, help="timed iterations per method (a multiple of 12)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first")
    parser.add_argument(
        "--compute-ms", type=float, default=100.0, help="synthetic compute per iteration"
    )
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    rows = {
        name: run(name, int(args.params), args.iters, args.warmup, args.compute_ms)
        for name in METHODS
    }
    if hvd.rank() == 0:
        launch = "MPI" if hvd.mpi_enabled() else "Gloo"
        print(
            f"{hvd.size()} workers ({launch} launch), {args.params / 1e6:.1f}M float32 params "
            f"({args.params * 4 / 1e6:.1f} MB), {args.compute_ms:.0f} ms synthetic compute, "
            f"{args.iters} timed iterations; slowest rank's means"
        )
        print(f"{'method':<22}{'transport':<24}{'comm ms/it':>12}{'MB sent/it':>12}{'iter ms':>10}")
        for name, r in rows.items():
            print(
                f"{name:<22}{r['transport']:<24}{r['comm_ms']:>12.1f}{r['mb_per_iter']:>12.2f}{r['iter_ms']:>10.1f}"
            )
        sgp, osgp = rows["SGP"]["comm_ms"], rows["OSGP (staleness=1)"]["comm_ms"]
        print(
            f"OSGP hides {100 * (1 - osgp / sgp):.0f}% of SGP's gossip time behind compute "
            f"(exposed: {osgp:.1f} vs {sgp:.1f} ms/it)"
        )


if __name__ == "__main__":
    main()
