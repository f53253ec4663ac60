"""Worker for tests/test_torchdist.py, run under torchrun (torch.distributed over Gloo).

The checks of the Horovod workers (core_worker, overlap_worker, sharded_worker, gossip_worker,
hierarchy_worker) on the torch.distributed engine, chosen automatically (no Horovod here).

Usage: torchdist_worker.py OUT_DIR MODE [ARG]
  MODE=train:    core, overlap, sharded and gossip runs; per rank OUT_DIR/train.RANK.pt.
  MODE=core:     the core runs alone (as tests/workers/core_worker.py's).
  MODE=save:     the checkpointed runs uninterrupted; then, fresh, ARG steps of each (overlap: an
                 average in flight) and save.  MODE=resume: load and finish them.
  MODE=node:     worker="node" for every case of tests/test_hierarchy.py.
  MODE=comm:     the communicator's collectives on rank-dependent tensors, the configuration
                 mismatch error (rank 1's tau differs), AMP overflows on rank 1.
  MODE=core-sgd: the "sgd-reset" run alone, and where hvd_slowmo was imported from.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import hvd_slowmo
from hvd_slowmo.comm.torchdist import FP16, TorchDistCommunicator, broadcast_parameters

from helpers import end_process, state_tensors_of
from reference import batch, loss_at, lr_at, make_model, params_of

CORE = {  # as tests/workers/core_worker.py (the transport-equality test compares the two)
    "sgd-reset": dict(opt="sgd", tau=3, slow_lr=0.7, slow_momentum=0.6, buffers="reset"),
    "adam-average": dict(opt="adam", tau=2, slow_lr=1.0, slow_momentum=0.5, buffers="average"),
    "allreduce": dict(
        opt="sgd", base="allreduce", tau=1, slow_lr=1.0, slow_momentum=0.0, buffers="maintain"
    ),
    "sgd-fp16": dict(opt="sgd", tau=3, slow_lr=1.0, slow_momentum=0.5, buffers="reset", fp16=True),
}
OVERLAP = {  # as tests/workers/overlap_worker.py
    "localsgd-d1": dict(tau=3, overlap=1, slow_lr=0.7, slow_momentum=0.6),
    "localsgd-d2-maintain": dict(tau=4, overlap=2, slow_momentum=0.5, buffers="maintain"),
    "sgp-d1": dict(base="sgp", tau=3, overlap=1, slow_momentum=0.6),
}
GOSSIP = {  # every gossip base, with SlowMo's exact average every 3 steps
    "sgp": dict(base="sgp"),
    "osgp": dict(base="osgp", staleness=1),
    "dpsgd": dict(base="dpsgd", topology="ring"),
}
AMP = {  # as tests/workers/amp_worker.py: overflows on rank 1 at iterations AMP_SKIPPED
    "localsgd": dict(base="localsgd", tau=3, slow_momentum=0.6),
    "allreduce": dict(base="allreduce", tau=3, slow_momentum=0.6),
    "sgp": dict(base="sgp", tau=3, slow_momentum=0.6),
}
AMP_STEPS, AMP_SKIPPED = 11, {1, 5}
CORE_STEPS, OVERLAP_STEPS, SHARD_STEPS = 9, 11, 9


def build(cfg, model=None):
    cfg = dict(cfg)
    model = model or make_model()
    broadcast_parameters(model.state_dict(), root_rank=0)
    kind = cfg.pop("opt", "sgd")
    base_opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        if kind == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    opt = hvd_slowmo.DistributedOptimizer(
        base_opt,
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        compression=FP16 if cfg.pop("fp16", False) else None,
        **cfg,
    )
    return model, opt


def train(model, opt, start, stop, snaps=None, anchors=None):
    """Steps ``start..stop-1``; ``snaps`` gets the params after every outer step, ``anchors``
    the averaged snapshot of every overlapped outer step when it lands."""
    for k in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        pending = opt.outer.in_flight
        opt.zero_grad()
        loss_at(model, dist.get_rank(), k).backward()
        opt.step()
        if snaps is not None and opt.inner_step == 0:
            snaps.append(params_of(model))
        if anchors is not None and pending is not None and opt.outer.in_flight is None:
            anchors.append([t.clone() for t in pending.sent])


def sharded_run(shard):
    """tests/workers/sharded_worker.py's run: three param groups, one of 2 elements."""
    model = make_model()
    broadcast_parameters(model.state_dict(), root_rank=0)
    extra = torch.nn.Parameter(torch.ones(2))
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    base = torch.optim.SGD(
        [{"params": first}, {"params": rest}, {"params": [extra]}], lr=0.05, momentum=0.9
    )
    opt = hvd_slowmo.DistributedOptimizer(
        base,
        named_parameters=[*model.named_parameters(), ("extra", extra)],
        model_buffers=model.buffers(),
        tau=3,
        buffers="maintain",
        slow_lr=0.7,
        slow_momentum=0.6,
        shard_slow_state=shard,
    )
    rank, snaps = dist.get_rank(), []
    for k in range(SHARD_STEPS):
        opt.param_groups[0]["lr"] = lr_at(k)
        opt.param_groups[1]["lr"] = opt.param_groups[2]["lr"] = lr_at(k) / 2
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        extra.grad = torch.tensor([0.1, -0.2]) * (rank + 1) * (k + 1)
        opt.step()
        if opt.inner_step == 0:
            snaps.append(params_of(model) + [extra.detach().clone()])
    kept = state_tensors_of(opt)
    return {"snaps": snaps, "state_bytes": sum(t.numel() * t.element_size() for t in kept)}


