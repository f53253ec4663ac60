"""Unequal workers: the merge weighted by the work done (merge="samples") and time-based periods
(period_seconds), against the hand-written reference (tests/reference_unequal.py) on thread
workers with fake clocks; their pure parts; their refusals; their saved state."""

import io
import warnings

import pytest
import torch
from reference_streaming import reference_streaming
from reference_unequal import reference_unequal, time_plan

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import ThreadWorld, run_threads
from hvd_slowmo.merge import make_tally, read_tally
from hvd_slowmo.period import TimedPeriod, parse_seconds, plan_steps

from helpers import anchor_of
from reference import loss_at, lr_at, make_model, params_of
from streaming_harness import SGD

ALPHA, BETA = 0.7, 0.6


class FakeClock:
    """A worker's clock: advanced by hand, ``cost`` seconds per base step."""

    def __init__(self, cost: float) -> None:
        self.now, self.cost = 0.0, cost

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.cost


def samples_of(rank: int, k: int) -> float:
    """Samples reported by worker ``rank`` at its step ``k``: unequal, not powers of two."""
    return float(3 + rank + (k % 3))


def run_unequal(costs, outer, samples=samples_of, **kwargs):
    """Thread workers with fake clocks (``costs[r]`` seconds per step) until ``outer`` outer
    steps; per rank: (model, the anchor after each outer step, the parameters after each outer
    step, optimizer)."""
    m = len(costs)
    models = [make_model() for _ in range(m)]  # not in the threads: one global RNG

    def worker(comm):
        rank = comm.rank
        model, clock = models[rank], FakeClock(costs[rank])
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            tau=4,
            slow_lr=ALPHA,
            slow_momentum=BETA,
            clock=clock,
            **kwargs,
        )
        anchors, params = [], []
        while opt.outer_steps < outer:
            k = opt.num_steps
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
            opt.zero_grad()
            loss_at(model, rank, k).backward()
            clock.tick()
            before = opt.outer_steps
            opt.step(samples=None if samples is None else samples(rank, k))
            if opt.outer_steps > before:
                anchors.append([a.clone() for a in anchor_of(opt)])
                params.append(params_of(model))
        opt.finish()
        return model, anchors, params, opt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_threads(m, worker)


# --- the pure parts ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,seconds",
    [("30s", 30.0), ("500ms", 0.5), ("2min", 120.0), ("1.5h", 5400.0), ("7", 7.0), (2, 2.0)],
)
def test_period_parses_durations(text, seconds):
    assert parse_seconds(text) == seconds


@pytest.mark.parametrize("bad", ["30 parsecs", "fast", "", "-1s", "0s", float("inf")])
def test_period_refuses_what_does_not_parse(bad):
    with pytest.raises(ValueError, match="period_seconds"):
        parse_seconds(bad)


def test_plan_is_the_steps_that_fit_and_refuses_a_period_shorter_than_a_step():
    assert plan_steps([0.125, 0.25, 0.5], 1.0) == [8, 4, 2]
    assert plan_steps([0.3], 1.0) == [3]
    with pytest.raises(
        ValueError, match=r"period_seconds=0\.2 is shorter than one base step of rank 1"
    ):
        plan_steps([0.1, 0.25], 0.2)
    assert plan_steps([0.1, 0.25], 0.2, strict=False) == [2, 1]  # later: a stalled worker


def test_tally_reads_back_the_weighted_lrs_and_each_workers_step_time():
    m = 4
    tallies = [
        make_tally(r, [0.1 * (i + 1)], 0.25 * (i + 1), i, m)
        for i, r in enumerate([1.0, 2.0, 1.0, 4.0])
    ]
    mean = sum(tallies) / m
    merged = read_tally(mean, 1, m)
    assert merged.ratio == 2.0 and not merged.equal
    torch.testing.assert_close(
        torch.tensor(merged.lrs), torch.tensor([(0.1 + 0.4 + 0.3 + 1.6) / 8]), rtol=1e-12, atol=0
    )
    assert merged.seconds == [0.25, 0.5, 0.75, 1.0]
    plain = read_tally(sum(make_tally(1.0, [0.1], None, i, m) for i in range(m)) / m, 1, m)
    assert plain.equal and plain.lrs is None and plain.seconds is None
    with pytest.raises(ValueError, match="0 samples"):
        read_tally(make_tally(0.0, [0.1], None, 0, 1), 1, 1)


