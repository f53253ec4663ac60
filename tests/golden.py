"""Golden trajectories: what the optimizer did, step by step, recorded as values.

Each scenario trains thread workers (the in-process communicator, whose sums run in rank order,
so results are deterministic on one machine) and records, after every step and on every rank,
the values of the parameters, model buffers, base optimizer state, slow state (anchor, slow
buffer, outer optimizer state, or this rank's shards), the push-sum weight, and, exactly, the
step counters and integer buffers. ``tests/data/golden_values.pt.xz`` holds them;
``tests/test_golden.py`` checks that today's code reproduces every value within
:data:`RTOL`/:data:`ATOL` and every counter exactly.

Why values and a tolerance, not digests of the bytes: the trajectories are bit for bit
reproducible on one machine, but another CPU (or ``ATEN_CPU_CAPABILITY=default``, another kernel
path on this one) rounds matrix products and reductions differently, so the last bits differ.
The tolerance comes from that arithmetic, measured (``--deviation``; docs/portability.md).

The values replace SHA-256 digests of the same state recorded (commit 9014093) before the outer
step's refactor. Those digests held only on the machine that recorded them; on the machine that
recorded these values (AMD EPYC, AVX2, torch 2.14.1) the code of 9014093 and the code that
recorded the values gave the same digests in all 60 scenarios, so these are the same
trajectories.

Record again (only when a change of trajectory is intended; say why in the commit)::

    python tests/golden.py --write

How far today's run is from the records, per scenario (to set or check the tolerance; run it
under ``ATEN_CPU_CAPABILITY=default`` too)::

    python tests/golden.py --deviation
"""

import argparse
import io
import lzma
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.base import Communicator, PendingAverage, PendingExchange
from hvd_slowmo.comm.hierarchy import Hierarchy
from hvd_slowmo.comm.local import run_threads

from helpers import ForwardingCommunicator, state_tensors_of
from reference import batch, lr_at, make_model

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden_values.pt.xz")
STEPS = 14


class _Arrived(PendingExchange):
    """A gossip exchange that is always complete when asked (``done()`` waits for it), so OSGP
    mixes every message at its first chance, whatever the threads' timing."""

    def __init__(self, inner: PendingExchange) -> None:
        self.inner = inner

    def done(self) -> bool:
        while not self.inner.done():
            time.sleep(1e-5)
        return True

    def wait(self) -> dict[int, Tensor]:
        return self.inner.wait()


class InFlight(ForwardingCommunicator):
    """Averages stay in flight until ``wait()`` (reading a tensor early would show), and gossip
    messages have always arrived (deterministic OSGP)."""

    def average_start(self, tensors, name):  # type: ignore[no-untyped-def]
        tensors = list(tensors)
        return PendingAverage(lambda: self.inner.average_(tensors, name))

    def exchange_start(self, sends, recv_from, tag, graph_key=None):  # type: ignore[no-untyped-def]
        return _Arrived(self.inner.exchange_start(sends, recv_from, tag, graph_key))


class Snapshot(NamedTuple):
    """One rank's state after one step.

    Attributes:
        values: every floating-point number, in a fixed order, as float32: parameters, model
            buffers, base optimizer state, slow state, then the push-sum weight (gossip bases).
        counters: every integer, compared exactly: the optimizer's step counters, then the
            integer buffers and optimizer state (BatchNorm's ``num_batches_tracked``).
    """

    values: Tensor
    counters: Tensor


#: One scenario's record: ``trajectory[rank][step]``.
Trajectory = list[list[Snapshot]]


def _snapshot(opt: DistributedOptimizer, model: nn.Module) -> Snapshot:
    tensors: list[Tensor] = [p.detach() for p in model.parameters()]
    tensors += [b for b in model.buffers()]
    for p in opt.params:
        for v in opt.optimizer.state.get(p, {}).values():
            if isinstance(v, Tensor):
                tensors.append(v)
    tensors += state_tensors_of(opt)
    floats = [t.detach().cpu().reshape(-1).float() for t in tensors if t.is_floating_point()]
    weight = getattr(opt.base, "ps_weight", None)
    if weight is not None:
        floats.append(torch.tensor([float(weight)]))
    ints = [torch.tensor([opt.num_steps, opt.inner_step, opt.outer_steps])]
    ints += [t.detach().cpu().reshape(-1).long() for t in tensors if not t.is_floating_point()]
    return Snapshot(torch.cat(floats), torch.cat(ints))


