"""The overlapped outer step (overlap=d) on thread workers, against the hand-written reference
of the delayed recurrence (tests/reference_overlap.py)."""

import warnings
from collections.abc import Sequence

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.base import PendingAverage
from hvd_slowmo.comm.local import run_threads

from helpers import ForwardingCommunicator, anchor_of, assert_same_models, resume_in_fresh_workers
from helpers import train_steps as train
from reference import loss_at, lr_at, make_model, params_of, reference_slowmo
from reference_overlap import reference_overlapped

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731


class InFlight(ForwardingCommunicator):
    """A transport whose averages really stay in flight: nothing is averaged until ``wait()``
    (the thread communicator finishes at the start), so reading a tensor early shows."""

    def average_start(self, tensors, name):
        tensors = list(tensors)
        return PendingAverage(lambda: self.inner.average_(tensors, name))


def set_lrs(opt, lrs):
    """Set one lr for every param group, or one per param group."""
    for g, group in enumerate(opt.param_groups):
        group["lr"] = lrs[g] if isinstance(lrs, Sequence) else lrs


def run(m, steps, in_flight=True, models=None, schedule=lr_at, make_opt=SGD, **kwargs):
    """Train ``m`` thread workers; per rank: (model, the new anchor of every landing, optimizer).

    After a landing the workers' parameters differ (each keeps its own progress since the
    snapshot); what every rank must hold bitwise is the new anchor (``pending.sent``).
    ``schedule(k)`` gives the lr at step ``k``: one for every group, or one per param group.
    """
    models = models or [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        comm = InFlight(comm) if in_flight else comm
        opt = DistributedOptimizer(
            make_opt(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            **kwargs,
        )
        snaps = []
        for k in range(steps):
            if schedule:
                set_lrs(opt, schedule(k))
            pending = opt.outer.in_flight
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
            if pending is not None and opt.outer.in_flight is None:
                snaps.append([t.clone() for t in pending.sent])
        return model, snaps, opt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_threads(m, worker)


def assert_ranks_equal_after_landings(results, expected):
    assert all(len(r[1]) == expected for r in results), [len(r[1]) for r in results]
    for per_rank in zip(*[snaps for _, snaps, _ in results]):
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), "anchors differ"


def test_reference_with_delay_zero_is_slowmo():
    """A test of the reference: d = 0 is the paper's algorithm."""
    a = reference_overlapped(3, 10, 3, 0, 0.7, 0.6, SGD, lr_schedule=lr_at)
    b = reference_slowmo(3, 10, 3, 0.7, 0.6, SGD, lr_schedule=lr_at)
    for x, y in zip(a, b):
        for p, q in zip(x.state_dict().values(), y.state_dict().values()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def two_groups(params):
    """SGD over two param groups: the first Linear layer, and the rest."""
    params = list(params)
    return torch.optim.SGD(
        [{"params": params[:2]}, {"params": params[2:]}], lr=0.05, momentum=0.9, nesterov=True
    )


def two_schedules(k):
    """Group 0 rises every 4 steps, group 1 starts at 0.37x and decays every 3 steps: the ratio
    of the two lrs is not a power of two and changes from one outer step to the next, so a slow
    step that reads another group's lr cannot land on the same numbers."""
    return [lr_at(k), 0.37 * 0.05 * 0.8 ** (k // 3)]


def reference_of(m, steps, make_opt=SGD, schedule=lr_at, **kwargs):
    """The hand-written reference of ``run(m, steps, **kwargs)``."""
    return reference_overlapped(
        m,
        steps,
        kwargs["tau"],
        kwargs.get("overlap", 0),
        kwargs["slow_lr"],
        kwargs["slow_momentum"],
        make_opt,
        buffers=kwargs.get("buffers", "reset"),
        lr_schedule=schedule,
        base=kwargs.get("base", "localsgd"),
        nesterov=kwargs.get("outer_optimizer") == "nesterov",
    )


def assert_matches_reference(got, want):
    """Every rank's parameters and model buffers equal the reference's, up to rounding (the
    library fuses the arithmetic differently; the bugs guarded against move them far more)."""
    for (model, _, _), ref in zip(got, want):
        for (key, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(
                a, b, rtol=1e-4, atol=1e-5, msg=lambda e, key=key: f"{key}: {e}"
            )


CASES = {
    "d1-reset": dict(tau=4, overlap=1, slow_lr=1.0, slow_momentum=0.6, buffers="reset"),
    "d2-maintain": dict(tau=4, overlap=2, slow_lr=0.7, slow_momentum=0.5, buffers="maintain"),
    "d3-reset": dict(tau=4, overlap=3, slow_lr=1.0, slow_momentum=0.7, buffers="reset"),
    "localsgd-d1": dict(tau=3, overlap=1, slow_lr=1.0, slow_momentum=0.0, buffers="maintain"),
    # The base optimizer's momentum carried at the landing and averaged at the boundary.
    "d2-buffers-average": dict(tau=4, overlap=2, slow_lr=0.7, slow_momentum=0.6, buffers="average"),
    # Each group's slow step scales by its own lr at the boundary.
    "d1-two-groups": dict(
        tau=4, overlap=1, slow_lr=0.8, slow_momentum=0.6, buffers="maintain",
        make_opt=two_groups, schedule=two_schedules,
    ),
    "d2-two-groups-sharded": dict(
        tau=4, overlap=2, slow_lr=0.8, slow_momentum=0.6, buffers="average",
        make_opt=two_groups, schedule=two_schedules, shard_slow_state=True,
    ),
    "d1-allreduce": dict(tau=3, overlap=1, slow_lr=1.0, slow_momentum=0.5, base="allreduce"),
    "d2-nesterov": dict(
        tau=4, overlap=2, slow_lr=0.8, slow_momentum=0.6, outer_optimizer="nesterov"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_delayed_reference(case):
    kwargs = CASES[case]
    m, steps = 3, 15
    got = run(m, steps, **kwargs)
    assert_ranks_equal_after_landings(got, (steps - kwargs["overlap"]) // kwargs["tau"])
    assert_matches_reference(got, reference_of(m, steps, **kwargs))


def test_delay_changes_the_trajectory():
    """A test of the test: overlap=1 is not the non-overlapped algorithm."""
    models = [make_model() for _ in range(3)]
    a = run(3, 9, models=models, tau=3, overlap=1)
    b = run(3, 9, models=[make_model() for _ in range(3)], tau=3)
    assert not torch.equal(a[0][0][0].weight, b[0][0][0].weight)


def test_overlap_zero_is_the_paper_algorithm():
    """overlap=0 (start and landing in one step, in place) against the hand-written
    non-overlapped reference (tests/reference.py), not against another run of the library."""
    got = run(3, 10, tau=3, overlap=0, slow_lr=0.7, slow_momentum=0.6)
    want = reference_slowmo(3, 10, 3, 0.7, 0.6, SGD, lr_schedule=lr_at)
    assert_matches_reference(got, want)


# Every base with an average in flight; the values are checked against the hand-written reference
# where it has one (the gossip bases have their own references in test_gossip.py, without
# overlap: here only the ranks' agreement is checked for them).
BASES = {
    "allreduce": dict(base="allreduce"),
    "sgp": dict(base="sgp"),
    "sgp-noaverage": dict(base="sgp", average=False),
    "osgp": dict(base="osgp"),
    "dpsgd": dict(base="dpsgd"),
    "sharded": dict(shard_slow_state=True),
    "buffers-average": dict(buffers="average"),
    "nesterov-outer": dict(outer_optimizer="nesterov"),
}
HAS_REFERENCE = ("allreduce", "sharded", "buffers-average", "nesterov-outer")


@pytest.mark.parametrize("case", list(BASES))
def test_every_base_lands_identically_on_every_rank(case):
    kwargs = dict(BASES[case], tau=4, overlap=2, slow_lr=1.0, slow_momentum=0.6)
    steps = 13
    got = run(3, steps, **kwargs)
    for _, _, opt in got:
        assert opt.num_steps == steps and opt.outer_steps == steps // 4
        for p in opt.params:
            assert torch.isfinite(p).all()
    if kwargs.get("average", True):
        assert_ranks_equal_after_landings(got, (steps - 2) // 4)
    else:
        assert all(len(r[1]) == (steps - 2) // 4 for r in got)
    if case in HAS_REFERENCE:
        assert_matches_reference(got, reference_of(3, steps, **kwargs))


def test_allreduce_base_keeps_workers_identical():
    """AR-SGD keeps the workers identical, so the landing x0' + (x - s) is the same on every
    worker: ranks stay bitwise identical at every step, not only in their anchors; and the
    values are those of the hand-written reference (gradients averaged at every step)."""
    kwargs = dict(tau=3, overlap=1, base="allreduce", slow_lr=1.0, slow_momentum=0.5)
    got = run(2, 11, **kwargs)
    for a, b in zip(got[0][0].parameters(), got[1][0].parameters()):
        assert torch.equal(a, b)
    assert_matches_reference(got, reference_of(2, 11, **kwargs))


def test_node_workers():
    from hvd_slowmo.comm.hierarchy import Hierarchy

    models = [make_model() for _ in range(4)]

    def worker(comm):
        r = comm.rank
        h = Hierarchy(
            node=comm.world.split([[0, 1], [2, 3]])[r], cross=comm.world.split([[0, 2], [1, 3]])[r]
        )
        model = models[r]
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            communicator=InFlight(comm),
            worker=h,
            tau=3,
            overlap=1,
            slow_momentum=0.5,
        )
        anchors = []
        for k in range(10):
            opt.zero_grad()
            loss_at(model, r, k).backward()
            pending = opt.outer.in_flight
            opt.step()
            if pending is not None and opt.outer.in_flight is None:
                anchors.append([t.clone() for t in pending.sent])
        return params_of(model), anchors

    got = run_threads(4, worker)
    for a, b in ((0, 1), (2, 3)):  # a node's ranks: identical at every step
        assert all(torch.equal(x, y) for x, y in zip(got[a][0], got[b][0]))
    assert not all(torch.equal(x, y) for x, y in zip(got[0][0], got[2][0]))  # nodes differ
    assert len(got[0][1]) == 3
    for per_rank in zip(*[anchors for _, anchors in got]):
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:])


@pytest.mark.parametrize("kind", ["full", "sharded", "buffers-average", "sgp"])
def test_resume_with_an_average_in_flight_is_bitwise(kind):
    kwargs = {
        "full": {},
        "sharded": dict(shard_slow_state=True),
        "buffers-average": dict(buffers="average"),
        "sgp": dict(base="sgp"),
    }[kind]

    def build(comm, model):
        return DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=InFlight(comm),
            tau=4,
            overlap=2,
            slow_momentum=0.6,
            **kwargs,
        )

    def check(opt):
        # Saved between the boundary and the landing.
        assert opt.outer.in_flight is not None and opt.inner_step == 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = resume_in_fresh_workers(3, build, train, stop=9, steps=15, check=check)
        whole = resume_in_fresh_workers(3, build, train, stop=15, steps=15)
    assert_same_models(resumed, whole)


def test_nonfinite_skip_restarts_from_the_anchor_and_raise_names_the_rank():
    models = [make_model() for _ in range(2)]

    def worker(comm, nonfinite):
        model = models[comm.rank] if nonfinite == "skip" else make_model()
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            communicator=InFlight(comm),
            tau=3,
            overlap=1,
            nonfinite=nonfinite,
            slow_momentum=0.5,
        )
        anchor = None
        for k in range(4):
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            if k == 2 and comm.rank == 1:
                next(model.parameters()).grad.fill_(float("nan"))
            if k == 3:
                anchor = [a.clone() for a in anchor_of(opt)]
            opt.step()
        return params_of(model), anchor, opt.outer.in_flight

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_threads(2, lambda c: worker(c, "skip"))
    for params, anchor, pending in got:
        assert pending is None
        assert all(torch.equal(p, a) for p, a in zip(params, anchor))
    with pytest.raises(FloatingPointError, match=r"rank\(s\) \[1\]"):
        run_threads(2, lambda c: worker(c, "raise"))


def test_flush_lands_and_finish_reads_the_probe():
    models = [make_model() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            communicator=InFlight(comm),
            tau=3,
            overlap=2,
            slow_momentum=0.5,
        )
        train(opt, model, comm.rank, 0, 3)
        assert opt.outer.in_flight is not None
        opt.finish()  # the probe in flight is read first: no two collectives of one name
        opt.flush()
        assert opt.outer.in_flight is None
        return params_of(model)

    a, b = run_threads(2, worker)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # landed at the boundary: no progress


@pytest.mark.parametrize(
    "value,error", [(-1, ValueError), (3, ValueError), ("1", TypeError), (True, TypeError)]
)
def test_bad_overlap_is_refused(value, error):
    model = make_model()

    def worker(comm):
        DistributedOptimizer(SGD(model.parameters()), communicator=comm, tau=3, overlap=value)

    with pytest.raises(error, match="overlap"):
        run_threads(1, worker)


def test_state_with_an_average_in_flight_needs_overlap_to_load():
    model = make_model()

    def worker(comm):
        opt = DistributedOptimizer(SGD(model.parameters()), communicator=comm, tau=3, overlap=1)
        train(opt, model, 0, 0, 3)
        state = opt.state_dict()
        plain = DistributedOptimizer(SGD(model.parameters()), communicator=comm, tau=3)
        before = plain.state_dict()
        with pytest.raises(ValueError, match="overlap"):
            plain.load_state_dict(state)
        assert (
            plain.state_dict()["slowmo"]["position"]["num_steps"]
            == before["slowmo"]["position"]["num_steps"]
        )

    run_threads(1, worker)


def test_change_of_workers_drops_the_average_in_flight_and_restarts_from_the_anchor():
    models = [make_model() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD(model.parameters()), communicator=comm, tau=3, overlap=2, slow_momentum=0.5
        )
        train(opt, model, comm.rank, 0, 4)  # boundary at 3, lands at 5: in flight now
        assert opt.outer.in_flight is not None and opt.num_steps == 4
        anchor = [a.clone() for a in anchor_of(opt)]
        opt.adopt_world("a test")
        assert opt.outer.in_flight is None
        assert (opt.num_steps, opt.inner_step, opt.outer_steps) == (0, 0, 0)
        assert all(torch.equal(p, a) for p, a in zip(params_of(model), anchor))

    run_threads(2, worker)
