"""Harnesses shared by the test files: a communicator that forwards to another (to change one
behaviour, or to swap the world under an optimizer as hvd.elastic does) and the resume harness
(stop in the middle of an inner loop, reload in fresh workers, compare to an uninterrupted run).

Test files import them by name (``from helpers import ForwardingCommunicator``): pytest puts
this folder on ``sys.path``, as it does for ``reference.py`` and ``horovod_launch.py``.
"""

import io
import os
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.base import (
    ByteCounter,
    Communicator,
    PendingAverage,
    PendingExchange,
    PendingTensors,
)
from hvd_slowmo.comm.local import run_threads

from reference import loss_at, lr_at, make_model, params_of

__all__ = ["ForwardingCommunicator", "assert_same_models", "resume_in_fresh_workers"]


class ForwardingCommunicator(Communicator):
    """Every operation goes to ``inner``, which may be replaced at any time (as Horovod's world
    is when hvd.elastic re-initializes); subclasses override the one operation they change.

    Args:
        inner: the communicator that does the work (its byte counter is this one's).
    """

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    rank = property(lambda self: self.inner.rank)  # type: ignore[assignment]
    size = property(lambda self: self.inner.size)  # type: ignore[assignment]
    supports_sharding = property(lambda self: self.inner.supports_sharding)  # type: ignore[assignment]
    supports_exchange = property(lambda self: self.inner.supports_exchange)  # type: ignore[assignment]
    supports_alltoall = property(lambda self: self.inner.supports_alltoall)  # type: ignore[assignment]

    @property
    def counter(self) -> ByteCounter:
        return self.inner.counter

    @property
    def world(self) -> Any:
        """The thread world of a thread communicator inside."""
        return self.inner.world

    def average_(self, tensors: Sequence[Tensor], name: str) -> None:
        self.inner.average_(tensors, name)

    def _average_(self, tensors: list[Tensor], name: str) -> int:
        raise AssertionError("unreachable: average_ forwards to the inner communicator")

    def average_start(self, tensors: Sequence[Tensor], name: str) -> PendingAverage:
        return self.inner.average_start(tensors, name)

    def _allgather_object(self, obj: Any) -> list[Any]:
        raise AssertionError("unreachable: allgather_object forwards to the inner communicator")

    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        raise AssertionError("unreachable: broadcast_object forwards to the inner communicator")

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.inner.allgather_object(obj)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return self.inner.broadcast_object(obj, root_rank)

    def reduce_scatter_mean(self, flats: Sequence[Tensor], name: str) -> list[Tensor]:
        return self.inner.reduce_scatter_mean(flats, name)

    def allgather_flat(self, shards: Sequence[Tensor], name: str) -> list[Tensor]:
        return self.inner.allgather_flat(shards, name)

    def allgather_flat_start(self, shards: Sequence[Tensor], name: str) -> PendingTensors:
        return self.inner.allgather_flat_start(shards, name)

    def alltoall_flat_start(
        self, sends: Sequence[Tensor], recv_numels: Sequence[int], name: str
    ) -> PendingTensors:
        return self.inner.alltoall_flat_start(sends, recv_numels, name)

    def exchange_start(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None = None,
    ) -> PendingExchange:
        return self.inner.exchange_start(sends, recv_from, tag, graph_key)


Build = Callable[[Communicator, nn.Module], Any]
Train = Callable[[Any, nn.Module, int, int, int], None]


def _by_parameter(opt: Any, per_fragment: Callable[[Any], Any]) -> list[Tensor] | None:
    """One tensor per parameter, in the optimizer's order, from each fragment's own list
    (``per_fragment(fragment)``, over its members); None where no fragment has any."""
    lists = [(f.members, per_fragment(f)) for f in opt.outer.fragments]
    if all(tensors is None for _, tensors in lists):
        return None
    out: list[Any] = [None] * len(opt.params)
    for members, tensors in lists:
        for j, t in zip(members, tensors or []):
            out[j] = t
    return out


