"""GPU checks (marker ``cuda``; ``scripts/gpu_check.sh`` runs them on a machine with an NVIDIA GPU).

Each check takes a ``device``. Its ``cpu`` case runs in the normal suite, so the code is exercised
on every machine; its ``cuda`` case is marked ``cuda`` and skipped, with the reason printed, where
torch finds no CUDA GPU.

- Every base on thread workers (:mod:`hvd_slowmo.comm.local`) with float64 tensors on the device
  equals the same run on the CPU; ranks are bitwise equal after every exact average.
- Horovod's GradScaler recipe with fp16 autocast, with and without an overflow forced on one rank.
- ``channels_last`` parameters; bf16 + fp16 + fp32 parameters (one flat gossip message per dtype).
- The int8 and fp8 codecs: the same codes, scales and decoded values on the device as on the CPU.
- Under horovodrun: Horovod's grouped average of device tensors and SlowMo on the device
  (``-np 1``: NCCL on a GPU); two ranks sharing one GPU with a Horovod built by
  ``install_horovod.sh --gpu staged`` (CUDA tensors staged through host memory: NCCL refuses two
  ranks on one device); the examples with ``--amp``.
- Two processes on one device (tests/device_run.py's features: AR-SGD's hooks with AMP and
  GradScaler, fragments with eager="local", int8 and fp8 pseudo-gradients, overlap) over
  torch.distributed's Gloo (torchrun) and over Horovod (horovodrun; the staged build on a GPU):
  equal to the CPU replay on two thread workers.
"""

import functools
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import decode, encode
from hvd_slowmo.divide import div_, foreach_div_

from amp_run import mlp
from device_run import (
    AMP_BAD_RANK,
    AMP_INIT_SCALE,
    AMP_OVERFLOWS,
    FEATURES,
    feature_model,
    run_feature,
)
from device_run import STEPS as FEATURE_STEPS
from helpers import SlowArrivals, anchor_of, slow_buffer_of
from horovod_launch import ROOT, horovodrun, launch_env
from reference import batch, loss_at, make_model
from reference_overlap import reference_overlapped
from torchrun_launch import torchrun

NO_CUDA = (
    None
    if torch.cuda.is_available()
    else f"no CUDA GPU here (torch {torch.__version__}: torch.cuda.is_available() is False)"
)
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(NO_CUDA is not None, reason=str(NO_CUDA))]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA_MARKS)]
#: Base -> extra options. OSGP runs over SlowArrivals (tests/helpers.py): it mixes only what
#: staleness forces, so its runs are reproducible and comparable across devices.
BASES = {"localsgd": {}, "allreduce": {}, "sgp": {}, "osgp": {"staleness": 1}, "dpsgd": {}}
M, STEPS, TAU = 4, 8, 3
WORKER = os.path.join(ROOT, "tests", "workers", "cuda_worker.py")


def cpu_params(model: nn.Module):
    return [p.detach().cpu().clone() for p in model.parameters()]


def run_workers(models, base, step_fn, **kwargs):
    """Train one thread worker per model with ``base`` (SGD, Nesterov, tau=3, beta=0.5).

    ``step_fn(opt, model, rank, k)`` runs iteration ``k``. Returns per rank a dict: ``snaps``
    (parameters after every exact average, on the CPU), ``history`` (counters and parameters
    after every iteration), ``final`` and ``opt``.
    """

    def worker(comm):
        if base == "osgp":
            comm = SlowArrivals(comm)
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            base=base,
            tau=TAU,
            slow_lr=1.0,
            slow_momentum=0.5,
            **BASES[base],
            **kwargs,
        )
        out = {"snaps": [], "history": []}
        for k in range(STEPS):
            step_fn(opt, model, comm.rank, k)
            out["history"].append(
                ((opt.num_steps, opt.inner_step, opt.outer_steps), cpu_params(model))
            )
            if len(out["snaps"]) < opt.outer_steps:
                out["snaps"].append(cpu_params(model))
        out.update(final=cpu_params(model), opt=opt)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler on CPU, fp16 on CPU
        return run_threads(len(models), worker)


def plain_step(device: str, dtype: torch.dtype, data=batch):
    def step(opt, model, rank, k):
        x, y = data(rank, k)
        opt.zero_grad()
        ((model(x.to(device, dtype)) - y.to(device, dtype)) ** 2).mean().backward()
        opt.step()

    return step


