"""Worker for tests/test_hierarchy_horovod.py: worker='node' under horovodrun.

Usage: hierarchy_worker.py OUT_DIR BASE
Writes, per rank, its (cross_rank, local_rank) and its parameters after every step.
"""

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import hvd_slowmo

from hierarchy_cases import CASES, loss, mlp
from reference import batch


def main():
    out, case = sys.argv[1], sys.argv[2]
    hvd.init(process_sets="dynamic")
    torch.set_num_threads(1)
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
    # The gathers above run in process sets; a rank that returns first shuts Horovod down at exit,
    # which fails the other sets' gathers still in flight ("Horovod has been shut down", seen at
    # load 15 about once in ten runs). Everyone leaves together.
    hvd.barrier()


if __name__ == "__main__":
    main()
