"""AR-SGD's gradient average in buckets started during backward, on thread workers, against the
hand-written reference of tests/grad_average_run.py (bitwise: the thread communicator sums every
element in rank order, as the reference does, whatever the buckets)."""

import warnings
from types import SimpleNamespace

import grad_average_run as run
import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.bases.gradient_buckets import BUCKET_BYTES, choose_bucket_bytes, plan_buckets
from hvd_slowmo.comm.base import PendingAverage
from hvd_slowmo.comm.hierarchy import Hierarchy
from hvd_slowmo.comm.local import ThreadCommunicator, run_threads

from reference import batch


class Deferred(ThreadCommunicator):
    """A thread communicator whose averages stay in flight: nothing is averaged until
    ``wait()``, so a gradient read before the wait shows it; every start and wait is logged."""

    def __init__(self, comm: ThreadCommunicator, log: list) -> None:
        super().__init__(comm.world, comm.rank)
        self.log = log

    def _average_start(self, tensors, name):
        self.log.append(("start", name))

        def finish():
            self.log.append(("wait", name))
            self._average_(tensors, name)

        return PendingAverage(finish), sum(t.numel() * t.element_size() for t in tensors)

    def _average_(self, tensors, name):
        self.log.append(("average", name))
        return super()._average_(tensors, name)


class Fusing(Deferred):
    """A deferred thread communicator that says it fuses averages itself, as Horovod does."""

    fuses_averages = True


def assert_equal_runs(got, want):
    for k, (a, b) in enumerate(zip(got["grads"], want["grads"])):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {k}: gradient {i} after backward is not the average"
    for k, (a, b) in enumerate(zip(got["params"], want["params"])):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {k}: parameter {i} differs from the reference"


