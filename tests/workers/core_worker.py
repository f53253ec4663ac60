"""Worker for tests/test_horovod_core.py, run under horovodrun.

Usage: core_worker.py OUT_DIR MODE [STOP]
  MODE=train:   several configurations; per rank, params after every outer step + final state.
  MODE=save:    the "sgd-reset" run uninterrupted (final state per rank); then, fresh, STOP
                steps of it and a checkpoint per rank.  MODE=resume: load it, finish.
  MODE=mismatch: rank-dependent tau; writes the error message.
"""

import os
import sys

import horovod.torch as hvd
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo

from reference import loss_at, lr_at, make_model, params_of

CONFIGS = {
    "sgd-reset": dict(opt="sgd", tau=3, slow_lr=0.7, slow_momentum=0.6, buffers="reset"),
    "adam-average": dict(opt="adam", tau=2, slow_lr=1.0, slow_momentum=0.5, buffers="average"),
    "allreduce": dict(
        opt="sgd", base="allreduce", tau=1, slow_lr=1.0, slow_momentum=0.0, buffers="maintain"
    ),
    "sgd-fp16": dict(opt="sgd", tau=3, slow_lr=1.0, slow_momentum=0.5, buffers="reset", fp16=True),
}
STEPS = 9


def build(cfg):
    cfg = dict(cfg)
    model = make_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    kind = cfg.pop("opt")
    base_opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
        if kind == "sgd"
        else torch.optim.Adam(model.parameters(), lr=0.01)
    )
    compression = hvd.Compression.fp16 if cfg.pop("fp16", False) else None
    opt = hvd_slowmo.DistributedOptimizer(
        base_opt,
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        compression=compression,
        **cfg,
    )
    return model, opt


def train(model, opt, start, stop, snaps=None):
    for k in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.zero_grad()
        loss_at(model, hvd.rank(), k).backward()
        opt.step()
        if snaps is not None and opt.inner_step == 0:
            snaps.append(params_of(model))


def main():
    out, mode = sys.argv[1], sys.argv[2]
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    path = os.path.join(out, f"{mode}.{rank}.pt")
    if mode == "train":
        result = {}
        for name, cfg in CONFIGS.items():
            model, opt = build(cfg)
            snaps = []
            train(model, opt, 0, STEPS, snaps)
            result[name] = {
                "snaps": snaps,
                "final": model.state_dict(),
                "bytes": opt.comm.bytes_sent,
            }
        torch.save(result, path)
    elif mode == "save":
        model, opt = build(CONFIGS["sgd-reset"])
        train(model, opt, 0, STEPS)
        torch.save({"final": model.state_dict()}, path)
        # A separate run saves: saving must not be what makes the resumed run match.
        model, opt = build(CONFIGS["sgd-reset"])
        train(model, opt, 0, int(sys.argv[3]))
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict()},
            os.path.join(out, f"ckpt.{rank}.pt"),
        )
    elif mode == "resume":
        model, opt = build(CONFIGS["sgd-reset"])
        ckpt = torch.load(os.path.join(out, f"ckpt.{rank}.pt"), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train(model, opt, int(sys.argv[3]), STEPS)
        torch.save({"final": model.state_dict()}, path)
    elif mode == "mismatch":
        model = make_model()
        try:
            hvd_slowmo.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=model.named_parameters(),
                tau=3 + (rank == 1),
            )
            msg = "no error"
        except ValueError as e:
            msg = str(e)
        with open(path + ".txt", "w") as f:
            f.write(msg)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
