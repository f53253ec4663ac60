"""The thread-worker harness of the streaming tests (tests/test_streaming.py,
tests/test_sparse_optimizer.py): an SGD, a transport whose averages stay in flight until
``wait()``, and runs of thread workers that record the anchor and the parameters after every
step."""

import warnings

import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.base import PendingAverage
from hvd_slowmo.comm.local import run_threads

from helpers import ForwardingCommunicator, anchor_of
from reference import loss_at, lr_at, make_model, params_of

__all__ = ["SGD", "InFlight", "build", "run"]

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731


class InFlight(ForwardingCommunicator):
    """A transport whose averages stay in flight until ``wait()`` (reading early shows)."""

    def average_start(self, tensors, name):
        tensors = list(tensors)
        return PendingAverage(lambda: self.inner.average_(tensors, name))


def run(m, steps, models=None, **kwargs):
    """Train ``m`` thread workers with lr_at; per rank: (model, the anchor after every step,
    optimizer, the parameters after every step)."""
    models = models or [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=InFlight(comm),
            **kwargs,
        )
        anchors, params = [], []
        for k in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
            anchors.append([a.clone() for a in anchor_of(opt) or []])
            params.append(params_of(model))
        return model, anchors, opt, params

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_threads(m, worker)


def build(**kwargs):
    def make(comm, model):
        return DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=InFlight(comm),
            tau=6,
            slow_momentum=0.6,
            **kwargs,
        )

    return make