def test_timed_period_replays_recorded_plans_instead_of_the_clock():
    clock = FakeClock(0.5)
    period = TimedPeriod(1.0, 4, rank=1, size=2, clock=clock)
    period.replay([[5, 3], [2, 7]])
    period.replan([0.1, 0.1])
    assert period.steps == 3
    period.replan([0.1, 0.1])
    assert (period.steps, period.plans) == (7, [[5, 3], [2, 7]])
    period.replan([0.25, 0.5])  # replay used up: the clock's step times again
    assert period.steps == 2
    with pytest.raises(ValueError, match="one step count >= 1 per worker"):
        period.replay([[1, 0]])


# --- against the reference ---------------------------------------------------------------------
COSTS = {2: [0.125, 0.25], 4: [0.125, 0.25, 0.25, 0.5]}


@pytest.mark.parametrize("merge", ["samples", "mean"])
@pytest.mark.parametrize("m", [2, 4])
def test_time_based_periods_match_the_reference_at_every_outer_step(m, merge):
    """Workers 2x and 4x slower take 1/2 and 1/4 of the steps from the second period on (the
    plan from the fake clocks); the weighted merge and the weighted lr match the hand-written
    replay at every outer step, and every rank holds the same bits after each average."""
    outer = 4
    got = run_unequal(COSTS[m], outer, period_seconds="1s", merge=merge)
    counts = time_plan(COSTS[m], 1.0, outer, first=4)
    # One plan per outer step: the last one is for the period after the run.
    assert got[0][3].period.plans == counts[1:] + counts[-1:]
    assert [o.num_steps for _, _, _, o in got] == [sum(c[i] for c in counts) for i in range(m)]
    _, want = reference_unequal(
        counts, samples_of, ALPHA, BETA, SGD, lr_at, weighted=merge == "samples"
    )
    for t in range(outer):
        for _, anchors, params, _ in got:
            for a, b in zip(anchors[t], got[0][1][t]):
                assert torch.equal(a, b)
            for a, b in zip(params[t], got[0][2][t]):
                assert torch.equal(a, b)
            torch.testing.assert_close(anchors[t], want[t], rtol=1e-5, atol=1e-6)


def test_the_weights_change_the_result():
    """A test of the test: the weighted merge and the plain mean end apart."""
    weighted = run_unequal(COSTS[2], 2, period_seconds=1.0, merge="samples")
    plain = run_unequal(COSTS[2], 2, period_seconds=1.0)
    assert not torch.equal(weighted[0][1][-1][0], plain[0][1][-1][0])


def _count_based(m, steps, samples, **kwargs):
    models = [make_model() for _ in range(m)]  # not in the threads: one global RNG

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD(model.parameters()), named_parameters=model.named_parameters(),
            model_buffers=model.buffers(), communicator=comm, tau=4, slow_lr=ALPHA,
            slow_momentum=BETA, **kwargs,
        )  # fmt: skip
        for k in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step(samples=samples(comm.rank, k))
        return params_of(model)

    return run_threads(m, worker)


@pytest.mark.parametrize(
    "options",
    [{}, {"overlap": 1}, {"fragments": 2}, {"overlap": 1, "fragments": 2}],
    ids=["plain", "overlap", "fragments", "overlap-fragments"],
)
def test_equal_work_is_todays_run_bit_for_bit(options):
    """Equal steps and one sample per step (the default): every ratio is 1, nothing is
    multiplied or divided and the lrs are each worker's own, so merge='samples' is the
    unweighted run bit for bit (with fragments and overlap too)."""
    ones = lambda rank, k: None  # noqa: E731
    plain = _count_based(3, 14, ones, **options)
    weighted = _count_based(3, 14, ones, merge="samples", **options)
    for a, b in zip(plain, weighted):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_equal_samples_not_one_per_step_match_to_rounding():
    """samples=3 every step: the first outer step's ratios are 3 (not 1): r s / mean(r) rounds,
    so the run matches the unweighted one to a tolerance; from then on the unit is 3."""
    plain = _count_based(2, 12, lambda r, k: None)
    weighted = _count_based(2, 12, lambda r, k: 3, merge="samples")
    for a, b in zip(plain, weighted):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{"overlap": 1}, {"fragments": 3, "overlap": 1}])
