"""The optimizer reproduces the golden trajectories (tests/golden.py: every base, overlap 0/1/2,
sharded, worker="node", AMP skips, non-finite skips, two param groups, resume mid-flight) within
the records' stated tolerance, and states saved in every earlier format still load and continue
on the same trajectory.

The records are float32 values from one machine, so they are compared with a tolerance
(golden.RTOL/ATOL, derived there); what the library promises bit for bit is checked within the
run: every rank holds the same parameters after an exact average. The records still catch a
slow step changed by one part in a thousand.
"""

import pytest
import torch

import hvd_slowmo.slow_state.base as slow_state_base

from golden import (
    ATOL,
    NUM_PARAMS,
    RTOL,
    SCENARIOS,
    STEPS,
    assert_matches,
    load,
    run_scenario,
    saved_state_path,
)

GOLDEN = load()
TAU = 4  # every scenario's outer step (golden._scenarios)


def test_every_scenario_has_a_golden_record():
    assert set(GOLDEN) == set(SCENARIOS)


def _exact_average_steps(spec, got):
    """The steps after which every rank holds the exact average: for AR-SGD (gradients averaged
    exactly) every step that all ranks took, for the others every step in which an outer step
    landed on all ranks (read from the counters: ``outer_steps``), when it lands in the step
    that starts it (overlap 0) and is an exact average (not SGP's ``average=False``)."""
    kwargs = spec["kwargs"]
    if kwargs.get("overlap", 0) or kwargs.get("average", True) is False:
        return []
    counter = 0 if kwargs.get("base") == "allreduce" else 2  # num_steps or outer_steps
    steps = []
    for k in range(STEPS):
        before = [rank[k - 1].counters[counter] if k else 0 for rank in got]
        if all(rank[k].counters[counter] > b for rank, b in zip(got, before)):
            steps.append(k)
    return steps


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reproduces_the_golden_trajectory(name):
    got = run_scenario(SCENARIOS[name])
    assert_matches(got, GOLDEN[name], rtol=RTOL, atol=ATOL)
    # Bitwise, within this run: the ranks' parameters after every exact average.
    for step in _exact_average_steps(SCENARIOS[name], got):
        first = got[0][step].values[:NUM_PARAMS]
        for rank in range(1, len(got)):
            assert torch.equal(got[rank][step].values[:NUM_PARAMS], first), (
                f"rank {rank} differs from rank 0 after the exact average of step {step}"
            )


def test_the_bitwise_check_sees_the_exact_averages():
    want = {"localsgd-d0": [3, 7, 11], "allreduce-d0": list(range(STEPS)), "localsgd-d1": []}
    for name, steps in want.items():
        assert _exact_average_steps(SCENARIOS[name], GOLDEN[name]) == steps, name


def _changed_slow_step(argument: int, factor: float):
    """The slow momentum step with one of its scalar arguments multiplied by ``factor`` (a
    one-line change: 4 = slow_lr (alpha), 5 = slow_momentum (beta))."""
    step = slow_state_base.slow_momentum_step_

    def changed(*args, **kwargs):
        args = list(args)
        args[argument] *= factor
        step(*args, **kwargs)

    return changed


@pytest.mark.parametrize(
    "argument,factor",
    [(5, 1.001), (5, 0.999), (4, 1.001)],
    ids=["beta-up-0.1%", "beta-down-0.1%", "alpha-up-0.1%"],
)
@pytest.mark.parametrize("name", ["localsgd-d0", "sharded-d2", "adam-average-d1"])
def test_the_records_catch_a_changed_slow_step(monkeypatch, name, argument, factor):
    monkeypatch.setattr(
        slow_state_base, "slow_momentum_step_", _changed_slow_step(argument, factor)
    )
    got = run_scenario(SCENARIOS[name])
    with pytest.raises(AssertionError, match="values differ"):
        assert_matches(got, GOLDEN[name], rtol=RTOL, atol=ATOL)


def test_the_records_catch_an_off_by_one_outer_step(monkeypatch):
    # The slow step taken with the next step's learning rate: the one-step slip of a schedule.
    step = slow_state_base.slow_momentum_step_

    def late_lr(params, anchor, buffer, lr, *args, **kwargs):
        step(params, anchor, buffer, lr * 1.5, *args, **kwargs)

    monkeypatch.setattr(slow_state_base, "slow_momentum_step_", late_lr)
    got = run_scenario(SCENARIOS["localsgd-d0"])
    with pytest.raises(AssertionError, match="values differ"):
        assert_matches(got, GOLDEN["localsgd-d0"], rtol=RTOL, atol=ATOL)


RESUMES = sorted(n for n, s in SCENARIOS.items() if "resume_at" in s)


@pytest.mark.parametrize("version", [1])
@pytest.mark.parametrize("name", RESUMES)
def test_a_state_of_an_earlier_format_continues_the_trajectory(name, version):
    m = SCENARIOS[name].get("m", 3)
    states = []
    for rank in range(m):
        with open(saved_state_path(name, rank, version), "rb") as f:
            states.append(f.read())
    assert (
        torch.load(saved_state_path(name, 0, version), weights_only=False)["opt"]["format"]
        == version
    )
    got = run_scenario(SCENARIOS[name], saved_states=states)
    assert_matches(got, GOLDEN[name], rtol=RTOL, atol=ATOL)