def assert_ranks_bitwise_equal(results):
    assert len({len(r["snaps"]) for r in results}) == 1, (
        "ranks took different numbers of outer steps"
    )
    for per_rank in zip(*[r["snaps"] for r in results]):
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), (
                "ranks differ after an exact average"
            )


def assert_same_run(got, want, exact, rtol=1e-10, atol=1e-12):
    """Every worker's parameters after every exact average and at the end: bitwise, or close."""
    for rank, (g, w) in enumerate(zip(got, want)):
        assert [c for c, _ in g["history"]] == [c for c, _ in w["history"]], (
            f"rank {rank}: step counters differ"
        )
        for a, b in zip(g["snaps"] + [g["final"]], w["snaps"] + [w["final"]]):
            for x, y in zip(a, b):
                if exact:
                    assert torch.equal(x, y), f"rank {rank}: not bitwise the same run"
                else:
                    torch.testing.assert_close(
                        x, y, rtol=rtol, atol=atol, msg=lambda m, rank=rank: f"rank {rank}: {m}"
                    )


# --- every base on the device equals the CPU run ---------------------------------------------
#: The bases the hand-written reference replays (tests/reference_overlap.py); the gossip bases are
#: checked against their own references in tests/test_gossip.py.
REFERENCE_BASES = ("localsgd", "allreduce")
#: On the CPU a run compared with the CPU run would be the same run twice: the CPU case compares
#: with the hand-written reference instead, so it exists only for the bases the reference replays.
DEVICE_CASES = [pytest.param(b, "cpu", id=f"{b}-cpu") for b in REFERENCE_BASES] + [
    pytest.param(b, "cuda", id=f"{b}-cuda", marks=CUDA_MARKS) for b in BASES
]


def reference_run(base, model_fn, loss_fn):
    """The float64 reference of :func:`run_workers` (SGD, Nesterov, tau=3, alpha=1, beta=0.5)."""
    return reference_overlapped(
        M,
        STEPS,
        TAU,
        0,
        1.0,
        0.5,
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        model_fn=model_fn,
        base=base,
        loss_fn=loss_fn,
    )


def assert_final_close(got, want, atol):
    for rank, (g, ref) in enumerate(zip(got, want)):
        for a, b in zip(g["final"], cpu_params(ref)):
            torch.testing.assert_close(
                a.double(), b, rtol=0, atol=atol, msg=lambda m, rank=rank: f"rank {rank}: {m}"
            )


def f64_loss(model, rank, k):
    x, y = batch(rank, k)
    return ((model(x.double()) - y.double()) ** 2).mean()


@pytest.mark.parametrize("base,device", DEVICE_CASES)
def test_base_on_device_equals_cpu_run(base, device):
    got = run_workers(
        [make_model().to(device, torch.float64) for _ in range(M)],
        base,
        plain_step(device, torch.float64),
    )
    assert_ranks_bitwise_equal(got)
    assert len(got[0]["snaps"]) == STEPS // TAU
    if device == "cpu":  # float64: rounding only
        assert_final_close(got, reference_run(base, lambda: make_model().double(), f64_loss), 1e-12)
    else:  # a GPU sums in another order: float64 rounding only
        want = run_workers(
            [make_model().double() for _ in range(M)], base, plain_step("cpu", torch.float64)
        )
        assert_same_run(got, want, exact=False)
    for r in got:
        state = anchor_of(r["opt"]) + slow_buffer_of(r["opt"])
        assert all(t.device.type == device for t in state), (
            "SlowMo state is not on the parameters' device"
        )


# --- AMP: Horovod's GradScaler recipe with fp16 autocast ---------------------------------------
BAD_RANK, INIT_SCALE = 1, 2.0**10
OVERFLOWS = [
    pytest.param((), id="no-overflow"),
    pytest.param((1, 5), id="overflow"),
]


def _inf_at_0_0(grad):
    out = grad.clone()
    out[0, 0] = float("inf")
    return out


def amp_step(device: str, overflows, scalers):
    """One iteration of Horovod's recipe; at ``overflows`` rank BAD_RANK's gradient holds inf."""

    def step(opt, model, rank, k):
        scaler = scalers[rank]
        x, y = batch(rank, k)
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            out = model(x.to(device))
        hook = None
        if k in overflows and rank == BAD_RANK:
            # Inside backward, where an overflow happens (AR-SGD averages during backward).
            hook = next(model.parameters()).register_hook(_inf_at_0_0)
        scaler.scale(((out.float() - y.to(device)) ** 2).mean()).backward()
        if hook is not None:
            hook.remove()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()

    return step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overflows", OVERFLOWS)
