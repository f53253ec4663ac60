"""Worker for tests/test_quorum_launch.py: a straggler quorum under torchrun (Gloo). Every base
step sleeps STEP_S (emulated compute); rank PAUSED sleeps PAUSE_S before the base step that ends
outer step 1, far past the grace, so the others go on without it and it is resynchronized.

Writes OUT_DIR/quorum.RANK.pt: the model's state after the run, the members this rank learnt of
(rank 0: every outer step's) and its base step count.

Usage: quorum_worker.py OUT_DIR
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import hvd_slowmo

from helpers import end_process
from reference import loss_at, make_model

TAU, OUTER, STEP_S, PAUSE_S, PAUSED = 4, 12, 0.03, 1.0, 3


def main(out: str) -> None:
    torch.distributed.init_process_group("gloo")
    model = make_model()
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        tau=TAU,
        slow_momentum=0.5,
        straggler=hvd_slowmo.Quorum(min_workers=3, grace=0.1),
    )
    rank = opt.comm.rank
    paused = False
    while opt.outer_steps < OUTER:
        if rank == PAUSED and not paused and (opt.outer_steps, opt.inner_step) == (1, TAU - 1):
            time.sleep(PAUSE_S)
            paused = True
        time.sleep(STEP_S)
        opt.zero_grad()
        loss_at(model, rank, opt.outer_steps * TAU + opt.inner_step).backward()
        opt.step()
    opt.finish()
    torch.save(
        {
            "state": model.state_dict(),
            "members": opt.exchanges[0].members,
            "steps": opt.num_steps,
        },
        os.path.join(out, f"quorum.{rank}.pt"),
    )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    end_process()
