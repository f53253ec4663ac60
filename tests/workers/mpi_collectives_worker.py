"""The MPI communicator's collectives under ``mpirun -np N`` (tests/test_async_start.py and
tests/test_deadline.py). Modes:

* ``check OUT``: every collective against its blocking MPI form computed here in the same run
  (bitwise), and a start that returns while rank 1 has not arrived; rank r writes OUT/rank{r}.json.
* ``train OUT``: AR-SGD and a compressed, overlapped, per-fragment SlowMo over MPI: the ranks
  end with bitwise equal parameters, and at -np 2 equal to two thread workers in rank 0's process.
* ``deadline OUT KIND``: rank 1 sleeps past rank 0's deadline before the collective KIND
  (``average``, ``alltoall``, ``allgather_object``); rank 0 must raise ``CollectiveTimeout``,
  write its message to OUT/rank0.txt and abort the job.
"""

import json
import os
import sys
import time

import torch
from mpi4py import MPI

from hvd_slowmo.comm.deadline import CollectiveTimeout
from hvd_slowmo.comm.mpi import MPICommunicator


def blocking_average(comm, t):
    """The average as the communicator computed it before its starts became non-blocking."""
    host = t.clone().contiguous()
    buf = host.view(-1).numpy()
    root = comm.Get_rank() == 0
    comm.Reduce(MPI.IN_PLACE if root else buf, buf if root else None, op=MPI.SUM, root=0)
    comm.Bcast(buf, root=0)
    return host.div_(comm.Get_size())


def check(out):
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = MPICommunicator(timeout=60)
    report = {}
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(n, generator=g) for n in (1, 7, 1000, 100_003)]
    tensors.append(torch.randn(33, generator=g, dtype=torch.float64))
    want = [blocking_average(world, t) for t in tensors]
    got = [t.clone() for t in tensors]
    pending = comm.average_start(got, "check")
    pending.wait()
    report["average_bitwise"] = all(torch.equal(a, b) for a, b in zip(got, want))
    report["average_bits"] = [t.view(-1)[:3].tolist() for t in got]
    report["allgather_object"] = comm.allgather_object({"rank": rank})
    report["broadcast_object"] = comm.broadcast_object(f"from {rank}", root_rank=size - 1)
    shards = [torch.arange(rank + 1, dtype=torch.float32) + 10 * rank, torch.tensor([rank])]
    report["allgather_flat"] = [t.tolist() for t in comm.allgather_flat(shards, "ag")]
    sends = [torch.full((dst + 1,), 100.0 * rank + dst) for dst in range(size)]
    got_a2a = comm.alltoall_flat(sends, [rank + 1] * size, "a2a")
    report["alltoall_flat"] = [t.tolist() for t in got_a2a]

    # A start returns before the other ranks arrive: rank 1 starts 1.5 s after the others.
    world.Barrier()
    if rank == 1:
        time.sleep(1.5)
    t = torch.full((4,), float(rank))
    began = time.monotonic()
    pending = comm.average_start([t], "late")
    report["start_seconds"] = time.monotonic() - began
    pending.wait()
    report["late_average"] = t.tolist()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


CONFIGS = {
    # AR-SGD: the gradient hooks start the averages during backward.
    "allreduce": {"base": "allreduce", "tau": 2},
    # Compressed, overlapped, per-fragment averages: an all-to-all, then an all-gather that a
    # poll starts when it sees the all-to-all done (at different moments on different ranks).
    "int8-fragments": {
        "base": "localsgd",
        "tau": 4,
        "fragments": 2,
        "overlap": 1,
        "compression": "int8",
        "error_feedback": True,
    },
}


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from reference import loss_at, make_model  # noqa: E402  (tests/ on the path first)


def _train(comm, config, model, steps=9):
    import warnings

    from hvd_slowmo import DistributedOptimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(),
            communicator=comm,
            **CONFIGS[config],
        )
        for k in range(steps):
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
        if hasattr(opt, "flush"):
            opt.flush()
    return [p.detach().clone() for p in model.parameters()]


def train(out):
    """Each configuration over MPI, against the same training on two thread workers run in
    rank 0's process (at -np 2 every sum has two terms, so the bits must agree)."""
    from hvd_slowmo.comm.local import run_threads

    world = MPI.COMM_WORLD
    comm = MPICommunicator(timeout=120)
    report = {}
    for config in CONFIGS:
        mine = _train(comm, config, make_model())
        everyone = comm.allgather_object(mine)
        if config == "allreduce":  # AR-SGD keeps the parameters equal after every step
            report[f"{config}-ranks-equal"] = all(
                all(torch.equal(a, b) for a, b in zip(theirs, everyone[0])) for theirs in everyone
            )
        if world.Get_rank() == 0 and world.Get_size() == 2:
            models = [make_model() for _ in range(2)]  # torch.manual_seed: not in the threads
            threads = run_threads(
                2, lambda c, config=config, models=models: _train(c, config, models[c.rank])
            )
            report[f"{config}-equals-threads"] = all(
                torch.equal(a, b) for a, b in zip(mine, threads[0])
            )
    with open(os.path.join(out, f"rank{world.Get_rank()}.json"), "w") as f:
        json.dump(report, f)


def deadline(out, kind):
    """Rank 1 freezes (sleeps 60 s) before the collective ``kind``; the deadline comes from
    HVD_SLOWMO_COLLECTIVE_TIMEOUT, set by the test."""
    world = MPI.COMM_WORLD
    comm = MPICommunicator()
    comm.average_([torch.ones(3)], "warm-up")  # both ranks are up: the deadline is all that ends
    if comm.rank == 1:
        time.sleep(60)
    began = time.monotonic()
    try:
        if kind == "average":
            comm.average_([torch.ones(3)], "frozen")
        elif kind == "alltoall":
            comm.alltoall_flat([torch.ones(2), torch.ones(2)], [2, 2], "frozen")
        else:
            comm.allgather_object("frozen")
    except CollectiveTimeout as e:
        with open(os.path.join(out, "rank0.txt"), "w") as f:
            f.write(f"{time.monotonic() - began:.2f}\n{e}\n")
        world.Abort(3)  # the recipe of docs/timeouts.md: end every rank of the job
    raise SystemExit(f"rank 0: {kind} completed although rank 1 never started it")


if __name__ == "__main__":
    if sys.argv[1] == "check":
        check(sys.argv[2])
    elif sys.argv[1] == "train":
        train(sys.argv[2])
    else:
        deadline(sys.argv[2], sys.argv[3])
