"""Time per iteration of SlowMo between islands against plain FSDP, on an emulated cluster of 2
hosts x 2 processes (a host is an island; docs/islands.md, docs/network.md).

Builds 2 emulated hosts (``slowmo_lab.netns``: one network namespace each, links shaped with
``tc tbf``), starts one ``torchrun --nnodes 2 --nproc-per-node 2`` per host inside its namespace
(static rendezvous at host 0's address), and measures in the same 4 processes, the variants
taking turns ``--repeats`` times, a synthetic model (``--layers`` x ``Linear(width, width)`` +
tanh, AdamW, fixed random batches):

  - ``fsdp-4``: FSDP2 over all 4 ranks (every step all-gathers and reduce-scatters across hosts);
  - ``hsdp``: FSDP2's HSDP, 2 replicas (hosts) x 2 shards (every step all-reduces gradients
    across hosts);
  - ``island``: FSDP2 inside each host only, no exchange between hosts: FSDP's own step, the
    limit the islands approach;
  - ``islands-slowmo``: the same inside, with ``worker=hvd_slowmo.Islands(mesh)``: Local AdamW
    and SlowMo's outer step between the hosts every ``--tau`` steps (timed over whole outer
    periods).

Prints ms/iteration (the slowest rank's mean), each row over ``island``'s (FSDP's own step),
the outer step's cost per outer step (``tau`` x the difference from ``island``), and the 1-minute
load average before and after each rate. Writes the numbers to ``OUT/islands_speed.json``.

Needs root and ``ip netns``. Example::

    sudo .venv/bin/python benchmarks/islands_speed.py --rate 100mbit --rate 10mbit \\
        --width 512 --layers 8 --tau 32 --iters 8 --periods 1 --repeats 2 --out runs/islands

Only ratios measured within one run mean anything: every host shares this machine's cores.
"""

import argparse
import gc
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("fsdp-4", "hsdp", "island", "islands-slowmo")
PER_HOST = 2


# --- the workers (under torchrun, inside the namespaces) ------------------------------------------
def _build(variant: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and optimizer of one variant (every rank builds the same initial model)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hvd_slowmo

    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    if variant == "fsdp-4":
        mesh = init_device_mesh("cpu", (4,))
    elif variant == "hsdp":
        mesh = init_device_mesh("cpu", (2, PER_HOST), mesh_dim_names=("replicate", "shard"))
    else:  # an island per host: rows of the mesh are the hosts (ranks 0, 1 and 2, 3)
        islands_mesh = init_device_mesh("cpu", (2, PER_HOST), mesh_dim_names=("islands", "shard"))
        mesh = islands_mesh["shard"]
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if variant != "islands-slowmo":
        return model, base
    opt = hvd_slowmo.DistributedOptimizer(
        base,
        named_parameters=model.named_parameters(),
        worker=hvd_slowmo.Islands(islands_mesh),
        base="localsgd",
        tau=args.tau,
        slow_momentum=0.5,
    )
    return model, opt


def _time(variant: str, args: argparse.Namespace) -> float:
    """Mean ms per iteration of this rank, after a warm-up (for the islands: one whole outer
    period, then ``--periods`` periods; else ``--iters`` steps after 2)."""
    import torch
    import torch.distributed as dist

    model, opt = _build(variant, args)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch_size, args.width, generator=g)
    y = torch.randn(args.batch_size, args.width, generator=g)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    slowmo = variant == "islands-slowmo"
    warmup, iters = (args.tau, args.tau * args.periods) if slowmo else (2, args.iters)
    for _ in range(warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    dist.barrier()  # the slowest rank sets the pace: what the job sees
    return 1000.0 * (time.perf_counter() - t0) / iters


def worker(args: argparse.Namespace) -> None:
    """One rank: time every variant ``--repeats`` times in turn; rank 0 writes the medians."""
    import statistics

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2 * PER_HOST:
        raise ValueError(f"islands_speed needs 2 hosts x {PER_HOST} ranks")
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            times[v].append(_time(v, args))
            gc.collect()  # the variant's model and optimizer go before the next is built
    out = {v: statistics.median(ts) for v, ts in times.items()}
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"ms_per_iter": out, "all": times}, f)
    dist.destroy_process_group()