def test_weighted_merge_composes_with_fragments_and_overlap(options):
    """Count-based periods, worker r reports 3 + r samples per step: every fragment's average is
    weighted 3 : 4 : 5, as the streaming reference with that weighted mean replays it."""
    m, steps = 3, 13
    got = _count_based(m, steps, lambda r, k: 3 + r, merge="samples", **options)
    w = [3.0, 4.0, 5.0]

    def weighted(members, snapshots, anchor):
        return [
            sum(w[i] * s[j] for i, s in enumerate(snapshots)) / sum(w) for j in range(len(anchor))
        ]

    want, _ = reference_streaming(
        m, steps, 4, options["overlap"], options.get("fragments", 1), False, ALPHA, BETA, SGD,
        lr_schedule=lr_at, average=weighted,
    )  # fmt: skip
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, params_of(theirs), rtol=1e-5, atol=1e-6)


# --- bad input ---------------------------------------------------------------------------------
def _build(**kwargs):
    model = make_model()
    comm = ThreadWorld(1).communicator(0)
    return DistributedOptimizer(
        SGD(model.parameters()), named_parameters=model.named_parameters(), communicator=comm,
        **kwargs,
    )  # fmt: skip


REFUSED = {
    "merge-unknown": (dict(merge="tokens"), ValueError, "merge"),
    "merge-not-str": (dict(merge=1), TypeError, "merge"),
    "period-garbled": (dict(period_seconds="soon"), ValueError, "period_seconds='soon'"),
    "period-negative": (dict(period_seconds=-3), ValueError, "period_seconds"),
    "period-type": (dict(period_seconds=[1]), TypeError, "period_seconds"),
    "period-fragments": (dict(period_seconds=1, fragments=2), ValueError, "fragments=2"),
    "period-overlap": (dict(period_seconds=1, overlap=1), ValueError, "overlap=1"),
    "period-allreduce": (dict(period_seconds=1, base="allreduce"), ValueError, "localsgd"),
    "period-gossip": (dict(period_seconds=1, base="sgp"), ValueError, "localsgd"),
    "merge-gossip": (dict(merge="samples", base="dpsgd"), ValueError, "communicates every step"),
    "merge-eager": (dict(merge="samples", overlap=1, eager="local"), ValueError, "eager"),
    "merge-codec": (dict(merge="samples", codec="int8"), ValueError, "uncompressed"),
    "period-codec": (dict(period_seconds=1, codec="fp16"), ValueError, "period_seconds=1.0"),
    "merge-sharded": (dict(merge="samples", shard_slow_state=True), ValueError, "shard"),
    "period-sharded": (dict(period_seconds=1, shard_slow_state=True), ValueError, "shard"),
    "clock-not-callable": (dict(period_seconds=1, clock=3.0), TypeError, "clock"),
    "period-node": (dict(period_seconds=1, worker="node"), ValueError, "worker='node'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refusals_name_the_setting(case):
    kwargs, error, words = REFUSED[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=words):
            _build(**kwargs)


@pytest.mark.parametrize(
    "bad,error", [(-1, ValueError), (float("nan"), ValueError), ("8", TypeError), (True, TypeError)]
)
def test_step_refuses_bad_samples_before_stepping(bad, error):
    opt = _build(merge="samples")
    for p in opt.params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in opt.params]
    with pytest.raises(error, match="samples"):
        opt.step(samples=bad)
    assert opt.num_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(opt.params, before))


def test_all_zero_weights_fail_on_every_worker():
    with pytest.raises(ValueError, match="0 samples"):
        _count_based(2, 4, lambda r, k: 0, merge="samples")


def test_a_period_shorter_than_a_step_fails_at_the_first_outer_step_naming_it():
    with pytest.raises(ValueError, match="period_seconds=0.2 is shorter than one base step"):
        run_unequal([0.125, 0.25], 2, period_seconds=0.2)


