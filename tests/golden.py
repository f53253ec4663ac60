"""Golden trajectories: what the optimizer did, step by step, before a refactor of its outer step.

Each scenario trains thread workers (the in-process communicator, whose sums run in rank order,
so results are deterministic) and records, after every step and on every rank, a SHA-256 of the
parameters, model buffers, base optimizer state, slow state (anchor, slow buffer, outer
optimizer state, or this rank's shards) and the step counters. ``tests/data/golden.json`` holds
the digests recorded with the code before the outer-step refactor; ``tests/test_golden.py``
checks that today's code reproduces every one of them bit for bit.

Regenerate (only when a change of trajectory is intended, and say why in the commit)::

    python tests/golden.py --write
"""

import argparse
import hashlib
import io
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.base import Communicator, PendingAverage, PendingExchange
from hvd_slowmo.comm.hierarchy import Hierarchy
from hvd_slowmo.comm.local import run_threads

from helpers import ForwardingCommunicator
from reference import batch, lr_at, make_model

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden.json")
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


def _digest(opt: DistributedOptimizer, model: nn.Module) -> str:
    h = hashlib.sha256()
    tensors: list[Tensor] = [p.detach() for p in model.parameters()]
    tensors += [b for b in model.buffers()]
    for p in opt.params:
        for v in opt.optimizer.state.get(p, {}).values():
            if isinstance(v, Tensor):
                tensors.append(v)
    tensors += opt.slow_state.state_tensors()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    h.update(repr((opt.num_steps, opt.inner_step, opt.outer_steps)).encode())
    weight = getattr(opt.base, "ps_weight", None)
    if weight is not None:
        h.update(repr(float(weight)).encode())
    return h.hexdigest()[:16]


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
    out: list[str],
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
        out.append(_digest(opt, model))


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


def run_scenario(spec: dict[str, Any], saved_states: list[bytes] | None = None) -> list[list[str]]:
    """Every rank's digests after every step (a resume scenario saves and reloads mid-run).

    Args:
        spec: the scenario.
        saved_states: for a resume scenario, each rank's saved ``{"model", "opt"}`` to resume
            from instead of the one this run saves (a state of an earlier format); the digests
            before the resume are then the recorded ones.
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

        def second(comm: Communicator) -> list[str]:
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


def record(select: Callable[[str], bool] = lambda _: True) -> dict[str, list[list[str]]]:
    """Run the selected scenarios; name -> per-rank digests."""
    return {name: run_scenario(spec) for name, spec in SCENARIOS.items() if select(name)}


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
    parser.add_argument("--write", action="store_true", help=f"write {PATH}")
    parser.add_argument(
        "--write-states", type=int, metavar="VERSION", help="save the resume scenarios' states"
    )
    args = parser.parse_args()
    if args.write_states:
        write_states(args.write_states)
        return
    got = record()
    if args.write:
        os.makedirs(os.path.dirname(PATH), exist_ok=True)
        with open(PATH, "w", encoding="utf-8") as f:
            json.dump(got, f, indent=0, sort_keys=True)
        print(f"wrote {len(got)} scenarios to {PATH}")
    else:
        print(json.dumps({k: v[0][-1] for k, v in got.items()}, indent=1))


if __name__ == "__main__":
    main()