def anchor_of(opt: Any) -> list[Tensor] | None:
    """Each parameter's anchor (the full layout), in the optimizer's order, from the fragments'
    own slow states: the tensors themselves; None before the capture."""
    return _by_parameter(opt, lambda f: f.slow_state.anchor)


def slow_buffer_of(opt: Any) -> list[Tensor] | None:
    """Each parameter's slow buffer (the full layout), as :func:`anchor_of`."""
    return _by_parameter(opt, lambda f: f.slow_state.slow_buffer)


def state_tensors_of(opt: Any) -> list[Tensor]:
    """Every tensor of every fragment's slow state (any layout), fragment by fragment."""
    return [t for s in opt.slow_states for t in s.state_tensors()]


def residual_of(opt: Any) -> Tensor | None:
    """The codec's error-feedback residual over every parameter in the optimizer's order,
    joined from the fragments' exchanges (zero for a fragment without one yet); None where no
    fragment has one."""
    residuals = [getattr(e, "residual", None) for e in opt.exchanges]
    if all(r is None for r in residuals):
        return None
    sizes = [p.numel() for p in opt.params]
    out: list[Tensor] = [torch.zeros(n) for n in sizes]
    for f, r in zip(opt.outer.fragments, residuals):
        if r is not None:
            for j, part in zip(f.members, r.split([sizes[j] for j in f.members])):
                out[j] = part
    return torch.cat(out)


def save_states(m: int, build: Build, train: Train, stop: int) -> list[bytes]:
    """Train ``m`` thread workers ``stop`` steps; each rank's model and optimizer state, as
    ``torch.save`` wrote them.

    Args:
        m: the number of workers.
        build: ``(comm, model) -> optimizer``.
        train: ``(optimizer, model, rank, start, stop)`` runs steps ``start .. stop - 1``.
        stop: the step to save at.
    """
    models = [make_model() for _ in range(m)]  # built here: torch's global RNG is not thread-safe

    def first_half(comm: Communicator) -> bytes:
        model = models[comm.rank]
        opt = build(comm, model)
        train(opt, model, comm.rank, 0, stop)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        return buf.getvalue()

    return run_threads(m, first_half)


def resume_in_fresh_workers(
    m: int,
    build: Build,
    train: Train,
    stop: int,
    steps: int,
    check: Callable[[Any], None] | None = None,
    saved: list[bytes] | None = None,
) -> list[nn.Module]:
    """Train ``m`` thread workers ``stop`` steps, save each rank's model and optimizer through
    ``torch.save``, load them into fresh workers whose models start elsewhere (everything must
    come from the file), and train on to ``steps``.

    Args:
        m: the number of workers.
        build: ``(comm, model) -> optimizer``, the same for both halves.
        train: ``(optimizer, model, rank, start, stop)`` runs steps ``start .. stop - 1``.
        stop: the step to save at (inside an inner loop, to test the hard case).
        steps: the total number of steps.
        check: called with each resumed optimizer right after it loaded its state.
        saved: each rank's saved state (:func:`save_states`, e.g. by an earlier version) to
            resume from instead of training the first half here.

    Returns:
        Each rank's model after ``steps`` steps.
    """
    if saved is None:
        saved = save_states(m, build, train, stop)
    fresh = [make_model(seed=123) for _ in range(m)]

    def second_half(comm: Communicator) -> nn.Module:
        model = fresh[comm.rank]
        ckpt = torch.load(io.BytesIO(saved[comm.rank]), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt = build(comm, model)
        opt.load_state_dict(ckpt["opt"])
        if check is not None:
            check(opt)
        train(opt, model, comm.rank, stop, steps)
        return model

    return run_threads(m, second_half)


def assert_same_models(got: Sequence[nn.Module], want: Sequence[nn.Module]) -> None:
    """Every parameter and buffer bitwise equal, rank by rank."""
    assert len(got) == len(want)
    for rank, (a, b) in enumerate(zip(got, want)):
        for key, x in a.state_dict().items():
            assert torch.equal(x, b.state_dict()[key]), f"rank {rank}: {key} differs"


def train_steps(opt: Any, model: nn.Module, rank: int, start: int, stop: int) -> None:
    """Steps ``start .. stop - 1`` of worker ``rank`` on its reference batches, at the reference
    lr schedule (``reference.lr_at``)."""
    for k in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()


def train_flushed(model: nn.Module, rank: int, communicator: Any = None, **options: Any) -> dict:
    """SlowMo over Local SGD (``tau=4``, slow momentum 0.5, SGD lr 0.05 momentum 0.9) with
    ``options`` (a codec, overlap, fragments...): 14 reference steps, flushed. Returns the
    model's state and the anchor (``anchor.{i}``). Shared by the horovodrun workers and the
    in-process runs they are compared with (no model buffers averaged: an allreduce of Gloo
    rounds differently from the threads)."""
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        communicator=communicator,
        tau=4,
        slow_momentum=0.5,
        **options,
    )
    train_steps(opt, model, rank, 0, 14)
    opt.flush()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({f"anchor.{i}": a.clone() for i, a in enumerate(anchor_of(opt))})
    return state