def gossip_checks():
    """Matrix-reference errors of SGP/D-PSGD on the test quadratic, OSGP's conserved mass, and
    SlowMo over every gossip base."""
    from reference_gossip import LR, centre, curvature, initial, reference

    rank, m = dist.get_rank(), dist.get_world_size()
    out = {}
    for base, opts, ref in (
        ("sgp", {}, reference(m, 6)),
        ("dpsgd", {"topology": "ring"}, reference(m, 6, topology="ring", undirected=True)),
        ("osgp", {"staleness": 2}, None),
    ):
        p = torch.nn.Parameter(initial(rank).clone())
        opt = hvd_slowmo.DistributedOptimizer(
            torch.optim.SGD([p], lr=LR),
            named_parameters=[("p", p)],
            base=base,
            tau=1000,
            slow_lr=1.0,
            slow_momentum=0.0,
            **opts,
        )
        err = 0.0
        for k in range(6):
            opt.zero_grad()
            loss = 0.5 * curvature(rank) * ((p - centre(rank)) ** 2).sum()
            (loss * (ref is not None)).backward()  # OSGP: zero gradients, mass is conserved
            opt.step()
            if ref is not None:
                err = max(err, (p.detach() - ref[k][0][:, rank]).abs().max().item())
        if ref is None:
            opt.base.flush()
            mass = opt.comm.allgather_object((p.detach() * opt.base.ps_weight, opt.base.ps_weight))
            out["osgp_mass_error"] = (
                (sum(x for x, _ in mass) - sum(initial(i) for i in range(m))).abs().max().item()
            )
            out["osgp_weight_error"] = abs(sum(w for _, w in mass) - m)
        else:
            out[f"{base}_error"] = err
            out[f"{base}_transport"] = type(opt.base.transport).__name__
    for name, opts in GOSSIP.items():
        model, opt = build(dict(tau=3, slow_lr=1.0, slow_momentum=0.5, **opts))
        snaps = []
        train(model, opt, 0, 9, snaps)
        out[f"slowmo_{name}"] = snaps
    return out


def core_runs(result):
    for name, cfg in CORE.items():
        model, opt = build(cfg)
        snaps = []
        train(model, opt, 0, CORE_STEPS, snaps)
        result[name] = {"snaps": snaps, "final": model.state_dict(), "bytes": opt.bytes_sent}
        result[name]["comm"] = type(opt.comm).__name__


def checkpoint_runs(mode, stop, out, rank, result):
    """``save``: the uninterrupted run, then a fresh one saved after ``stop`` steps (one launch
    for both); ``resume``: finish the saved one."""
    for name, cfg, steps in (
        ("sgd-reset", CORE["sgd-reset"], CORE_STEPS),
        ("localsgd-d2-maintain", OVERLAP["localsgd-d2-maintain"], OVERLAP_STEPS),
    ):
        ckpt = os.path.join(out, f"ckpt.{name}.{rank}.pt")
        model, opt = build(cfg)
        if mode == "save":
            train(model, opt, 0, steps)
            result[name] = model.state_dict()
            # A separate run saves: saving must not be what makes the resumed run match.
            model, opt = build(cfg)
            train(model, opt, 0, stop)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, ckpt)
            continue
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        train(model, opt, stop, steps)
        result[name] = model.state_dict()