#: The records' tolerance (``torch.testing.assert_close``: ``|got - want| <= ATOL + RTOL * |want|``,
#: NaN where the record has NaN).
#: The values are float32 (one unit in the last place: 1.2e-7 relative); another kernel path
#: sums matrix products, means and BatchNorm's statistics in another order, a few ulps per
#: operation, and 14 steps of training (momentum 0.9, Adam's division by sqrt(v), the slow
#: step's division by lr) carry and grow that rounding. Measured with ``--deviation`` between
#: this machine's AVX2 kernels and ``ATEN_CPU_CAPABILITY=default``: at most 1.1e-5 absolute over
#: all 60 scenarios (values of order 1: about 100 ulps). 1e-4 leaves 10x headroom for other
#: CPUs, and stays 15 to 50 times below what a change of the slow step by one part in a thousand
#: moves (beta or alpha times 1.001: 1.6e-3 to 5.4e-3; tests/test_golden.py checks it fails).
RTOL = 1e-4
ATOL = 1e-4

#: How many of a snapshot's first values are the model's parameters (the same on every
#: scenario: :func:`reference.make_model`).
NUM_PARAMS = sum(p.numel() for p in make_model().parameters())


def _groups(model: nn.Module, two: bool) -> Any:
    if not two:
        return model.parameters()
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "lr": 0.03}]


def _set_lrs(opt: DistributedOptimizer, k: int, two: bool) -> None:
    for g, group in enumerate(opt.param_groups):
        # Two groups on different schedules (not a power-of-two ratio), so a wrong group shows.
        group["lr"] = lr_at(k) if g == 0 or not two else 0.03 * (1.0 + 0.3 * (k // 5))


def _inf_at_0_0(grad: Tensor) -> Tensor:
    out = grad.clone()
    out[0, 0] = float("inf")
    return out


def _train(
    opt: DistributedOptimizer,
    model: nn.Module,
    rank: int,
    start: int,
    stop: int,
    spec: dict[str, Any],
    out: list[Snapshot],
) -> None:
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=2.0**10)
        if spec.get("amp_skip") is not None
        else None
    )
    for k in range(start, stop):
        _set_lrs(opt, k, spec.get("two_groups", False))
        opt.zero_grad()
        x, y = batch(rank, k)
        loss = ((model(x) - y) ** 2).mean()
        hook = None
        if scaler is not None and k == spec["amp_skip"] and rank == 1:
            # Inside backward, where an overflow happens: AR-SGD averages during backward.
            hook = next(model.parameters()).register_hook(_inf_at_0_0)
        (scaler.scale(loss) if scaler else loss).backward()
        if hook is not None:
            hook.remove()
        if spec.get("nan_at") == k and rank == 1:
            next(model.parameters()).grad.fill_(float("nan"))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        out.append(_snapshot(opt, model))


def _build(comm: Communicator, model: nn.Module, spec: dict[str, Any]) -> DistributedOptimizer:
    kwargs = dict(spec["kwargs"])
    if spec.get("node"):
        r = comm.world.split([[0, 1], [2, 3]])[comm.rank]  # type: ignore[attr-defined]
        c = comm.world.split([[0, 2], [1, 3]])[comm.rank]  # type: ignore[attr-defined]
        kwargs["worker"] = Hierarchy(node=r, cross=c)
    opt_cls = torch.optim.Adam if spec.get("adam") else None
    base_opt = (
        opt_cls(_groups(model, spec.get("two_groups", False)), lr=0.01)
        if opt_cls
        else torch.optim.SGD(
            _groups(model, spec.get("two_groups", False)), lr=0.05, momentum=0.9, nesterov=True
        )
    )
    return DistributedOptimizer(
        base_opt,
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        communicator=InFlight(comm),
        **kwargs,
    )


def run_scenario(spec: dict[str, Any], saved_states: list[bytes] | None = None) -> Trajectory:
    """Every rank's snapshot after every step (a resume scenario saves and reloads mid-run).

    Args:
        spec: the scenario.
        saved_states: for a resume scenario, each rank's saved ``{"model", "opt"}`` to resume
            from instead of the one this run saves (a state of an earlier format); the snapshots
            before the resume are then this run's own.
    """
    m = spec.get("m", 3)
    models = [make_model() for _ in range(m)]
    stop = spec.get("resume_at")

    def whole(comm: Communicator) -> Any:
        model, out = models[comm.rank], []
        opt = _build(comm, model, spec)
        _train(opt, model, comm.rank, 0, stop or STEPS, spec, out)
        if stop is None:
            return out
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        return out, buf.getvalue()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = run_threads(m, whole)
        if stop is None:
            return first
        fresh = [make_model(seed=123) for _ in range(m)]

        def second(comm: Communicator) -> list[Snapshot]:
            out, saved = first[comm.rank]
            if saved_states is not None:
                saved = saved_states[comm.rank]
            ckpt = torch.load(io.BytesIO(saved), weights_only=False)
            model = fresh[comm.rank]
            model.load_state_dict(ckpt["model"])
            opt = _build(comm, model, spec)
            opt.load_state_dict(ckpt["opt"])
            out = list(out)
            _train(opt, model, comm.rank, stop, STEPS, spec, out)
            return out

        return run_threads(m, second)