def test_time_based_runs_finish_with_unequal_step_counts_but_not_unequal_outer_steps():
    """finish() compares the outer steps under time-based periods (the step counts differ)."""
    got = run_unequal(COSTS[2], 2, period_seconds=1.0)  # finish() passed inside
    assert got[0][3].num_steps != got[1][3].num_steps


# --- saved state --------------------------------------------------------------------------------
def test_resume_mid_period_continues_bit_for_bit():
    """Save in the middle of a time-based period with a weighted merge, load into fresh
    workers and fresh clocks (at the same times), continue: the same bits as a run that never
    stopped. The state holds the plan, the marks and the unit."""
    costs, outer = COSTS[2], 4
    whole = run_unequal(costs, outer, period_seconds=1.0, merge="samples")
    saved: list[bytes] = [b"", b""]
    models = [make_model() for _ in range(2)]

    def first_half(comm):
        rank = comm.rank
        model, clock = models[rank], FakeClock(costs[rank])
        opt = DistributedOptimizer(
            SGD(model.parameters()), named_parameters=model.named_parameters(),
            model_buffers=model.buffers(), communicator=comm, tau=4, slow_lr=ALPHA,
            slow_momentum=BETA, clock=clock, period_seconds=1.0, merge="samples",
        )  # fmt: skip
        # Rank 0 stops past tau (its plan is 8 steps): the saved inner step is checked against it.
        while not (opt.outer_steps == 2 and opt.inner_step == (6 if rank == 0 else 3)):
            k = opt.num_steps
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
            opt.zero_grad()
            loss_at(model, rank, k).backward()
            clock.tick()
            opt.step(samples=samples_of(rank, k))
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "now": clock.now}, buf)
        saved[rank] = buf.getvalue()
        assert opt.state_dict()["slowmo"]["period"]["plans"] == [[8, 4], [8, 4]]

    run_threads(2, first_half)

    def second_half(comm):
        rank = comm.rank
        state = torch.load(io.BytesIO(saved[rank]), weights_only=False)
        model, clock = fresh[rank], FakeClock(costs[rank])
        model.load_state_dict(state["model"])
        clock.now = state["now"]
        opt = DistributedOptimizer(
            SGD(model.parameters()), named_parameters=model.named_parameters(),
            model_buffers=model.buffers(), communicator=comm, tau=4, slow_lr=ALPHA,
            slow_momentum=BETA, clock=clock, period_seconds=1.0, merge="samples",
        )  # fmt: skip
        opt.load_state_dict(state["opt"])
        while opt.outer_steps < outer:
            k = opt.num_steps
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
            opt.zero_grad()
            loss_at(model, rank, k).backward()
            clock.tick()
            opt.step(samples=samples_of(rank, k))
        return params_of(model)

    fresh = [make_model() for _ in range(2)]
    resumed = run_threads(2, second_half)
    for r in range(2):
        for a, b in zip(resumed[r], whole[r][2][-1]):
            assert torch.equal(a, b)


def test_a_state_without_the_new_entries_loads_and_damaged_ones_are_ignored():
    """A state saved without merge or time-based periods (as every state before them) loads
    into an optimizer with both: the marks start at the loaded step, the period at tau steps.
    Damaged "work"/"period" entries are ignored (a load never fails after its checks)."""
    old = _build()
    for p in old.params:
        p.grad = torch.ones_like(p)
    for _ in range(2):
        old.step()
    state = old.state_dict()
    assert "work" not in state["slowmo"] and "period" not in state["slowmo"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the settings changed: warned
        new = _build(merge="samples", period_seconds=1.0, clock=lambda: 0.0)
        new.load_state_dict(state)
        assert (new.num_steps, new.inner_step, new.period.steps) == (2, 2, 12)
        assert new.outer.fragments[0].work.state_dict() == [new.outer.samples, 2.0, 1.0]
        damaged = {**state, "slowmo": {**state["slowmo"], "work": "x", "period": {"steps": -1}}}
        again = _build(merge="samples", period_seconds=1.0, clock=lambda: 0.0)
        again.load_state_dict(damaged)
        assert (again.num_steps, again.period.steps) == (2, 12)