def node_runs(rank, result):
    """worker="node" for every case of tests/test_hierarchy.py."""
    from hierarchy_cases import CASES, loss, mlp

    for case, kwargs in CASES.items():
        model = mlp()
        broadcast_parameters(model.state_dict())
        opt = hvd_slowmo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
            named_parameters=model.named_parameters(),
            worker="node",
            **kwargs,
        )
        steps = []
        for k in range(7):
            opt.zero_grad()
            loss(model, *batch(rank, k)).backward()
            opt.step()
            steps.append(params_of(model))
        result[case] = {
            "steps": steps,
            "node_gather": opt.node_comm.allgather_object(rank),
            "cross_gather": opt.base.comm.allgather_object(rank),
        }


def mismatch_error(rank):
    """The message of the configuration check when rank 1's tau differs."""
    model = make_model()
    try:
        hvd_slowmo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            tau=3 + (rank == 1),
        )
    except ValueError as e:
        return str(e)
    return "no error"


def amp_runs(rank):
    """tests/workers/amp_worker.py's runs: overflows on rank 1, three recipes per base."""
    import warnings

    import amp_run

    warnings.simplefilter("ignore")  # GradScaler on CPU
    out = {}
    for case, kwargs in AMP.items():
        for recipe in ("reference", "scaler", "horovod"):
            model = amp_run.mlp()
            broadcast_parameters(model.state_dict())
            out[(case, recipe)] = amp_run.run(
                model, recipe, AMP_SKIPPED, 1, AMP_STEPS, rank, **kwargs
            )
    return out


def main():
    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    result = {}
    if mode == "train":
        core_runs(result)
        for name, cfg in OVERLAP.items():
            model, opt = build(cfg)
            anchors = []
            train(model, opt, 0, OVERLAP_STEPS, anchors=anchors)
            result[name] = {"anchors": anchors, "final": model.state_dict()}
        for shard in (False, True):
            result[f"sharded-{shard}"] = sharded_run(shard)
        result["gossip"] = gossip_checks()
    elif mode == "core":
        core_runs(result)
    elif mode in ("save", "resume"):
        checkpoint_runs(mode, int(sys.argv[3]), out, rank, result)
    elif mode == "node":
        node_runs(rank, result)
    elif mode == "comm":
        result = comm_checks()
        result["mismatch"] = mismatch_error(rank)
        result["amp"] = amp_runs(rank)
    elif mode == "core-sgd":
        model, opt = build(CORE["sgd-reset"])
        snaps = []
        train(model, opt, 0, CORE_STEPS, snaps)
        result = {
            "sgd-reset": {"snaps": snaps, "final": model.state_dict()},
            "comm": type(opt.comm).__name__,
            "package": hvd_slowmo.__file__,
        }
    else:
        raise SystemExit(f"unknown mode {mode}")
    torch.save(result, os.path.join(out, f"{mode}.{rank}.pt"))
    dist.destroy_process_group()


def comm_checks():
    """Every collective of the communicator on rank-dependent tensors (float32, float64, and a
    shard split that leaves one rank's shard empty)."""
    comm = TorchDistCommunicator()
    rank, m = comm.rank, comm.size
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g, dtype=torch.float64)]
    sent = [t.clone() for t in tensors]
    comm.average_(tensors, "avg")
    in_flight = [t.clone() for t in sent]
    pending = comm.average_start(in_flight, "avg_async")
    flats = [torch.randn(10, generator=g), torch.randn(m - 1, generator=g, dtype=torch.float64)]
    shards = comm.reduce_scatter_mean(flats, "rs")
    gathered = comm.allgather_flat(shards, "ag")
    hops = (1, 2) if m >= 3 else (1,)  # two peers each, where there are two others
    sends = {(rank + h) % m: torch.arange(3.0) + 10 * rank + h for h in hops}
    exchange = comm.exchange_start(sends, [(rank - h) % m for h in hops], tag=5)
    received = exchange.wait()
    pending.wait()
    # done() must say False while a message is missing (the gossip deadline polls it): rank 1
    # sends only after rank 0 has looked.
    early = None
    if rank == 0:
        late_exchange = comm.exchange_start({1: torch.ones(2)}, [1], tag=99)
        time.sleep(0.5)
        early = late_exchange.done()
        comm.allgather_object(None)
        late_exchange.wait()
        early = (early, late_exchange.done())
    else:
        comm.allgather_object(None)
        if rank == 1:
            comm.exchange_start({0: torch.ones(2)}, [0], tag=99).wait()
    return {
        "sent": sent,
        "average": tensors,
        "average_start": in_flight,
        "flats": flats,
        "shards": shards,
        "gathered": gathered,
        "received": received,
        "objects": comm.allgather_object(("rank", rank)),
        "broadcast": comm.broadcast_object(f"from {rank}", root_rank=m - 1),
        "bytes": comm.bytes_sent,
        "done_before_and_after": early,
    }


if __name__ == "__main__":
    main()
    end_process()
