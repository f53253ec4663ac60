"""Worker for tests/test_hierarchy_horovod.py: worker='node' under horovodrun.

Usage: hierarchy_worker.py OUT_DIR CASE[,CASE...]
Runs the cases one after the other in the same processes (one start-up; the node and cross-node
process sets are created once, by the first case, and reused). Writes, per case and rank, its
(cross_rank, local_rank) and its parameters after every step.
"""

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import hvd_slowmo

from hierarchy_cases import CASES, loss, mlp
from reference import batch


def run_case(out: str, case: str) -> None:
    """Train CASES[case] for 7 steps from the shared initial model and save this rank's record."""
    model = mlp()
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters(),
        worker="node",
        **CASES[case],
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    per_step = []
    for k in range(7):
        opt.zero_grad()
        loss(model, *batch(hvd.rank(), k)).backward()
        opt.step()
        per_step.append([p.detach().clone() for p in model.parameters()])
    gathers = {
        "node_gather": opt.node_comm.allgather_object(hvd.rank()),
        "cross_gather": opt.base.comm.allgather_object(hvd.rank()),
    }
    torch.save(
        {
            "layout": (hvd.cross_rank(), hvd.local_rank()),
            "steps": per_step,
            "bytes": opt.bytes_sent,
            "exchange": opt.exchanges[0].name,
            **gathers,
        },
        os.path.join(out, f"{case}.{hvd.rank()}.pt"),
    )


def main():
    out, cases = sys.argv[1], sys.argv[2].split(",")
    hvd.init(process_sets="dynamic")
    torch.set_num_threads(1)
    for case in cases:
        run_case(out, case)
        # The gathers above run in process sets; a rank that goes on (or returns and shuts Horovod
        # down at exit) first would fail the other sets' gathers still in flight ("Horovod has
        # been shut down", seen at load 15 about once in ten runs). Every case ends together.
        hvd.barrier()


if __name__ == "__main__":
    main()
