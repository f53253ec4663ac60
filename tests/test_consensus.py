"""The consensus API: whether the workers hold the same model now, and their consensus (averaged,
push-sum de-biased) model, swapped in for an evaluation and out again bitwise."""

import warnings

import pytest
import torch

from hvd_slowmo import BaseAlgorithm, DistributedOptimizer
from hvd_slowmo.comm.local import run_threads


class Weighted(BaseAlgorithm):
    """No communication; worker r reports push-sum weight 0.5 + r (its model holds z = x / w)."""

    name = "weighted"

    @property
    def consensus_weight(self) -> float:
        return 0.5 + self.comm.rank


def model_at(rank):
    model = torch.nn.Sequential(torch.nn.Linear(2, 1), torch.nn.BatchNorm1d(1))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0 + 2 * rank)
        model[1].running_mean.fill_(float(rank))
    return model


def step(opt, model):
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()


def test_consensus_is_the_push_sum_average_and_training_is_undisturbed():
    """Worker r holds z = 1 + 2r with weight w = 0.5 + r: the consensus is
    sum(w z) / sum(w) = (0.5 + 4.5) / 2 = 2.5; BatchNorm statistics are plainly averaged."""

    def worker(comm):
        model = model_at(comm.rank)
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),  # the step leaves the values as they are
            model_buffers=model.buffers(),
            base=Weighted,
            tau=4,
            communicator=comm,
        )
        model.eval()  # running statistics stay as set
        step(opt, model)
        before = [t.clone() for t in model.state_dict().values()]
        sent = opt.bytes_sent
        params, buffers = opt.consensus()
        with opt.use_consensus() as already:
            inside = ([p.clone() for p in model.parameters()], model[1].running_mean.clone())
        after = list(model.state_dict().values())
        restored = all(torch.equal(a, b) for a, b in zip(before, after))
        return opt.at_consensus(), already, params, buffers, inside, restored, opt.bytes_sent - sent

    for agree, already, params, buffers, inside, restored, sent in run_threads(2, worker):
        assert not agree and not already and restored and sent == 0
        assert all(torch.equal(p, torch.full_like(p, 2.5)) for p in params + inside[0])
        assert inside[1].item() == 0.5
        assert torch.equal(buffers[0], torch.full((1,), 0.5))  # running_mean


@pytest.mark.parametrize(
    "kwargs, steps, expected",
    [
        (dict(), 0, True),  # before the first step (after hvd.broadcast_parameters)
        (dict(), 2, False),  # inside an outer step
        (dict(), 3, True),  # right after the exact average of an outer step
        (dict(overlap=1), 3, False),  # overlap: the boundary's average is still in flight
        (dict(overlap=1), 4, False),  # landed: each worker kept its own progress
        (dict(base="sgp", average=False), 3, False),  # no exact average ever
        (dict(base="allreduce"), 2, True),  # AR-SGD: identical every step
        (dict(fragments=2), 3, False),  # fragment 0 averaged at step 1: moved on since
    ],
    ids=[
        "start",
        "inside",
        "boundary",
        "in-flight",
        "landed",
        "no-average",
        "allreduce",
        "fragments",
    ],  # fmt: skip
)
def test_at_consensus(kwargs, steps, expected):
    def worker(comm):
        model = torch.nn.Linear(2, 1)
        with torch.no_grad():  # the same start everywhere, as after hvd.broadcast_parameters
            model.weight.copy_(torch.tensor([[0.3, -0.2]]))
            model.bias.fill_(0.1)
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), tau=3, communicator=comm, **kwargs
        )
        for k in range(steps):
            opt.zero_grad()
            (model(torch.full((4, 2), float(comm.rank + k))) ** 2).mean().backward()
            opt.step()
        agree = opt.at_consensus()
        params, _ = opt.consensus()
        return agree, params

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_threads(2, worker)
    assert [agree for agree, _ in got] == [expected] * 2
    # Whether or not they agree, every worker gets the same consensus model.
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))


def test_use_consensus_at_consensus_touches_nothing():
    def worker(comm):
        model = torch.nn.Linear(2, 1)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), communicator=comm)
        with opt.use_consensus() as already:
            return already

    assert run_threads(2, worker) == [True, True]