# --- the driver (root) ----------------------------------------------------------------------------
def _table(rate: str, ms: dict[str, float], tau: int, load: tuple[float, float]) -> str:
    own = ms["island"]
    lines = [
        f"### {rate} links (1-minute load average {load[0]:.2f} before, {load[1]:.2f} after)",
        "",
        "| variant | ms / iteration | x FSDP's own step (island) |",
        "|---|---|---|",
    ]
    lines += [f"| {v} | {ms[v]:.1f} | {ms[v] / own:.3f} |" for v in VARIANTS]
    outer = tau * (ms["islands-slowmo"] - own)
    lines += [
        "",
        f"Outer step (islands-slowmo, tau={tau}): {outer:.0f} ms per outer step, "
        f"{outer / own:.2f} of FSDP's own steps; per iteration "
        f"{ms['islands-slowmo'] / own:.3f}x FSDP's own step, against {ms['fsdp-4'] / own:.3f}x "
        f"for FSDP over both hosts and {ms['hsdp'] / own:.3f}x for HSDP.",
        "",
    ]
    return "\n".join(lines)


def _run_rate(cluster: Any, rate: str, args: argparse.Namespace, port: int) -> dict[str, Any]:
    """Shape the links to ``rate``, run the workers once, and return their medians."""
    cluster.shape(rate)
    result = os.path.abspath(os.path.join(args.out, f"raw_{rate}.json"))
    if os.path.exists(result):
        os.remove(result)
    me = os.path.abspath(__file__)
    flags = ["--width", args.width, "--layers", args.layers, "--batch-size", args.batch_size]
    flags += ["--tau", args.tau, "--iters", args.iters, "--periods", args.periods]
    flags += ["--repeats", args.repeats, "--worker-out", result]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # One torchrun per host; its node rank is the host's (worker_env sets HOROVOD_RANK).
    line = shlex.join(
        [torchrun, "--nnodes", "2", "--nproc-per-node", str(PER_HOST), "--master-port", str(port)]
    )
    line += ' --node-rank "$HOROVOD_RANK" --master-addr "$MASTER_ADDR" '
    line += shlex.join([me, "--worker", *map(str, flags)])
    load_before = os.getloadavg()[0]
    print(f"== {rate}: 2 hosts x {PER_HOST} ranks (load {load_before:.2f})", flush=True)
    cluster.start_workers(["sh", "-c", line], port=0, nice=args.nice)
    cluster.wait_workers(args.timeout)
    load_after = os.getloadavg()[0]
    with open(result) as f:
        measured = json.load(f)
    return {"rate": rate, "load_avg_1min": [load_before, load_after], **measured}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments; as ``--worker`` time the variants, else build the cluster and drive.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", action="append", default=None, help="link rate (repeatable)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--tau", type=int, default=32)
    p.add_argument("--iters", type=int, default=8, help="timed steps of the per-step variants")
    p.add_argument("--periods", type=int, default=1, help="timed outer periods of the islands")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per rate")
    p.add_argument("--nice", type=int, default=0)
    p.add_argument("--port", type=int, default=29641, help="torchrun's rendezvous port")
    p.add_argument("--prefix", default="hsmi", help="namespace prefix (slowmo_lab.netns)")
    p.add_argument("--subnet", default="10.79.0")
    p.add_argument("--out", default="runs/islands_speed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("width", "layers", "batch_size", "tau", "iters", "periods", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.worker:
        worker(args)
        return 0
    from slowmo_lab.netns import Cluster, missing_requirements, plan_cluster

    if why := missing_requirements():
        print(f"islands_speed.py: {why}", file=sys.stderr)
        return 2
    rates = args.rate or ["100mbit", "10mbit"]
    os.makedirs(args.out, exist_ok=True)
    cluster = Cluster(plan_cluster(2, prefix=args.prefix, subnet=args.subnet))
    old: dict[int, Callable[..., Any] | int | None] = {}

    def _terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # the finally-block tears the cluster down

    for s in (signal.SIGTERM, signal.SIGHUP):
        old[s] = signal.signal(s, _terminate)
    runs = []
    try:
        if stale := cluster.clean_stale():
            print(f"removed leftovers of an earlier run: {stale}", flush=True)
        cluster.build(rates[0])
        for rate in rates:
            run = _run_rate(cluster, rate, args, args.port)
            runs.append(run)
            print(_table(rate, run["ms_per_iter"], args.tau, run["load_avg_1min"]), flush=True)
    finally:
        cluster.teardown()
        for s, h in old.items():
            signal.signal(s, h)
    settings = {k: v for k, v in vars(args).items() if not k.startswith("worker")}
    with open(os.path.join(args.out, "islands_speed.json"), "w") as f:
        json.dump({"settings": settings, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
