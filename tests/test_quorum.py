"""The straggler quorum (``straggler=Quorum(...)``, hvd_slowmo.exchange.quorum) on thread
workers: the policy's checks, the grace rule, and runs against the hand-written reference of
tests/reference_quorum.py with the membership the coordinator recorded."""

import time

import pytest
import torch
from reference_quorum import reference_quorum

from hvd_slowmo import DistributedOptimizer, Quorum
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.straggler import Grace

from reference import loss_at, make_model, params_of

TAU, LR, MOMENTUM, SLOW_MOMENTUM = 4, 0.05, 0.9, 0.5


def _sgd(model, comm, policy, **options):
    """A plain SGD (no momentum) under ``policy`` over ``comm``: the small runs' optimizer."""
    return DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR),
        named_parameters=model.named_parameters(),
        communicator=comm,
        straggler=policy,
        **options,
    )


def _run(m, outer, policy, pause=None, models=None, step_seconds=0.0, **options):
    """``m`` thread workers train ``outer`` outer steps by the loop a quorum needs (until the
    outer step count, batches indexed by outer and inner step). ``pause=(rank, outer step,
    seconds)``: that worker sleeps before the base step that ends that outer step;
    ``step_seconds``: every base step sleeps that long more (emulated compute)."""
    models = models or [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            tau=TAU,
            slow_momentum=SLOW_MOMENTUM,
            straggler=policy,
            **options,
        )
        paused = False
        while opt.outer_steps < outer:
            if pause and not paused and comm.rank == pause[0]:
                ending = TAU if opt.period is None else opt.period.steps
                if opt.outer_steps == pause[1] and opt.inner_step == ending - 1:
                    time.sleep(pause[2])
                    paused = True
            time.sleep(step_seconds)
            opt.zero_grad()
            loss_at(model, comm.rank, opt.outer_steps * TAU + opt.inner_step).backward()
            opt.step()
        opt.finish()
        exchange = opt.exchanges[0]
        momentum = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
        return model, exchange.members, momentum, opt

    return run_threads(m, worker, timeout=30.0)


def _assert_ranks_bitwise_equal(results):
    first = results[0][0]
    for model, *_ in results[1:]:
        for a, b in zip(first.state_dict().values(), model.state_dict().values()):
            if a.is_floating_point():
                assert torch.equal(a, b), "ranks differ after the last outer step"


