"""Worker for tests/test_unequal_launch.py: time-based periods and the weighted merge on real
processes, with a fake clock per rank (rank r's step costs COSTS[size][r] seconds), so the step
counts are those of tests/test_unequal.py's thread run.

Under torchrun it initializes torch.distributed (Gloo); under horovodrun, Horovod; the engine is
then chosen automatically. Writes OUT_DIR/unequal.RANK.pt: the anchor and the parameters after
every outer step, the plans and the step count.

Usage: unequal_worker.py OUT_DIR
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import hvd_slowmo

from helpers import anchor_of
from reference import loss_at, lr_at, make_model, params_of

COSTS = {2: [0.125, 0.25], 4: [0.125, 0.25, 0.25, 0.5]}
OUTER = 4


def samples_of(rank: int, k: int) -> float:
    """As tests/test_unequal.py's."""
    return float(3 + rank + (k % 3))


def main(out: str) -> None:
    if "HOROVOD_RANK" in os.environ:
        import horovod.torch as hvd

        hvd.init()
    else:
        torch.distributed.init_process_group("gloo")
    model = make_model()
    now = [0.0]
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        tau=4,
        slow_lr=0.7,
        slow_momentum=0.6,
        period_seconds=1.0,
        merge="samples",
        clock=lambda: now[0],
    )
    rank, size = opt.comm.rank, opt.comm.size
    anchors, params = [], []
    while opt.outer_steps < OUTER:
        k = opt.num_steps
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        now[0] += COSTS[size][rank]
        before = opt.outer_steps
        opt.step(samples=samples_of(rank, k))
        if opt.outer_steps > before:
            anchors.append([a.clone() for a in anchor_of(opt)])
            params.append(params_of(model))
    opt.finish()
    torch.save(
        {"anchors": anchors, "params": params, "plans": opt.period.plans, "steps": opt.num_steps},
        os.path.join(out, f"unequal.{rank}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1])
