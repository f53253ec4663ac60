"""Goodput of the fast hosts when one host is slow or pauses: count-based outer periods (``tau``
steps everywhere) against time-based ones (``period_seconds``), with and without the merge
weighted by the samples, and count-based periods under a straggler quorum (SlowMo, arXiv
1910.00643; issue 37).

``--hosts`` processes on this machine, one per emulated host, over ``torch.distributed`` (Gloo,
localhost). A base step's compute is a sleep of ``--compute-ms`` (no CPU used, so co-located
hosts do not contend for cores); the last host is the unequal one:

* ``slow``: its steps take ``--slow-factor`` times as long (a slower GPU, a throttled node);
* ``pause``: at outer step ``--pause-at`` it stops for ``--pause-periods`` periods (a stalled
  data loader, a preempted VM), then goes on at full speed.

For each scenario and mode the table shows the fast hosts' **utilization**: the seconds they
spent computing over the wall-clock seconds of the run (the compute-only speed is 100%), and
each host's base steps. Count-based periods run at the slowest host's pace; time-based periods
let each host take the steps that fit (the weights cost nothing in time: they change what the
average is, not when). Under time-based periods ``tau`` is only the first period's count, taken
at the slowest host's pace before any step time is known: these modes use ``--first-steps``
(3) for it, the count-based ones ``--tau``. A pause stalls every mode but ``quorum`` for as long
as it lasts: the outer step waits for every worker. ``quorum``
(``straggler=Quorum(hosts - 1)``, adaptive grace
between 10% of a period and a period) closes the outer step without the late host and
resynchronizes it (docs/unequal-workers.md); its work since its last outer step is dropped, so
the steps column of a slowed host counts steps whose work may not have reached the average.

Check it runs (tiny)::

    python benchmarks/goodput.py --hosts 2 --compute-ms 5 --tau 4 --outer 4

The measurement of issue 37 (4 hosts, one 2x slower, then one paused for 3 outer periods), on
a quiet machine::

    python benchmarks/goodput.py --hosts 4 --compute-ms 100 --tau 12 --outer 12 \\
        --slow-factor 2 --pause-at 4 --pause-periods 3 --params 1000000 --json runs/goodput.json
"""

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hvd_slowmo

#: The modes compared: name -> DistributedOptimizer options (period_seconds filled in per run).
MODES = {
    "count": {},
    "time": {"period_seconds": True},
    "time+weighted": {"period_seconds": True, "merge": "samples"},
    "quorum": {"straggler": True},
    "time+quorum": {"period_seconds": True, "straggler": True},
}
SCENARIOS = ("slow", "pause")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, size: int, port: int, spec: dict[str, Any], results: Any) -> None:
    """One host: train until ``spec["outer"]`` outer steps; put its numbers in ``results``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    torch.manual_seed(0)
    model = nn.Linear(spec["params"], 1, bias=False)
    compute = spec["compute_ms"] / 1e3
    period = spec["tau"] * compute  # what one count-based period takes a fast host
    options = dict(MODES[spec["mode"]])
    tau = spec["tau"]
    if options.pop("period_seconds", False):
        options["period_seconds"] = period
        tau = spec["first_steps"]  # only the first period counts steps, at everyone's pace
    if options.pop("straggler", False):
        options["straggler"] = hvd_slowmo.Quorum(size - 1, min_grace=0.1 * period, max_grace=period)
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        tau=tau,
        engine="torch",
        **options,
    )
    unequal = rank == size - 1
    mine = compute * (spec["slow_factor"] if unequal and spec["scenario"] == "slow" else 1.0)
    x = torch.ones(1, spec["params"])
    paused, busy = False, 0.0
    dist.barrier()
    began = time.monotonic()
    while opt.outer_steps < spec["outer"]:
        if unequal and spec["scenario"] == "pause" and not paused:
            if opt.outer_steps == spec["pause_at"]:
                time.sleep(spec["pause_periods"] * period)
                paused = True
        time.sleep(mine)  # the step's compute
        busy += mine
        opt.zero_grad()
        model(x).sum().backward()
        opt.step(samples=spec["batch"])
    wall = time.monotonic() - began
    opt.finish()  # after the clock: a quorum's late host catches up here
    results.put({"rank": rank, "busy": busy, "wall": wall, "steps": opt.num_steps})
    dist.destroy_process_group()


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One run of ``spec["hosts"]`` processes; each host's numbers, in rank order."""
    size = spec["hosts"]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_worker, args=(r, size, spec["port"], spec, results))
        for r in range(size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=spec["timeout"])
    if any(p.exitcode != 0 for p in procs):
        for p in procs:
            p.kill()
        raise RuntimeError(f"goodput: a host failed ({[p.exitcode for p in procs]})")
    out = [results.get() for _ in procs]
    return sorted(out, key=lambda r: r["rank"])


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: scenario, mode, fast hosts' utilization, each host's steps, wall."""
    lines = [
        "| scenario | mode | fast hosts' utilization | steps per host | wall s |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        hosts = row["hosts"]
        fast = hosts[:-1]
        util = sum(h["busy"] / h["wall"] for h in fast) / len(fast)
        steps = ", ".join(str(h["steps"]) for h in hosts)
        wall = max(h["wall"] for h in hosts)
        lines.append(f"| {row['scenario']} | {row['mode']} | {util:.0%} | {steps} | {wall:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--compute-ms", type=float, default=100.0, help="one base step's compute")
    parser.add_argument("--tau", type=int, default=12, help="steps per count-based period")
    parser.add_argument("--outer", type=int, default=12, help="outer steps per run")
    parser.add_argument(
        "--first-steps", type=int, default=3,
        help="time-based modes: the first period's steps (tau), before any step time is known",
    )  # fmt: skip
    parser.add_argument("--params", type=int, default=100_000, help="the model's parameters")
    parser.add_argument("--batch", type=int, default=32, help="samples reported per step")
    parser.add_argument("--slow-factor", type=float, default=2.0, help="the slow host's slowdown")
    parser.add_argument("--pause-at", type=int, default=4, help="outer step the pause starts at")
    parser.add_argument("--pause-periods", type=float, default=3.0, help="the pause's periods")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", help="write the raw numbers here")
    args = parser.parse_args(argv)
    if args.hosts < 2:
        parser.error("--hosts must be at least 2 (one unequal host and the fast ones)")
    rows = []
    for scenario in args.scenarios.split(","):
        for mode in args.modes.split(","):
            spec = {
                "hosts": args.hosts, "compute_ms": args.compute_ms, "tau": args.tau,
                "outer": args.outer, "first_steps": args.first_steps, "params": args.params,
                "batch": args.batch,
                "slow_factor": args.slow_factor, "pause_at": args.pause_at,
                "pause_periods": args.pause_periods, "scenario": scenario, "mode": mode,
                "timeout": args.timeout, "port": _free_port(),
            }  # fmt: skip
            rows.append({"scenario": scenario, "mode": mode, "hosts": run(spec)})
    print(table(rows))
    print(
        f"load: {os.getloadavg()[0]:.2f} (1 min); hosts={args.hosts}, compute={args.compute_ms} ms"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