def _assert_matches_reference(model, members):
    want = reference_quorum(members, TAU, LR, MOMENTUM, 1.0, SLOW_MOMENTUM)
    for a, b in zip(model.state_dict().values(), want.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_quorum_of_everyone_is_the_reference_with_every_worker():
    results = _run(3, 4, Quorum(min_workers=3, grace=0.0))
    members = results[0][1]
    assert members == [[0, 1, 2]] * 4
    _assert_ranks_bitwise_equal(results)
    _assert_matches_reference(results[0][0], members)


def test_a_paused_worker_is_left_out_then_resynchronized_to_the_same_state():
    """Rank 3 sleeps 1 s before its boundary of outer step 1 (grace 0.1 s, periods of about
    0.12 s): the others go on without it; it rejoins from the state rank 0 ends an outer step
    with, and every rank ends bitwise identical and equal to the reference replayed with the
    recorded members."""
    results = _run(4, 16, Quorum(min_workers=3, grace=0.1), pause=(3, 1, 1.0), step_seconds=0.03)
    members = results[0][1]
    assert len(members) == 16
    assert members[0] == [0, 1, 2, 3]
    assert 3 not in members[1], members  # it slept far past the grace
    assert all(set(m) >= {0} and len(m) >= 3 for m in members), members
    assert any(3 in m for m in members[2:]), f"rank 3 never rejoined: {members}"
    _assert_ranks_bitwise_equal(results)
    _assert_matches_reference(results[0][0], members)
    # buffers="reset": the late worker's momentum from its dropped steps is gone, like everyone's
    for _, _, momentum, _ in results:
        assert all(b is None or not b.any() for b in momentum), "momentum kept after the outer step"


def test_time_based_periods_under_a_quorum_plan_every_worker_from_the_members():
    """Time-based periods (0.12 s, steps of 0.02 s) with rank 3 paused for about eight periods:
    rank 0 plans every worker's count from the members' step times (a late worker's from its
    last contribution), a resynchronized worker takes the same plan, and the run equals the
    reference replayed with the recorded members and counts."""
    results = _run(4, 12, Quorum(min_workers=3, grace=0.1), pause=(3, 1, 1.0),
                   step_seconds=0.02, period_seconds=0.12)  # fmt: skip
    members, opt0 = results[0][1], results[0][3]
    assert 3 not in members[1] and any(3 in m for m in members[2:]), members
    plans = opt0.period.plans
    assert len(plans) == 12 and all(len(p) == 4 and min(p) >= 1 for p in plans)
    assert results[3][3].period.plans[-1] == plans[-1]  # the late worker plans as rank 0 did
    counts = [[TAU] * 4] + plans[:-1]
    _assert_ranks_bitwise_equal(results)
    want = reference_quorum(members, TAU, LR, MOMENTUM, 1.0, SLOW_MOMENTUM, counts=counts)
    for a, b in zip(results[0][0].state_dict().values(), want.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_non_finite_worker_is_left_out_and_resynchronized():
    models = [make_model() for _ in range(3)]
    with torch.no_grad():
        next(models[2].parameters()).fill_(float("nan"))  # rank 2 is NaN from the start
    results = _run(3, 3, Quorum(min_workers=2, grace=0.0), models=models)
    members = results[0][1]
    assert members[0] == [0, 1]
    _assert_ranks_bitwise_equal(results)
    assert all(torch.isfinite(t).all() for t in params_of(results[2][0]))


def test_a_quorum_that_never_comes_is_a_timeout_naming_the_missing_rank():
    def worker(comm):
        model = make_model()
        opt = _sgd(model, comm, Quorum(min_workers=2, grace=0.0), tau=2)
        if comm.rank == 1:
            time.sleep(3.0)  # never reaches its boundary within rank 0's deadline
            return None
        for k in range(2):
            opt.zero_grad()
            loss_at(model, 0, k).backward()
            opt.step()

    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] never arrived"):
        run_threads(2, worker, timeout=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_workers": 0}, "min_workers must be >= 1"),
        ({"min_workers": 2.5}, "min_workers must be an int"),
        ({"min_workers": 2, "grace": -1.0}, "grace"),
        ({"min_workers": 2, "grace": "soon"}, "grace must be seconds or 'adaptive'"),
        ({"min_workers": 2, "window": 0}, "window must be an int >= 1"),
        ({"min_workers": 2, "min_grace": 5.0, "max_grace": 1.0}, "max_grace"),
        ({"min_workers": 2, "mad_factor": float("nan")}, "mad_factor"),
    ],
)
def test_bad_policy_is_refused_naming_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Quorum(**kwargs)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"base": "allreduce"}, "communicates every step"),
        ({"overlap": 1}, "overlap=1"),
        ({"buffers": "average"}, "buffers='average'"),
        ({"nonfinite": "skip"}, "nonfinite='skip'"),
        ({"codec": "int8"}, "quorum exchange is not supported"),
        ({"merge": "samples"}, "quorum exchange is not supported"),
        ({"period_seconds": 1.0, "fragments": 2}, "period_seconds=1.0 with fragments=2"),
        ({"fragments": 2}, "quorum exchange is not supported"),
        ({"shard_slow_state": True}, "shard_slow_state=True"),
        ({"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=0.7)}, "custom outer_optimizer"),
    ],
)
def test_settings_a_quorum_cannot_run_with_are_refused(options, match):
    def worker(comm):
        model = make_model()
        with pytest.raises(ValueError, match=match):
            _sgd(model, comm, Quorum(min_workers=1), tau=4, **options)

    run_threads(2, worker)


