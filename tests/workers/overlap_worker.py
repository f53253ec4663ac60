"""Worker for tests/test_overlap_horovod.py, run under horovodrun: overlapped outer steps over
Horovod's asynchronous grouped allreduce.

Usage: overlap_worker.py OUT_DIR MODE [STOP]
  MODE=train:  several configurations; per rank, the new anchor of every landing + final params.
  MODE=save:   train STOP steps (an average in flight), save.  MODE=resume: load it, finish.
"""

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo

from reference import loss_at, lr_at, make_model, params_of

CONFIGS = {
    "localsgd-d1": dict(tau=3, overlap=1, slow_lr=0.7, slow_momentum=0.6),
    "localsgd-d2-maintain": dict(tau=4, overlap=2, slow_momentum=0.5, buffers="maintain"),
    "sgp-d1": dict(base="sgp", tau=3, overlap=1, slow_momentum=0.6),
    "fp16-d1": dict(tau=3, overlap=1, slow_momentum=0.6, fp16=True),
}
STEPS = 11


def build(cfg):
    cfg = dict(cfg)
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvd.Compression.fp16 if cfg.pop("fp16", False) else None
    base_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    opt = hvd_slowmo.DistributedOptimizer(
        base_opt,
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        compression=compression,
        **cfg,
    )
    return model, opt


def train(model, opt, start, stop, anchors=None):
    for k in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        pending = opt.outer.in_flight
        opt.zero_grad()
        loss_at(model, hvd.rank(), k).backward()
        opt.step()
        if anchors is not None and pending is not None and opt.outer.in_flight is None:
            anchors.append([t.clone() for t in pending.sent])


def main():
    out, mode = sys.argv[1], sys.argv[2]
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    if mode == "train":
        result = {}
        for name, cfg in CONFIGS.items():
            model, opt = build(cfg)
            anchors = []
            train(model, opt, 0, STEPS, anchors)
            # An outer step is still in flight: no rank may exit (Horovod shuts down at exit)
            # before every rank has started its averages. finish() meets them all, state unchanged.
            opt.finish()
            result[name] = {
                "anchors": anchors,
                "final": model.state_dict(),
                "average_s": opt.timings["average"],
            }
        torch.save(result, os.path.join(out, f"train.{rank}.pt"))
    elif mode == "save":
        model, opt = build(CONFIGS["localsgd-d2-maintain"])
        train(model, opt, 0, int(sys.argv[3]))
        assert opt.outer.in_flight is not None, "save inside the delay"
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict()},
            os.path.join(out, f"ckpt.{rank}.pt"),
        )
        opt.finish()
    elif mode == "resume":
        model, opt = build(CONFIGS["localsgd-d2-maintain"])
        ckpt = torch.load(os.path.join(out, f"ckpt.{rank}.pt"), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train(model, opt, int(sys.argv[3]), STEPS)
        opt.finish()
        torch.save({"final": model.state_dict()}, os.path.join(out, f"resume.{rank}.pt"))
    print(params_of(model)[0].sum().item() if mode != "train" else "done")


if __name__ == "__main__":
    main()