class SlowArrivals(ForwardingCommunicator):
    """A thread communicator whose messages never look arrived to OSGP's opportunistic check
    (a ``done()`` called from ``_mix``), so OSGP mixes only what staleness forces: deterministic
    messages in flight. The timed wait (``_wait``) still sees the truth."""

    def exchange_start(self, sends, recv_from, tag, graph_key=None):
        pending = self.inner.exchange_start(sends, recv_from, tag, graph_key)

        class NotYet(PendingExchange):
            def done(self):
                return sys._getframe(1).f_code.co_name != "_mix" and pending.done()

            def wait(self):
                return pending.wait()

        return NotYet()


# Optimizers and the thread-worker harness of the reference tests (test_optimizer.py and the
# compressed variant, test_compression_optimizer.py).
SGD_NESTEROV = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
PLAIN_SGD = lambda ps: torch.optim.SGD(ps, lr=0.05)  # noqa: E731


def run_slowmo(m, steps, make_opt, schedule=lr_at, models=None, per_rank=None, **kwargs):
    """Train ``m`` thread workers; per rank (model, [params after each outer step], optimizer).
    ``per_rank(comm) -> dict``: more optimizer arguments that need the rank's communicator."""
    models = models or [
        make_model() for _ in range(m)
    ]  # built here: torch's global RNG is not thread-safe

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            make_opt(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            **kwargs,
            **(per_rank(comm) if per_rank else {}),
        )
        snaps = []
        for k in range(steps):
            if schedule:
                for g in opt.param_groups:
                    g["lr"] = schedule(k)
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
            if opt.inner_step == 0:
                snaps.append(params_of(model))
        return model, snaps, opt

    return run_threads(m, worker)


def assert_bitwise_equal_across_ranks(results):
    for rank_snaps in zip(*[snaps for _, snaps, _ in results]):
        for tensors in zip(*rank_snaps):
            for t in tensors[1:]:
                assert torch.equal(t, tensors[0]), "ranks differ after an exact average"


def assert_close_models(got, want, atol=1e-5):
    for a, b in zip(got.state_dict().values(), want.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)


def end_process(status: int = 0) -> None:
    """End this process now, after the exit hooks and without the interpreter's finalization,
    its output flushed; the threads other than the main one still alive then are named on
    stderr. A torchrun worker that had written every result aborted in finalization about once
    in fifteen launches, and a pytest run whose tests had passed twice ("terminate called
    without an active exception", docs/limitations.md), which fails the launch or the run.
    Call it last (a worker: after ``destroy_process_group()``).

    Args:
        status: the process's exit status.
    """
    import atexit
    import threading

    atexit._run_exitfuncs()
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if alive:
        sys.stderr.write(f"threads alive at exit: {', '.join(alive)}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