def _scenarios() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    slow = dict(tau=4, slow_lr=0.7, slow_momentum=0.6)
    for base in ("localsgd", "allreduce", "sgp", "osgp", "dpsgd"):
        for d in (0, 1, 2):
            out[f"{base}-d{d}"] = {"kwargs": dict(slow, base=base, overlap=d)}
    for buffers in ("maintain", "average"):
        for d in (0, 1, 2):
            out[f"buffers-{buffers}-d{d}"] = {"kwargs": dict(slow, buffers=buffers, overlap=d)}
            out[f"adam-{buffers}-d{d}"] = {
                "kwargs": dict(slow, buffers=buffers, overlap=d),
                "adam": True,
            }
    for d in (0, 1, 2):
        out[f"sharded-d{d}"] = {"kwargs": dict(slow, shard_slow_state=True, overlap=d)}
        out[f"two-groups-d{d}"] = {"kwargs": dict(slow, overlap=d), "two_groups": True}
        out[f"sharded-two-groups-d{d}"] = {
            "kwargs": dict(slow, overlap=d, shard_slow_state=True),
            "two_groups": True,
        }
    for d in (0, 1):
        out[f"node-d{d}"] = {"kwargs": dict(slow, overlap=d), "node": True, "m": 4}
        out[f"node-sgp-d{d}"] = {"kwargs": dict(slow, base="sgp", overlap=d), "node": True, "m": 4}
        out[f"amp-localsgd-d{d}"] = {"kwargs": dict(slow, overlap=d), "amp_skip": 5}
        out[f"amp-allreduce-d{d}"] = {
            "kwargs": dict(slow, base="allreduce", overlap=d),
            "amp_skip": 4,
        }
        out[f"nan-skip-d{d}"] = {"kwargs": dict(slow, overlap=d, nonfinite="skip"), "nan_at": 6}
        out[f"nesterov-outer-d{d}"] = {"kwargs": dict(slow, overlap=d, outer_optimizer="nesterov")}
        out[f"sgp-noaverage-d{d}"] = {"kwargs": dict(slow, base="sgp", overlap=d, average=False)}
        out[f"plain-localsgd-d{d}"] = {
            "kwargs": dict(tau=4, slow_lr=1.0, slow_momentum=0.0, overlap=d)
        }
    for kind, extra in (("full", {}), ("sharded", {"shard_slow_state": True}),
                        ("average", {"buffers": "average"}), ("sgp", {"base": "sgp"})):  # fmt: skip
        # Saved at step 9: the boundary at 8 is in flight (lands at 10).
        out[f"resume-in-flight-{kind}"] = {"kwargs": dict(slow, overlap=2, **extra), "resume_at": 9}
        out[f"resume-inner-{kind}"] = {"kwargs": dict(slow, overlap=0, **extra), "resume_at": 6}
    return out


SCENARIOS = _scenarios()


def record(select: Callable[[str], bool] = lambda _: True) -> dict[str, Trajectory]:
    """Run the selected scenarios; name -> every rank's snapshot after every step.

    Args:
        select: which scenario names to run.
    """
    return {name: run_scenario(spec) for name, spec in SCENARIOS.items() if select(name)}


def save(records: dict[str, Trajectory], path: str = PATH) -> None:
    """Write records compactly: per scenario, every snapshot's values concatenated (float32)
    with their lengths, and the same for the counters (lengths vary: optimizer state appears
    after the first step, the anchor at the first capture).

    Args:
        records: what :func:`record` returned.
        path: the file.
    """
    out = {}
    for name, traj in records.items():
        flat = [snap for rank in traj for snap in rank]
        out[name] = {
            "shape": (len(traj), len(traj[0])),
            "values": torch.cat([s.values for s in flat]),
            "value_sizes": torch.tensor([s.values.numel() for s in flat]),
            "counters": torch.cat([s.counters for s in flat]),
            "counter_sizes": torch.tensor([s.counters.numel() for s in flat]),
        }
    buf = io.BytesIO()
    torch.save(out, buf)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # xz: ranks hold equal values after every exact average, which it stores once (2.1 MB -> 0.4).
    with open(path, "wb") as f:
        f.write(lzma.compress(buf.getvalue(), preset=9))


