"""Gossip checks under horovodrun (one launch runs them all); each rank writes ``OUT/rank{r}.json``.

Launched by tests/test_gossip_horovod.py::

    horovodrun -np 4 --gloo python tests/workers/gossip_worker.py OUT
    horovodrun -np 4 --mpi  python tests/workers/gossip_worker.py OUT

Checks (JSON keys): ``transports`` (what ``gossip_transport="auto"`` chose), per transport the
max error of SGP and D-PSGD against the in-process matrix reference and the SGP trajectory,
``mpi_equals_horovod`` (MPI launches: both transports give bitwise the same trajectory),
``osgp_mass`` (OSGP with zero gradients conserves mass and weight), ``slowmo_identical``
(SlowMo over SGP/OSGP with average=True: all ranks bitwise identical after every outer step).
"""

import json
import os
import sys

import torch

# Tests/: the reference
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import horovod.torch as hvd

from hvd_slowmo import DistributedOptimizer

from reference_gossip import LR, centre, curvature, initial, reference

STEPS = 6


def quadratic_run(base: str, transport: str, zero_grad: bool = False, **options):
    """Train the test quadratic; returns (per-step params, optimizer)."""
    rank = hvd.rank()
    p = torch.nn.Parameter(initial(rank).clone())
    opt = DistributedOptimizer(
        torch.optim.SGD([p], lr=LR),
        named_parameters=[("p", p)],
        base=base,
        tau=1000,
        slow_lr=1.0,
        slow_momentum=0.0,
        gossip_transport=transport,
        **options,
    )
    snaps = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = 0.5 * curvature(rank) * ((p - centre(rank)) ** 2).sum()
        (loss * 0 if zero_grad else loss).backward()
        opt.step()
        snaps.append(p.detach().clone())
    return snaps, opt


def max_error(snaps, ref) -> float:
    return max((s - z[:, hvd.rank()]).abs().max().item() for s, (z, _, _) in zip(snaps, ref))


def main(out_dir: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    m, rank = hvd.size(), hvd.rank()
    result = {"rank": rank, "size": m, "mpi": hvd.mpi_enabled(), "transports": {}}
    transports = ["horovod", "mpi"] if hvd.mpi_enabled() else ["horovod"]
    trajectories = {}
    for transport in transports:
        snaps, opt = quadratic_run("sgp", transport)
        result[f"sgp_error_{transport}"] = max_error(snaps, reference(m, STEPS))
        trajectories[transport] = snaps
        result["transports"][transport] = type(opt.base.transport).__name__
        result[f"sgp_bytes_{transport}"] = opt.comm.bytes_sent
        snaps, _ = quadratic_run("dpsgd", transport, topology="ring")
        result[f"dpsgd_error_{transport}"] = max_error(
            snaps, reference(m, STEPS, topology="ring", undirected=True)
        )
    _, auto = quadratic_run("sgp", "auto")
    result["transports"]["auto"] = type(auto.base.transport).__name__
    if len(transports) == 2:
        result["mpi_equals_horovod"] = all(
            torch.equal(a, b) for a, b in zip(*trajectories.values())
        )

    # OSGP: messages in flight across steps, weights move; after a flush no mass is lost.
    snaps, opt = quadratic_run("osgp", "auto", zero_grad=True, staleness=2)
    opt.base.flush()
    x, w = opt.base.params[0].detach() * opt.base.ps_weight, opt.base.ps_weight
    everyone = hvd.allgather_object((x, w))
    total = sum(initial(i) for i in range(m))
    result["osgp_mass_error"] = (sum(t for t, _ in everyone) - total).abs().max().item()
    result["osgp_weight_error"] = abs(sum(v for _, v in everyone) - m)

    # SlowMo over SGP / OSGP on a small float32 MLP with rank-dependent data.
    identical = {}
    for base, opts in (("sgp", {}), ("osgp", {"staleness": 1})):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            named_parameters=model.named_parameters(),
            base=base,
            tau=3,
            slow_lr=1.0,
            slow_momentum=0.5,
            **opts,
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        g = torch.Generator().manual_seed(rank)
        ok = []
        for k in range(9):
            xb = torch.randn(16, 3, generator=g) + rank
            opt.zero_grad()
            ((model(xb) - xb.sum(1, keepdim=True)) ** 2).mean().backward()
            opt.step()
            if (k + 1) % 3 == 0:
                flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
                ok.append(all(torch.equal(flat, other) for other in hvd.allgather_object(flat)))
        identical[base] = ok
    result["slowmo_identical"] = identical
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
