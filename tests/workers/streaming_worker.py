"""Worker for tests/test_streaming_horovod.py, run under horovodrun: streaming SlowMo (fragments)
and eager updates over Horovod's asynchronous grouped allreduce, and fragments with the
compressed exchange (all-to-all and all-gather).

Usage: streaming_worker.py OUT_DIR
  Per configuration and rank: the anchor after every step and the final model.
"""

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo

from helpers import anchor_of
from reference import loss_at, lr_at, make_model

#: name -> DistributedOptimizer settings (the test replays each with the reference).
CONFIGS = {
    "p3-d2-eager": dict(tau=6, overlap=2, fragments=3, eager=True, slow_lr=1.0, slow_momentum=0.6),
    "p2-d2-nesterov": dict(
        tau=4, overlap=2, fragments=2, slow_lr=0.8, slow_momentum=0.5, outer_optimizer="nesterov"
    ),
    "p2-d2-int8-feedback": dict(
        tau=4,
        overlap=2,
        fragments=2,
        slow_lr=0.8,
        slow_momentum=0.6,
        codec="int8",
        error_feedback=True,
    ),  # fmt: skip
    "p2-d1-local": dict(
        tau=4, overlap=1, fragments=2, eager="local", slow_lr=0.8, slow_momentum=0.6
    ),
}
STEPS = 15


def main():
    out = sys.argv[1]
    hvd.init()
    torch.set_num_threads(1)
    result = {}
    for name, cfg in CONFIGS.items():
        model = make_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd_slowmo.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            **cfg,
        )
        anchors = []
        for k in range(STEPS):
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
            opt.zero_grad()
            loss_at(model, hvd.rank(), k).backward()
            opt.step()
            anchors.append([a.clone() for a in anchor_of(opt)])
        # An outer step is still in flight: no rank may exit (Horovod shuts down at exit) before
        # every rank has started its averages. finish() meets them all and changes no state.
        opt.finish()
        result[name] = {"anchors": anchors, "final": model.state_dict()}
    torch.save(result, os.path.join(out, f"train.{hvd.rank()}.pt"))
    print("done")


if __name__ == "__main__":
    main()