def load(path: str = PATH) -> dict[str, Trajectory]:
    """The records :func:`save` wrote.

    Args:
        path: the file.
    """
    out = {}
    with open(path, "rb") as f:
        raw = lzma.decompress(f.read())
    for name, rec in torch.load(io.BytesIO(raw), weights_only=True).items():
        ranks, steps = rec["shape"]
        values = rec["values"].split(rec["value_sizes"].tolist())
        counters = rec["counters"].split(rec["counter_sizes"].tolist())
        snaps = [Snapshot(v, c) for v, c in zip(values, counters)]
        out[name] = [snaps[r * steps : (r + 1) * steps] for r in range(ranks)]
    return out


def assert_matches(got: Trajectory, want: Trajectory, rtol: float, atol: float) -> None:
    """Every counter equal and every value close (``torch.testing.assert_close``; a NaN where the
    record has one: the non-finite scenarios), rank by rank
    and step by step; the message names the first rank and step that differ.

    Args:
        got: this run's trajectory.
        want: the recorded one.
        rtol: relative tolerance.
        atol: absolute tolerance.
    """
    shape = [len(r) for r in got]
    assert shape == [len(r) for r in want], f"ranks x steps {shape} != {[len(r) for r in want]}"
    for step in range(len(got[0])):
        for rank in range(len(got)):
            g, w = got[rank][step], want[rank][step]
            where = f"rank {rank} after step {step}"
            torch.testing.assert_close(
                g.counters, w.counters, rtol=0, atol=0, msg=f"{where}: counters differ"
            )
            try:
                torch.testing.assert_close(g.values, w.values, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as e:
                raise AssertionError(f"{where}: values differ: {e}") from None


def deviation(got: Trajectory, want: Trajectory) -> tuple[float, float]:
    """The largest ``|got - want|`` over every value of a scenario, and the largest
    ``|got - want| / |want|`` over the values that are not tiny (``|want| > 1e-3``); NaN in both
    counts as equal.

    Args:
        got: this run's trajectory.
        want: the recorded one.
    """
    worst_abs = worst_rel = 0.0
    for g_rank, w_rank in zip(got, want):
        for g, w in zip(g_rank, w_rank):
            diff = (g.values.double() - w.values.double()).abs()
            # NaN in both: equal (a non-finite scenario); NaN in one: infinitely far.
            diff[g.values.isnan() & w.values.isnan()] = 0.0
            diff = diff.nan_to_num(nan=float("inf"))
            worst_abs = max(worst_abs, float(diff.max()))
            big = w.values.abs() > 1e-3
            if big.any():
                worst_rel = max(worst_rel, float((diff[big] / w.values[big].double().abs()).max()))
    return worst_abs, worst_rel


def saved_state_path(name: str, rank: int, version: int) -> str:
    """Where rank ``rank``'s state of resume scenario ``name``, in format ``version``, is kept."""
    return os.path.join(os.path.dirname(PATH), f"state_v{version}", f"{name}-rank{rank}.pt")


def _save_state(name: str, spec: dict[str, Any], version: int) -> None:
    m = spec.get("m", 3)
    models = [make_model() for _ in range(m)]

    def save(comm: Communicator) -> None:
        model = models[comm.rank]
        opt = _build(comm, model, spec)
        _train(opt, model, comm.rank, 0, spec["resume_at"], spec, [])
        path = saved_state_path(name, comm.rank, version)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_threads(m, save)


def write_states(version: int) -> None:
    """Save every resume scenario's mid-run states with today's code (format ``version``), so a
    later format's loader can be tested on them."""
    for name, spec in SCENARIOS.items():
        if "resume_at" in spec:
            _save_state(name, spec, version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"record every scenario into {PATH}")
    parser.add_argument(
        "--deviation",
        action="store_true",
        help="run every scenario and print its largest deviation from the records",
    )
    parser.add_argument(
        "--write-states", type=int, metavar="VERSION", help="save the resume scenarios' states"
    )
    args = parser.parse_args()
    if args.write_states:
        write_states(args.write_states)
    elif args.write:
        got = record()
        save(got)
        print(f"wrote {len(got)} scenarios to {PATH} ({os.path.getsize(PATH)} bytes)")
    elif args.deviation:
        want = load()
        cpu = torch.backends.cpu.get_cpu_capability()
        print(f"cpu capability {cpu}, torch {torch.__version__}")
        worst_abs = worst_rel = 0.0
        for name, traj in record().items():
            dev_abs, dev_rel = deviation(traj, want[name])
            worst_abs, worst_rel = max(worst_abs, dev_abs), max(worst_rel, dev_rel)
            print(f"{name:28s} max abs {dev_abs:.3g}  max rel {dev_rel:.3g}")
        print(f"{'all':28s} max abs {worst_abs:.3g}  max rel {worst_rel:.3g}")
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