@pytest.mark.parametrize("base", list(BASES))
def test_amp_recipe_keeps_ranks_in_step(base, overflows, device):
    scalers = [
        torch.amp.GradScaler(device, init_scale=INIT_SCALE, growth_interval=10**6) for _ in range(M)
    ]
    models = [make_model().to(device) for _ in range(M)]
    got = run_workers(models, base, amp_step(device, overflows, scalers))
    assert_ranks_bitwise_equal(got)
    for k in range(STEPS):
        counters = {r["history"][k][0] for r in got}
        assert len(counters) == 1, (
            f"iteration {k}: ranks' (num_steps, inner_step, outer_steps) differ: {counters}"
        )
    applied = STEPS - len(overflows)
    assert got[0]["history"][-1][0] == (applied, applied % TAU, applied // TAU)
    for rank, r in enumerate(got):
        for k in overflows:  # the overflowed step left every rank's parameters as they were
            assert all(
                torch.equal(a, b) for a, b in zip(r["history"][k][1], r["history"][k - 1][1])
            ), (rank, k)
        assert all(bool(p.isfinite().all()) for p in r["final"])
        assert not torch.equal(r["final"][0], cpu_params(make_model())[0]), "nothing was trained"
    # No spurious overflow (fp16 with this loss scale is finite unless inf is forced); the forced
    # ones backed off the scale of the rank that saw them.
    assert scalers[BAD_RANK].get_scale() == INIT_SCALE * 0.5 ** len(overflows)
    if not overflows:
        assert all(s.get_scale() == INIT_SCALE for s in scalers)


# --- channels_last parameters --------------------------------------------------------------
def conv_model(memory_format=torch.contiguous_format) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(16, 2)
    )
    return model.double().to(memory_format=memory_format)


def image_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 3, 6, 6, generator=g), torch.randn(8, 2, generator=g)


def channels_last_batch(rank: int, step: int):
    x, y = image_batch(rank, step)
    return x.contiguous(memory_format=torch.channels_last), y


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base", list(BASES))
def test_channels_last_parameters(base, device):
    cl = torch.channels_last
    got = run_workers(
        [conv_model(cl).to(device) for _ in range(M)],
        base,
        plain_step(device, torch.float64, channels_last_batch),
    )
    want = run_workers(
        [conv_model() for _ in range(M)], base, plain_step("cpu", torch.float64, image_batch)
    )
    assert_ranks_bitwise_equal(got)
    # NHWC kernels sum in another order
    assert_same_run(got, want, exact=False, rtol=1e-9, atol=1e-11)
    for r in got:
        opt = r["opt"]
        convs = [p for p in opt.param_groups[0]["params"] if p.dim() == 4]
        assert len(convs) == 2
        for t in convs + [
            anchor_of(opt)[i] for i, p in enumerate(opt.param_groups[0]["params"]) if p.dim() == 4
        ]:
            assert t.is_contiguous(memory_format=cl) and not t.is_contiguous(), (
                "lost the channels_last layout"
            )


