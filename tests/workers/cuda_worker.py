"""Device checks under horovodrun or torchrun; launched by tests/test_cuda.py::

    horovodrun -np 1 --gloo python tests/workers/cuda_worker.py single OUT cuda    # NCCL
    horovodrun -np 2 --gloo python tests/workers/cuda_worker.py bases OUT cuda     # --gpu staged
    horovodrun -np 2 --gloo python tests/workers/cuda_worker.py features OUT cuda  # --gpu staged
    torchrun --nproc-per-node 2 tests/workers/cuda_worker.py features OUT cuda     # Gloo

``single``: Horovod's grouped average (the call ``HorovodCommunicator.average_`` makes) on
tensors of the device, and SlowMo over Local SGD on a model there, after
``hvd.broadcast_parameters``. With one rank the optimizer's own collectives are skipped, so the
grouped average is called directly; the test reads Horovod's timeline (``HOROVOD_TIMELINE``) to
see which backend ran it. Writes ``OUT/single.json``.

``bases``: every base the world size allows trains the test MLP on the device (float64, the
batches of tests/reference.py); each rank writes ``OUT/{base}.rank{r}.pt`` with its parameters
after every exact average and at the end, for the test to compare across ranks and with the
thread-worker replay.

``features``: every run of tests/device_run.py (AR-SGD's hooks with AMP and GradScaler, Local
SGD + SlowMo with fragments and eager="local", int8 and fp8 pseudo-gradients, overlap); each
rank writes ``OUT/features.rank{r}.pt``. Under torchrun (``TORCHELASTIC_RUN_ID`` in the
environment) the engine is torch.distributed over Gloo, which takes CUDA tensors (copied through
host memory), so both ranks can share one GPU; under horovodrun it is Horovod.
"""

import json
import os
import sys

import torch

# Tests/: the reference
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_slowmo import DistributedOptimizer

from device_run import FEATURES, run_feature
from helpers import anchor_of, end_process
from reference import batch, make_model

#: Horovod when launched by horovodrun (imported in main), else None: torch.distributed.
hvd = None

# The run of tests/test_cuda.py's thread workers: the same optimizer, schedule and data.
STEPS, TAU = 8, 3
GOSSIP = ("sgp", "osgp", "dpsgd")


def train(base: str, device: torch.device):
    """Train the test MLP with ``base``; returns (params after each exact average, final params)."""
    model = make_model().to(device, torch.float64)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        base=base,
        tau=TAU,
        slow_lr=1.0,
        slow_momentum=0.5,
    )
    snaps = []
    for k in range(STEPS):
        x, y = batch(hvd.rank(), k)
        opt.zero_grad()
        ((model(x.to(device, torch.float64)) - y.to(device, torch.float64)) ** 2).mean().backward()
        opt.step()
        if len(snaps) < opt.outer_steps:
            snaps.append([p.detach().cpu().clone() for p in model.parameters()])
    assert all(p.device == device for p in model.parameters()), "parameters left the device"
    return snaps, [p.detach().cpu().clone() for p in model.parameters()], opt


def single(out_dir: str, device: torch.device) -> None:
    # Two dtypes, as in an exact average of float32 parameters and float64 BatchNorm counts.
    tensors = [
        torch.arange(6, dtype=torch.float32, device=device),
        torch.linspace(0, 1, 5, dtype=torch.float64, device=device),
    ]
    want = [t.clone() for t in tensors]
    hvd.grouped_allreduce_(tensors, op=hvd.Average, name="hvd_slowmo.exact_average")
    snaps, final, opt = train("localsgd", device)
    result = {
        "nccl_built": int(hvd.nccl_built()),
        "device": str(device),
        "average_is_identity": all(torch.equal(a, b) for a, b in zip(tensors, want)),
        "average_on_device": all(t.device == device for t in tensors),
        "counters": [opt.num_steps, opt.inner_step, opt.outer_steps],
        "anchor_on_device": all(a.device == device for a in anchor_of(opt)),
        "finite": all(bool(p.isfinite().all()) for p in final),
        "exact_averages": len(snaps),
    }
    with open(os.path.join(out_dir, "single.json"), "w") as f:
        json.dump(result, f)


def bases(out_dir: str, device: torch.device) -> None:
    for base in ("localsgd", "allreduce") + (GOSSIP if hvd.size() > 1 else ()):
        snaps, final, opt = train(base, device)
        torch.save(
            {
                "snaps": snaps,
                "final": final,
                "counters": [opt.num_steps, opt.inner_step, opt.outer_steps],
            },
            os.path.join(out_dir, f"{base}.rank{hvd.rank()}.pt"),
        )


def features(out_dir: str, device: torch.device, rank: int) -> None:
    results = {name: run_feature(name, device.type, rank) for name in FEATURES}
    torch.save(results, os.path.join(out_dir, f"features.rank{rank}.pt"))


def main(mode: str, out_dir: str, device_type: str) -> None:
    global hvd
    torch.set_num_threads(1)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")  # CPU and CUDA tensors alike
        rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    else:
        import horovod.torch as hvd

        hvd.init()
        rank, local_rank = hvd.rank(), hvd.local_rank()
    if device_type == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())  # ranks may share a GPU
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if mode == "features":
        features(out_dir, device, rank)
    elif hvd is None:
        raise SystemExit(f"mode {mode!r} needs horovodrun (it calls Horovod directly)")
    else:
        {"single": single, "bases": bases}[mode](out_dir, device)
    if hvd is not None:
        hvd.shutdown()  # flushes the timeline
    else:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    end_process()
