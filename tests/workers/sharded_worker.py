"""Worker for tests/test_sharded_horovod.py, run under horovodrun.

Usage: sharded_worker.py OUT_DIR
Trains the reference model unsharded and with shard_slow_state=True over both reduce-scatter
transports (Horovod's reducescatter, alltoall), for heavy-ball and a custom outer optimizer, with
three param groups (the third a 2-element extra parameter: with 3 ranks one shard is empty), and
writes, per rank, OUT_DIR/sharded.RANK.pt with the parameters after every outer step, the final
parameters, the slow-state bytes this rank keeps and the bytes it sent.
"""

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo
from hvd_slowmo.comm.horovod import HorovodCommunicator

from helpers import state_tensors_of
from reference import loss_at, lr_at, make_model, params_of

CONFIGS = {
    "heavyball": dict(slow_lr=0.7, slow_momentum=0.6),
    "custom-sgd": dict(
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
    ),
}
STEPS, TAU = 9, 3


VARIANTS = {"plain": None, "sharded-reducescatter": "reducescatter", "sharded-alltoall": "alltoall"}


def run(cfg, comm, shard, model):
    """Train ``model`` on ``comm``'s rank; pure in the communicator, so tests replay it on
    threads."""
    extra = torch.nn.Parameter(torch.ones(2))
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    base = torch.optim.SGD(
        [{"params": first}, {"params": rest}, {"params": [extra]}],
        lr=0.05,
        momentum=0.9,
        nesterov=True,
    )
    opt = hvd_slowmo.DistributedOptimizer(
        base,
        named_parameters=[*model.named_parameters(), ("extra", extra)],
        model_buffers=model.buffers(),
        tau=TAU,
        buffers="maintain",
        shard_slow_state=shard,
        communicator=comm,
        **cfg,
    )
    snaps = []
    for k in range(STEPS):
        opt.param_groups[0]["lr"] = lr_at(k)
        # Each group's own 1/lr scaling
        opt.param_groups[1]["lr"] = opt.param_groups[2]["lr"] = lr_at(k) / 2
        opt.zero_grad()
        loss_at(model, comm.rank, k).backward()
        extra.grad = torch.tensor([0.1, -0.2]) * (comm.rank + 1) * (k + 1)
        opt.step()
        if opt.inner_step == 0:
            snaps.append(params_of(model) + [extra.detach().clone()])
    kept = state_tensors_of(opt)
    return {
        "snaps": snaps,
        "final": snaps[-1],
        "state_bytes": sum(t.numel() * t.element_size() for t in kept),
        "bytes_sent": opt.comm.bytes_sent,
    }


def main():
    out = sys.argv[1]
    hvd.init()
    torch.set_num_threads(1)
    result = {}
    for name, cfg in CONFIGS.items():
        result[name] = {}
        for variant, transport in VARIANTS.items():
            model = make_model()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            comm = HorovodCommunicator(reduce_scatter=transport or "auto")
            result[name][variant] = run(cfg, comm, transport is not None, model)
    torch.save(result, os.path.join(out, f"sharded.{hvd.rank()}.pt"))


if __name__ == "__main__":
    main()