# --- bf16 + fp16 + fp32 parameters: one flat message per dtype ---------------------------------
class MixedMLP(nn.Module):
    """Three layers in three dtypes (bf16, fp16, fp32 by default)."""

    def __init__(self, dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dtypes = dtypes
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        for layer, dtype in zip((self.a, self.b, self.c), dtypes):
            layer.to(dtype)

    def forward(self, x):
        h = torch.tanh(self.a(x.to(self.dtypes[0])))
        h = torch.tanh(self.b(h.to(self.dtypes[1])))
        return self.c(h.to(self.dtypes[2])).float()


def mixed_step(device: str):
    def step(opt, model, rank, k):
        x, y = batch(rank, k)
        opt.zero_grad()
        ((model(x.to(device)) - y.to(device)) ** 2).mean().backward()
        opt.step()

    return step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base", list(BASES))
def test_bf16_fp16_fp32_parameters(base, device):
    got = run_workers([MixedMLP().to(device) for _ in range(M)], base, mixed_step(device))
    f64 = (torch.float64,) * 3
    assert_ranks_bitwise_equal(got)
    for r in got:
        opt = r["opt"]
        assert [p.dtype for p in opt.param_groups[0]["params"]] == [torch.bfloat16] * 2 + [
            torch.float16
        ] * 2 + [torch.float32] * 2
        if base in ("sgp", "osgp", "dpsgd"):
            groups = opt.base.groups
            assert sorted(str(g.params[0].dtype) for g in groups) == [
                "torch.bfloat16",
                "torch.float16",
                "torch.float32",
            ]
            # The push-sum weight rides in the float32 message (D-PSGD has none).
            assert [g.params[0].dtype for g in groups if g.carries_weight] == (
                [] if base == "dpsgd" else [torch.float32]
            )
    # The float64 hand-written reference (the float64 run of the library for the gossip bases,
    # whose math tests/test_gossip.py checks) to bf16 precision: measured on a CPU, at most 0.01
    # apart after 8 steps, while two different bases (Local SGD vs SGP, D-PSGD, AR-SGD) end
    # 0.05-0.07 apart.
    if base in REFERENCE_BASES:
        want = reference_run(base, lambda: MixedMLP((torch.float64,) * 3), loss_at)
        assert_final_close(got, want, 2e-2)
    else:
        want = run_workers([MixedMLP(f64) for _ in range(M)], base, mixed_step("cpu"))
        for g, w in zip(got, want):
            for a, b in zip(g["final"], w["final"]):
                torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-2)


# --- under horovodrun --------------------------------------------------------------------------
def timeline_activities(path) -> set:
    """Activity names in a Horovod timeline (a JSON array that may lack its closing bracket)."""
    text = open(path).read().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    return {e.get("name") for e in events if isinstance(e, dict) and e.get("ph") == "B"}


#: The largest code of each scaled codec (the block's absmax maps to it).
CODE_MAX = {"int8": 127.0, "fp8": 448.0}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", list(CODE_MAX))
def test_codec_bits_equal_on_device(codec, device):
    """A scaled codec's scale is absmax / code_max rounded once to float32, on every device, so
    the codes and the decoded values are the CPU's bits. Dividing by a Python number, torch on
    CUDA multiplies by the float32 reciprocal instead, one ulp off for many blocks: the H200's
    fp8 run differed from its CPU replay by that ulp (issue 35)."""
    g = torch.Generator().manual_seed(0)
    blocks = 64  # of 256 elements (the default block), magnitudes from 1e-3 to 10
    magnitude = torch.logspace(-3, 1, blocks).repeat_interleave(256)
    x = torch.randn(blocks * 256, generator=g) * magnitude
    amax = x.view(blocks, 256).abs().amax(dim=1)
    # float64 holds a float32 quotient exactly enough (53 >= 2 * 24 + 2 bits) that rounding it
    # to float32 gives the correctly rounded float32 quotient.
    exact = (amax.double() / CODE_MAX[codec]).float()
    by_reciprocal = amax * torch.tensor(1 / CODE_MAX[codec], dtype=torch.float32)
    assert not torch.equal(by_reciprocal, exact), "these blocks would not catch a reciprocal"
    want = encode(x, codec)
    got = encode(x.to(device), codec)
    assert torch.equal(got.scales.cpu(), exact), "not the correctly rounded absmax / code_max"
    assert torch.equal(got.codes.cpu().view(torch.uint8), want.codes.view(torch.uint8))
    assert torch.equal(decode(got, codec).cpu(), decode(want, codec))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("workers", [3, 5, 6, 7])
def test_mean_division_bits_equal_on_device(workers, device):
    """A mean's division by the worker count (torch.distributed's and Horovod's reduce-scatter,
    the sparse exchanges, the weighted merge) is correctly rounded on every device: the CPU
    reference's bits on a GPU too, where dividing by a Python number would multiply by its
    reciprocal (hvd_slowmo/divide.py)."""
    g = torch.Generator().manual_seed(workers)
    x = torch.randn(1 << 16, generator=g) * torch.logspace(-3, 3, 1 << 16)
    exact = (x.double() / workers).float()
    by_reciprocal = x * torch.tensor(1 / workers, dtype=torch.float32)
    assert not torch.equal(by_reciprocal, exact), "these values would not catch a reciprocal"
    got = div_(x.to(device, copy=True), workers)
    assert torch.equal(got.cpu(), exact)
    both = [x.to(device, copy=True), x[:100].to(device, copy=True)]
    foreach_div_(both, workers)
    assert torch.equal(both[0].cpu(), exact) and torch.equal(both[1].cpu(), exact[:100])
    # On the CPU a Python-number divisor is the same division (the library's CPU bits are
    # unchanged by the tensor divisor).
    assert torch.equal(x / workers, exact)