def threads(m, fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_threads(m, fn)


def test_plan_buckets_fills_from_the_last_parameter():
    assert plan_buckets([4, 4, 4, 4], 8, first_bytes=8) == [[3, 2], [1, 0]]
    assert plan_buckets([4, 20, 4, 4], 8, first_bytes=8) == [[3, 2], [1], [0]]  # a bucket alone
    assert plan_buckets([4, 4, 4], 100, first_bytes=100) == [[2, 1, 0]]
    assert plan_buckets([], 8) == []
    # The first bucket is small (DDP's 1 MB by default), so the first average starts early.
    assert plan_buckets([4] * 6, 12, first_bytes=4) == [[5], [4, 3, 2], [1, 0]]
    mb = 2**20
    assert plan_buckets([mb // 2] * 4, 25 * mb) == [[3, 2], [1, 0]]


def test_bucket_size_is_the_transports_choice_unless_given():
    fusing, plain = SimpleNamespace(fuses_averages=True), SimpleNamespace(fuses_averages=False)
    assert choose_bucket_bytes(None, [(fusing, "a")]) == 1  # one parameter per bucket
    assert choose_bucket_bytes(None, [(plain, "a")]) == BUCKET_BYTES
    # Two stages: a bucket waits for its first before its second, so buckets stay large.
    assert choose_bucket_bytes(None, [(fusing, "a"), (fusing, "b")]) == BUCKET_BYTES
    assert choose_bucket_bytes(5, [(fusing, "a")]) == 5


@pytest.mark.parametrize("transport", ["threads", "deferred", "fusing"])
@pytest.mark.parametrize("case", list(run.CASES))
def test_equals_the_hand_written_average(case, transport):
    models = [run.Net() for _ in range(3)]
    buckets = []

    def worker(comm):
        if transport == "fusing":  # the default bucket size: each parameter's average alone
            comm = Fusing(comm, [])
            opts = []
            out = run.train(models[comm.rank], case, comm.rank, comm, bucket_mb=None, opts=opts)
            buckets.append(opts[0]._grad_average.buckets)
            return out
        if transport == "deferred":
            comm = Deferred(comm, [])
        return run.train(models[comm.rank], case, comm.rank, comm)

    got = threads(3, worker)
    want = run.reference(case, 3)
    for r in got:
        assert_equal_runs(r, want)
    if transport == "fusing":
        n = len(list(models[0].parameters()))
        assert all(b == [[i] for i in reversed(range(n))] for b in buckets), buckets


@pytest.mark.parametrize("case", ["plain", "accumulate-unused"])
def test_node_workers_average_inside_the_node_then_across(case):
    nodes = [[0, 1], [2, 3]]
    models = [run.Net() for _ in range(4)]

    def worker(comm):
        r = comm.rank
        hierarchy = Hierarchy(
            node=Deferred(comm.world.split(nodes)[r], []),
            cross=Deferred(comm.world.split([[0, 2], [1, 3]])[r], []),
        )
        return run.train(models[r], case, r, comm, worker=hierarchy)

    got = threads(4, worker)
    want = run.reference(case, 4, nodes=nodes)
    for r in got:
        assert_equal_runs(r, want)


def test_buckets_start_during_backward_in_order_and_backward_waits():
    models = [run.Net() for _ in range(2)]

    def worker(comm):
        log = []
        comm = Deferred(comm, log)
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            base="allreduce",
            communicator=comm,
            bucket_mb=run.BUCKET_MB,
        )
        first = model.body[0].weight  # its gradient comes last
        first.register_post_accumulate_grad_hook(lambda _: log.append(("grad", "first layer")))
        x, y = batch(comm.rank, 0)
        ((model(x, True) - y) ** 2).mean().backward()
        opt.step()
        return log, len(opt._grad_average.buckets)

    for log, n in threads(2, worker):
        starts = [name for what, name in log if what == "start"]
        assert starts == [f"hvd_slowmo.grad_average.{b}" for b in range(n)] and n > 2
        assert log.index(("start", starts[0])) < log.index(("grad", "first layer")), (
            "no bucket started before backward reached the first layer"
        )
        assert [w for w, _ in log if w != "average"][-n:] == ["wait"] * n


def test_more_backward_passes_than_declared_raise():
    models = [run.Net() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            base="allreduce",
            communicator=comm,
        )
        for p in range(2):
            run.loss(model, "plain", comm.rank, 0, p).backward()
        opt.step()

    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=1 backward"):
        threads(2, worker)


@pytest.mark.parametrize(
    "option, error",
    [
        (dict(bucket_mb=0), ValueError),
        (dict(bucket_mb="25"), TypeError),
        (dict(backward_passes_per_step=0), ValueError),
        (dict(backward_passes_per_step=1.5), TypeError),
    ],
    ids=["bucket_mb=0", "bucket_mb-str", "passes=0", "passes-float"],
)
def test_bad_options_are_refused(option, error):
    name = next(iter(option))

    def worker(comm):
        model = run.Net()
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            base="allreduce",
            communicator=comm,
            **option,
        )

    with pytest.raises(error, match=name):
        threads(1, worker)


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_outer_step_checks_identical_parameters_without_a_collective(nonfinite):
    models = [run.Net() for _ in range(2)]

    def worker(comm):
        log = []
        comm = Deferred(comm, log)
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            base="allreduce",
            tau=2,
            nonfinite=nonfinite,
            communicator=comm,
        )
        for k in range(4):
            opt.zero_grad()
            hook = None
            if k == 3 and comm.rank == 1:  # in backward: the average carries it everywhere
                hook = model.out.bias.register_hook(lambda g: g * float("nan"))
            run.loss(model, "plain", comm.rank, k, 0).backward()
            if hook is not None:
                hook.remove()
            try:
                opt.step()
            except FloatingPointError as e:
                return log, str(e), opt.outer_steps
        return log, None, opt.outer_steps

    for log, error, outer in threads(2, worker):
        assert [name for _, name in log if "progress" in name] == []
        if nonfinite == "raise":
            assert error is not None and "rank(s) [0, 1] after step 4" in error
        else:
            assert error is None and outer == 2