def test_a_quorum_larger_than_the_world_is_refused():
    def worker(comm):
        model = make_model()
        with pytest.raises(ValueError, match="min_workers=3 is larger than the 2 workers"):
            _sgd(model, comm, Quorum(min_workers=3))

    run_threads(2, worker)


def test_the_adaptive_grace_is_median_plus_c_mad_within_its_bounds():
    grace = Grace(Quorum(min_workers=1, mad_factor=2.0, window=4, min_grace=0.01, max_grace=5.0))
    assert grace.seconds() == 5.0  # nothing seen yet: wait the longest
    grace.record([0.1, 0.2, 0.3])
    # median 0.2, deviations [0.1, 0, 0.1] -> MAD 0.1
    assert grace.seconds() == pytest.approx(0.2 + 2.0 * 0.1)
    grace.record([0.0, 0.0, 0.0, 0.0])  # the window keeps the last 4
    assert grace.seconds() == 0.01  # the floor
    grace.record([100.0] * 4)
    assert grace.seconds() == 5.0  # the ceiling
    assert Grace(Quorum(min_workers=1, grace=0.25)).seconds() == 0.25


def test_a_transport_without_point_to_point_is_refused_naming_the_fix():
    """Horovod and MPI transports have no point-to-point messages (a missing worker would stall
    their collectives): refused before anything is built."""
    from hvd_slowmo.comm.local import ThreadCommunicator, ThreadWorld

    class CollectiveOnly(ThreadCommunicator):
        supports_point_to_point = False

    comm = CollectiveOnly(ThreadWorld(1), 0)
    model = make_model()
    with pytest.raises(ValueError, match="needs point-to-point messages.*torchrun"):
        _sgd(model, comm, Quorum(min_workers=1))


def test_point_to_point_messages_pair_by_tag_on_thread_workers():
    def worker(comm):
        if comm.rank == 0:
            comm.send_start(torch.arange(3.0), 1, tag=7).wait()
            comm.send_start(torch.full((3,), 9.0), 1, tag=8).wait()
            return comm.bytes_sent
        later = comm.recv_start(torch.empty(3), 0, tag=8)  # posted first, matched by its tag
        first = comm.recv_start(torch.empty(3), 0, tag=7)
        return first.wait()[0].tolist(), later.wait()[0].tolist()

    sent, got = run_threads(2, worker)
    assert sent == 24 and got == ([0.0, 1.0, 2.0], [9.0, 9.0, 9.0])
    with pytest.raises(ValueError, match="peer 0 must be another rank"):
        run_threads(1, lambda comm: comm.send_start(torch.zeros(1), 0, 0))


def test_a_worker_that_stops_does_not_stop_the_others_until_the_end():
    """Rank 2 stops calling the optimizer after outer step 1 (a killed or frozen worker): the
    others train every outer step without it; at the end rank 0 waits for it up to the deadline
    and names it (the job cannot end cleanly without it: an elastic restart takes over)."""
    members = {}

    def worker(comm):
        model = make_model()
        opt = _sgd(model, comm, Quorum(min_workers=2, grace=0.05), tau=2)
        while opt.outer_steps < 6:
            if comm.rank == 2 and opt.outer_steps == 1:
                return None  # gone
            opt.zero_grad()
            loss_at(model, comm.rank, opt.num_steps).backward()
            opt.step()
        members[comm.rank] = list(opt.exchanges[0].members)
        opt.finish()

    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] never arrived"):
        run_threads(3, worker, timeout=1.5)
    assert members[0] == [[0, 1, 2]] + [[0, 1]] * 5


def test_the_quorum_step_is_saved_and_resumed_with_the_outer_steps():
    def build(comm):
        model = make_model()
        return model, _sgd(model, comm, Quorum(min_workers=2, grace=0.0), tau=2)

    def worker(comm):
        model, opt = build(comm)
        for k in range(5):
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
        _, resumed = build(comm)
        resumed.load_state_dict(opt.state_dict())
        return resumed.exchanges[0].step, resumed.outer_steps

    assert run_threads(2, worker) == [(2, 2), (2, 2)]