@pytest.mark.horovod
@pytest.mark.parametrize("device", DEVICES)
def test_horovod_average_and_slowmo_on_device_np1(tmp_path, device):
    """One rank: Horovod's grouped average of device tensors runs on NCCL on a GPU (Gloo on the
    CPU); SlowMo over Local SGD trains on the device after hvd.broadcast_parameters."""
    timeline = tmp_path / "timeline.json"
    horovodrun(
        1,
        "gloo",
        [WORKER, "single", str(tmp_path), device],
        env={"HOROVOD_TIMELINE": str(timeline)},
    )
    result = json.loads((tmp_path / "single.json").read_text())
    assert result["average_is_identity"] and result["average_on_device"], result
    assert (
        result["counters"] == [STEPS, STEPS % TAU, STEPS // TAU]
        and result["exact_averages"] == STEPS // TAU
    )
    assert result["anchor_on_device"] and result["finite"], result
    backend = "NCCL_ALLREDUCE" if device == "cuda" else "GLOO_ALLREDUCE"
    if device == "cuda":
        assert result["nccl_built"] > 0, (
            "this Horovod has no NCCL: build it with install_horovod.sh --gpu yes"
        )
    activities = timeline_activities(timeline)
    assert backend in activities, f"{backend} not in Horovod's timeline: {sorted(activities)}"


def check_bases_run(out_dir, np_):
    """The files of cuda_worker.py's ``bases`` mode against the thread-worker replay on the CPU."""
    for base in ("localsgd", "allreduce", "sgp", "osgp", "dpsgd"):
        got = [torch.load(out_dir / f"{base}.rank{r}.pt") for r in range(np_)]
        assert_ranks_bitwise_equal(got)
        assert got[0]["counters"] == [STEPS, STEPS % TAU, STEPS // TAU]
        if base == "osgp":
            continue  # real OSGP mixes whatever has arrived: not reproducible; the checks above
        want = run_workers(
            [make_model().double() for _ in range(np_)], base, plain_step("cpu", torch.float64)
        )
        for g, w in zip(got, want):
            for a, b in zip(g["snaps"] + [g["final"]], w["snaps"] + [w["final"]]):
                for x, y in zip(a, b):
                    torch.testing.assert_close(
                        x, y, rtol=1e-10, atol=1e-12, msg=lambda m, base=base: f"{base}: {m}"
                    )


@pytest.mark.horovod
@pytest.mark.timeout(600)
def test_every_base_under_horovodrun_cpu(tmp_path):
    """The CPU counterpart of the shared-GPU check below: two ranks, Gloo, this venv's Horovod."""
    horovodrun(2, "gloo", [WORKER, "bases", str(tmp_path), "cpu"], timeout=540)
    check_bases_run(tmp_path, 2)


STAGED = os.environ.get("HVD_SLOWMO_STAGED_HOROVOD")
NO_STAGED = NO_CUDA or (
    None
    if STAGED
    else "HVD_SLOWMO_STAGED_HOROVOD is not set: point it at a Horovod built "
    "with scripts/install_horovod.sh --gpu staged --target DIR (gpu_check.sh does)"
)


@pytest.mark.cuda
@pytest.mark.horovod
@pytest.mark.timeout(600)
@pytest.mark.skipif(NO_STAGED is not None, reason=str(NO_STAGED))
def test_staged_horovod_two_ranks_share_one_gpu(tmp_path):
    """NCCL refuses two ranks on one device; a Horovod built without GPU operations copies CUDA
    tensors to host memory for every collective, so two ranks can share the GPU."""
    staged_horovodrun(2, [WORKER, "bases", str(tmp_path), "cuda"])
    check_bases_run(tmp_path, 2)


def staged_horovodrun(np_: int, args: list[str]) -> None:
    """``horovodrun -np NP --gloo python ARGS`` with the staged Horovod first on the path."""
    cmd = [
        sys.executable,
        os.path.join(STAGED, "bin", "horovodrun"),
        "-np",
        str(np_),
        "-H",
        f"localhost:{np_}",
        "--gloo",
        sys.executable,
        *args,
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=launch_env({"PYTHONPATH": f"{STAGED}{os.pathsep}{ROOT}"}),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# --- several processes on one device: tests/device_run.py's features ----------------------
#: How far a CUDA run may be from the CPU replay, per feature: (rtol, atol, why). The CPU runs
#: must equal it bitwise (the same kernels; two workers' sums are the same in any order).
CUDA_TOLERANCE = {
    name: (
        (1e-9, 1e-11, "float64 on both devices: only the kernels' summation order differs; "
         "the codecs' float32 payload is rounded from values equal to ~1e-16, and their "
         "scales are the same bits on both (test_codec_bits_equal_on_device)")
        if f64
        else (0.0, 5e-3, "fp16 autocast: the GPU's fp16 GEMMs accumulate in another order than "
              "the CPU's, so activations differ by fp16 ulps (2^-11 relative); 10 steps at "
              "lr <= 0.1 keep the parameters within 5e-3")
    )
    for name, (_, f64) in FEATURES.items()
}  # fmt: skip


@functools.cache
def feature_replay() -> dict:
    """The CPU replay of every feature on two thread workers: ``{name: [rank 0, rank 1]}``, with
    one thread per worker as in the processes (so the CPU kernels are the same)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name in FEATURES:
            models = [feature_model(name) for _ in range(2)]
            out[name] = run_threads(
                2,
                lambda comm, name=name, models=models: run_feature(
                    name, "cpu", comm.rank, comm, models[comm.rank]
                ),
            )
        return out
    finally:
        torch.set_num_threads(before)


def check_features(out_dir, device: str) -> None:
    """The files of cuda_worker.py's ``features`` mode (two ranks) against the CPU replay."""
    got = [torch.load(out_dir / f"features.rank{r}.pt", weights_only=False) for r in range(2)]
    want = feature_replay()
    for name in FEATURES:
        runs = [g[name] for g in got]
        # The anchor is an exact average (or its slow update): the same bits on both ranks.
        for step, (a, b) in enumerate(zip(runs[0]["anchors"], runs[1]["anchors"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{name}: step {step}"
        rtol, atol, why = CUDA_TOLERANCE[name]
        for rank, (g, w) in enumerate(zip(runs, want[name])):
            where = f"{name} rank {rank} on {device}"
            assert g["counters"] == w["counters"], where
            assert (g["skipped_steps"], g["scale"]) == (w["skipped_steps"], w["scale"]), where
            assert len(g["anchors"]) == len(w["anchors"]) and g["final"], where
            pairs = [
                (x, y, f"{where} step {k}")
                for k, (a, b) in enumerate(zip(g["anchors"], w["anchors"]))
                for x, y in zip(a, b)
            ] + [(x, y, f"{where} final") for x, y in zip(g["final"], w["final"])]
            for x, y, what in pairs:
                if device == "cpu":
                    assert torch.equal(x, y), f"{what}: not bitwise the CPU replay"
                else:
                    label = f"{what} ({why})"
                    torch.testing.assert_close(
                        x, y, rtol=rtol, atol=atol, msg=lambda m, label=label: f"{label}: {m}"
                    )
    # AMP: the forced overflows were skipped on every rank, rank 1's scale backed off, and
    # the other steps trained.
    amp = [g["arsgd-amp"] for g in got]
    applied = FEATURE_STEPS - len(AMP_OVERFLOWS)
    assert all(r["skipped_steps"] == len(AMP_OVERFLOWS) for r in amp), "every rank skips"
    assert amp[0]["counters"] == (applied, applied % 3, applied // 3)
    assert amp[AMP_BAD_RANK]["scale"] == AMP_INIT_SCALE * 0.5 ** len(AMP_OVERFLOWS)
    assert not torch.equal(amp[0]["final"][0], next(mlp().parameters()).detach()), "no training"


@pytest.mark.torchdist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
def test_two_processes_torch_distributed_gloo(tmp_path, device):
    """torchrun, two processes over Gloo (on a GPU both share it: Gloo copies CUDA tensors
    through host memory)."""
    # Loopback for Gloo: a GPU machine without network may not resolve its own hostname.
    torchrun(
        2,
        [WORKER, "features", str(tmp_path), device],
        timeout=540,
        env={"GLOO_SOCKET_IFNAME": "lo"},
    )
    check_features(tmp_path, device)


ISLANDS = os.path.join(os.path.dirname(__file__), "islands_run.py")


@pytest.mark.torchdist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["fragments", "ddp"], ids=["fsdp", "ddp"])
@pytest.mark.parametrize("device", DEVICES)
def test_two_islands_on_the_device(tmp_path, device, case):
    """Islands (worker=Islands(mesh)): 2 islands of one rank each under torchrun, FSDP2 (with
    fragments, overlap and eager updates) or DDP inside, on the device (on a GPU both ranks
    share it through Gloo); each equals the unsharded 2-worker run beside it (tests/islands_run.py),
    and the ranks' outer states are bitwise identical at every step."""
    torchrun(
        2,
        [ISLANDS, str(tmp_path), case, "12", "full", device],
        timeout=540,
        env={"GLOO_SOCKET_IFNAME": "lo"},
    )
    for rank in range(2):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(rec["diffs"]) == 12 and max(rec["diffs"]) <= 1e-6, rec["diffs"]
        assert all(rec["bitwise"]), rec["bitwise"]


def test_check_features_catches_one_ulp(tmp_path):
    """The comparison of the two-process runs is not vacuous: the replay itself passes, and one
    parameter moved by one ulp on one rank fails it (bitwise on the CPU; on a GPU only beyond the
    stated tolerance)."""
    want = feature_replay()
    for r in range(2):
        torch.save({n: want[n][r] for n in FEATURES}, tmp_path / f"features.rank{r}.pt")
    check_features(tmp_path, "cpu")
    bad = {n: {**want[n][1], "final": [t.clone() for t in want[n][1]["final"]]} for n in FEATURES}
    t = bad["int8-fragments-overlap"]["final"][0]
    t.view(-1)[0] = torch.nextafter(t.view(-1)[0], torch.tensor(1.0, dtype=t.dtype))
    torch.save(bad, tmp_path / "features.rank1.pt")
    with pytest.raises(AssertionError, match="int8-fragments-overlap rank 1 on cpu final"):
        check_features(tmp_path, "cpu")
    check_features(tmp_path, "cuda")  # one ulp of float64 is far inside rtol=1e-9
    t.view(-1)[0] += 1e-6
    torch.save(bad, tmp_path / "features.rank1.pt")
    with pytest.raises(AssertionError, match="float64 on both devices"):
        check_features(tmp_path, "cuda")


@pytest.mark.horovod
@pytest.mark.timeout(600)
def test_two_processes_horovod_cpu(tmp_path):
    """The CPU counterpart of the staged case below: horovodrun -np 2 --gloo, this venv's
    Horovod."""
    horovodrun(2, "gloo", [WORKER, "features", str(tmp_path), "cpu"], timeout=540)
    check_features(tmp_path, "cpu")


@pytest.mark.cuda
@pytest.mark.horovod
@pytest.mark.timeout(600)
@pytest.mark.skipif(NO_STAGED is not None, reason=str(NO_STAGED))
def test_staged_horovod_two_processes_features(tmp_path):
    """Two ranks on one GPU through the staged Horovod (CUDA tensors copied to host memory)."""
    staged_horovodrun(2, [WORKER, "features", str(tmp_path), "cuda"])
    check_features(tmp_path, "cuda")


EXAMPLES = {
    "cifar10_resnet18": ["--algo", "localsgd", "--slowmo", "--tau", "2", "--batch-size", "16"],
    "imagenet_resnet50": ["--algo", "allreduce", "--no-slowmo", "--batch-size", "8"],
    "translation_transformer": [
        "--algo",
        "localsgd",
        "--slowmo",
        "--tau",
        "2",
        "--batch-size",
        "16",
    ],
}
EXAMPLE_CASES = [pytest.param("cpu", "cifar10_resnet18", id="cpu-cifar10_resnet18")] + [
    pytest.param("cuda", name, id=f"cuda-{name}", marks=CUDA_MARKS) for name in EXAMPLES
]


@pytest.mark.horovod
@pytest.mark.timeout(600)
@pytest.mark.parametrize("device,example", EXAMPLE_CASES)
def test_example_with_amp(tmp_path, device, example):
    """``--amp``: fp16 autocast + GradScaler on a GPU, bf16 autocast on a CPU; one rank per GPU."""
    summary = tmp_path / "summary.json"
    horovodrun(
        1,
        "gloo",
        [
            os.path.join(ROOT, "examples", f"{example}.py"),
            "--synthetic",
            "--amp",
            "--epochs",
            "1",
            "--max-steps",
            "4",
            "--log-every",
            "2",
            "--logdir",
            str(tmp_path / "runs"),
            "--no-progress",
            "--summary-json",
            str(summary),
        ]
        + EXAMPLES[example],
        timeout=540,
        env={"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else None,
    )
    result = json.loads(summary.read_text())
    # Early fp16 iterations may overflow and skip their step: at least one of 4 must apply.
    assert result["workers"] == 1 and 1 <= result["steps"] <= 4, result
    assert result["train_loss"] is not None and result["train_loss"] == result["train_loss"], result


# --- the benchmark ---------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_gpu_benchmark_runs_tiny_on_cpu():
    """benchmarks/gpu_resnet50.py end to end with --tiny on the CPU: every row, every target."""
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "gpu_resnet50.py"),
            "--tiny",
            "--device",
            "cpu",
        ],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in proc.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| optimizer")
    }
    for name in (
        "plain torch",
        "torch DDP",
        "Horovod DistributedOptimizer",
        "Local SGD + SlowMo",
        "AR-SGD + SlowMo",
    ):
        assert float(rows[name][0]) > 0, (name, rows)
        assert rows[name][3] == "n/a (CPU)"
    assert rows["plain torch"][2] == "1.000x"
    assert float(rows["slow momentum step / one base step"][0].split("x")[0]) > 0
    assert rows["SlowMo state / parameter bytes"] == ["2.00x", "exactly 2x", "yes"]
    assert (
        "tiny ResNet (2 bottlenecks)" in proc.stdout
        and "bf16 autocast, channels_last" in proc.stdout
    )


@pytest.mark.timeout(300)
def test_codec_cost_runs_tiny_on_cpu(tmp_path):
    """benchmarks/codec_cost.py at a tiny size on the CPU: a row per codec with positive times,
    the wire size each codec promises, the same rows in the table and the JSON file."""
    from hvd_slowmo.compression import SparseCodec, encoded_nbytes, packet_nbytes

    out = tmp_path / "codec.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "codec_cost.py"),
            "--mb",
            "0.05",
            "--repeats",
            "2",
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["codec"]: r for r in result["rows"]}
    n = int(0.05 * 2**20 / 4)
    for codec in ("fp16", "bf16", "int8", "fp8"):
        r = rows[codec]
        assert r["device"] == "cpu" and "error" not in r, r
        for key in ("encode_ms_per_mb", "decode_ms_per_mb", "mean_ms_per_mb"):
            assert r[key] > 0, (codec, key, r)
        assert r["wire_bytes_per_fp32_byte"] == encoded_nbytes(n, codec) / (4 * n)
        assert f"| {codec} | cpu | {r['encode_ms_per_mb']:.4f} |" in proc.stdout
        for step in ("encode", "decode", "mean"):  # each step beside the copy of the same run
            want = r[f"{step}_ms_per_mb"] / r["copy_ms_per_mb"]
            assert r[f"{step}_per_copy"] == pytest.approx(want), (codec, step, r)
            assert f"| {r[f'{step}_per_copy']:.1f}x |" in proc.stdout
    assert "uptime before:" in proc.stdout and "uptime after:" in proc.stdout
    assert "load average" in result["uptime_before"] and "load average" in result["uptime_after"]
    # The sparse codec (its defaults) is measured too: the error feedback, encode and the sum
    # of the gathered packets.
    r = rows["sparse"]
    assert r["device"] == "cpu" and "error" not in r, r
    assert all(r[key] > 0 for key in ("encode_ms_per_mb", "decode_ms_per_mb", "mean_ms_per_mb"))
    assert r["wire_bytes_per_fp32_byte"] == packet_nbytes(n, SparseCodec()) / (4 * n)
    assert "fp32" not in rows


def test_timing_beside_runs_the_flush_before_every_timed_call():
    """benchmarks/bench_timing.py: with ``before``, each timed call of the work and of its
    baseline comes right after one call of it (and the untimed warm-up calls after none)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from bench_timing import cache_flusher, median_ms_beside
    finally:
        sys.path.pop(0)
    calls: list[str] = []
    median_ms_beside(
        lambda: calls.append("fn"),
        lambda: calls.append("copy"),
        3,
        torch.device("cpu"),
        before=lambda: calls.append("flush"),
    )
    assert calls == ["fn", "copy"] + ["flush", "fn", "flush", "copy"] * 3
    flush = cache_flusher(1.0, torch.device("cpu"))
    assert flush().numel() == 2**18  # 1 MB of float32 written
