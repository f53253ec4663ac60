"""The runs of several processes on one device, shared by the process worker
(tests/workers/cuda_worker.py ``features``, under torchrun or horovodrun) and its CPU replay on
thread workers (tests/test_cuda.py).

Each feature is one small training run on the test MLP of tests/reference.py with the batches of
worker ``rank``; :func:`run_feature` returns everything the test compares: the anchor after every
step, the final parameters and buffers, the step counters, and for AMP the skipped steps and the
loss scale. Nothing here knows the transport: ``communicator`` is the thread worker's, or None
(the optimizer's engine: Horovod under horovodrun, torch.distributed under torchrun).
"""

import warnings
from typing import Any

import torch
from torch import nn

import hvd_slowmo

from amp_run import mlp
from helpers import anchor_of
from reference import batch, lr_at, make_model

#: Feature -> (DistributedOptimizer settings, float64 model). The float64 runs make a GPU-vs-CPU
#: comparison tight (only the summation order of the kernels differs); AMP needs float32
#: parameters under fp16 autocast.
FEATURES: dict[str, tuple[dict[str, Any], bool]] = {
    # AR-SGD's gradient hooks with fp16 autocast and Horovod's GradScaler recipe; an overflow is
    # forced on rank 1 at AMP_OVERFLOWS, and every rank must skip those steps.
    "arsgd-amp": (dict(base="allreduce", tau=3, slow_momentum=0.6), False),
    # Local SGD + SlowMo streaming in two fragments, each landing one step late, with the
    # worker's own outer gradient as the estimate meanwhile.
    "fragments-eager-local": (
        dict(tau=4, overlap=1, fragments=2, eager="local", slow_lr=0.8, slow_momentum=0.6),
        True,
    ),
    # int8 pseudo-gradients with error feedback, fragments, two steps of overlap.
    "int8-fragments-overlap": (
        dict(
            tau=4,
            overlap=2,
            fragments=2,
            compression="int8",
            error_feedback=True,
            slow_lr=0.8,
            slow_momentum=0.6,
        ),
        True,
    ),
    # fp8 pseudo-gradients, the whole model, one step of overlap.
    "fp8-overlap": (dict(tau=3, overlap=1, compression="fp8", slow_momentum=0.5), True),
}
STEPS = 10
AMP_OVERFLOWS, AMP_BAD_RANK, AMP_INIT_SCALE = (1, 5), 1, 2.0**10


def _cpu(tensors) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in tensors]


def _inf_at_0_0(grad: torch.Tensor) -> torch.Tensor:
    out = grad.clone()
    out[0, 0] = float("inf")
    return out


def feature_model(name: str) -> nn.Module:
    """The model of feature ``name``, on the CPU (seeded: the same on every worker). Thread
    workers must build theirs before they start: torch's global RNG is not thread-safe."""
    return mlp() if name == "arsgd-amp" else make_model()


def run_feature(
    name: str,
    device: str,
    rank: int,
    communicator: Any = None,
    model: nn.Module | None = None,
    steps: int = STEPS,
) -> dict[str, Any]:
    """Train one worker of feature ``name`` on ``device``; results on the CPU.

    Args:
        name: a key of :data:`FEATURES`.
        device: ``"cpu"`` or ``"cuda"`` (the current CUDA device).
        rank: this worker's rank (selects its batches; rank 1 overflows under AMP).
        communicator: the thread worker's communicator, or None for the launcher's engine.
        model: from :func:`feature_model` (default: built here).
        steps: iterations.

    Returns:
        ``anchors`` (the anchor after every step), ``final`` (parameters and floating buffers at
        the end, in flight averages landed), ``counters`` (num_steps, inner_step, outer_steps),
        ``skipped_steps`` and ``scale`` (AMP only, else None).
    """
    settings, f64 = FEATURES[name]
    amp = name == "arsgd-amp"
    dtype = torch.float64 if f64 else torch.float32
    model = (model or feature_model(name)).to(device, dtype)
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        communicator=communicator,
        **settings,
    )
    scaler = None
    if amp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GradScaler on the CPU
            scaler = torch.amp.GradScaler(device, init_scale=AMP_INIT_SCALE, growth_interval=10**6)
    anchors = []
    for k in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        x, y = batch(rank, k)
        x, y = x.to(device, dtype), y.to(device, dtype)
        opt.zero_grad()
        if scaler is None:
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        else:
            with torch.autocast(device, dtype=torch.float16):
                out = model(x)
            hook = None
            if k in AMP_OVERFLOWS and rank == AMP_BAD_RANK:  # inside backward, as a real one
                hook = next(model.parameters()).register_hook(_inf_at_0_0)
            scaler.scale(((out.float() - y) ** 2).mean()).backward()
            if hook is not None:
                hook.remove()
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
        anchors.append(_cpu(anchor_of(opt)))
    opt.flush()
    opt.finish()
    return {
        "anchors": anchors,
        "final": _cpu(
            list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
        ),
        "counters": (opt.num_steps, opt.inner_step, opt.outer_steps),
        "skipped_steps": opt.skipped_steps if amp else None,
        "scale": scaler.get_scale() if scaler is not None else None,
    }
