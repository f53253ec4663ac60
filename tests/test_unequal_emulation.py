"""The emulated unequal workers of the main job (examples/unequal.py, issue 37): the busy-wait
slowdown and the pause against a fake clock, the flags from compare.py to the training script,
and two thread workers whose straggler changes the time but not one bit of the result."""

import argparse
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import common  # noqa: E402
import compare  # noqa: E402
import mnist1d_cnn  # noqa: E402
import unequal  # noqa: E402

TICK = 0.25  # the fake clock's advance per reading (exact in binary)


class FakeClock:
    """Advances by TICK at every reading, and by hand for a step's compute."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        self.t += TICK
        return self.t - TICK

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def step(s: unequal.Straggler, clock: FakeClock, compute: float, outer: int) -> float:
    """One base step of ``compute`` seconds; returns the clock's advance in ``before_step``."""
    t = clock.t
    s.before_step()
    spun = clock.t - t
    clock.t += compute
    s.after_step(outer)
    return spun


def test_slowdown_is_factor_minus_one_times_the_last_step_without_an_outer_step():
    clock = FakeClock()
    s = unequal.Straggler(slow_factor=3.0, clock=clock, sleep=clock.sleep)
    assert step(s, clock, 2.0, 0) == 2 * TICK  # nothing measured yet: no extra, two readings
    assert s.busy_seconds == 0.0
    measured = 2.0 + TICK  # from the t0 reading to the reading in after_step
    spun = step(s, clock, 2.0, 0)
    assert s.busy_seconds == 2.0 * measured
    assert 2.0 * measured <= spun <= 2.0 * measured + 4 * TICK  # the spin's own readings
    # A step that ends an outer step waits for the others: its 10 s are not this worker's step.
    step(s, clock, 10.0, 1)
    busy = s.busy_seconds
    step(s, clock, 2.0, 1)
    assert s.busy_seconds - busy == 2.0 * measured
    assert clock.slept == [] and s.paused_seconds == 0.0


def test_factor_one_never_spins():
    clock = FakeClock()
    s = unequal.Straggler(clock=clock, sleep=clock.sleep)
    assert [step(s, clock, 1.0, k // 3) for k in range(7)] == [2 * TICK] + [TICK] * 6
    assert s.busy_seconds == 0.0


def test_pause_sleeps_periods_times_the_last_outer_period_once():
    clock = FakeClock()
    s = unequal.Straggler(pause_at=2, pause_periods=3.0, clock=clock, sleep=clock.sleep)
    for k in range(4):  # outer step 1 ends at the 4th step
        step(s, clock, 1.0, 1 if k == 3 else 0)
    assert clock.slept == []
    start = clock.t
    for k in range(4):  # outer step 2: four steps of 1 s and the readings
        step(s, clock, 1.0, 2 if k == 3 else 1)
    (slept,) = clock.slept
    period = start + 4 * (1.0 + 2 * TICK) - TICK - start  # from the first reading to the last
    assert slept == pytest.approx(3.0 * (period + TICK), abs=2 * TICK)
    assert s.paused_seconds == slept
    for k in range(8):  # never again
        step(s, clock, 1.0, 3 + k // 4)
    assert len(clock.slept) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"slow_factor": 0.5}, "--slow-factor must be >= 1"),
        ({"slow_factor": float("nan")}, "--slow-factor must be a finite number"),
        ({"pause_at": -1}, "--pause-at must be an outer step >= 0"),
        ({"pause_at": 2}, "--pause-periods must be > 0 with --pause-at 2"),
        ({"pause_at": 2, "pause_periods": float("inf")}, "--pause-periods must be a finite"),
        ({"pause_periods": -1.0}, "--pause-periods must be > 0"),
    ],
    ids=[
        "factor-below-1",
        "factor-nan",
        "pause-at-negative",
        "pause-without-periods",
        "periods-inf",
        "periods-negative",
    ],  # fmt: skip
)
def test_bad_settings_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        unequal.Straggler(**kwargs)


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    unequal.add_straggler_args(parser)
    return parser.parse_args(argv)


def test_only_the_straggler_rank_gets_one():
    args = _parsed(["--slow-factor", "2"])
    assert [unequal.straggler_from_args(args, r, 4) is not None for r in range(4)] == [
        False, False, False, True]  # fmt: skip
    args = _parsed(["--pause-at", "4", "--pause-periods", "3", "--straggler-rank", "1"])
    got = [unequal.straggler_from_args(args, r, 4) for r in range(4)]
    assert [g is not None for g in got] == [False, True, False, False]
    assert (got[1].slow_factor, got[1].pause_at, got[1].pause_periods) == (1.0, 4, 3.0)
    assert all(unequal.straggler_from_args(_parsed([]), r, 4) is None for r in range(4))
    with pytest.raises(ValueError, match=r"--straggler-rank must be in \[-4, 3\] for 4 workers"):
        unequal.straggler_from_args(_parsed(["--slow-factor", "2", "--straggler-rank", "4"]), 0, 4)


def test_compare_passes_the_flags_to_the_training_script():
    argv = ["--slow-factor", "2", "--pause-at", "4", "--pause-periods", "3"]
    argv += ["--straggler-rank", "1"]
    args, extra = compare._parser().parse_known_args(argv)
    assert extra == []  # compare.py's own flags, not left to the script unchecked
    flags = unequal.straggler_flags(args)
    assert flags == argv
    again = _parsed(flags)
    assert (again.slow_factor, again.pause_at, again.pause_periods, again.straggler_rank) == (
        2.0, 4, 3.0, 1)  # fmt: skip
    assert compare.unequal_suffix(args) == "-slow2x-pause3at4-r1"
    assert unequal.straggler_flags(compare._parser().parse_args([])) == []


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--slow-factor", "0.5"], "--slow-factor must be >= 1"),
        (["--slow-factor", "2", "--straggler-rank", "4"], r"--straggler-rank must be in \[-4, 3\]"),
        (["--pause-at", "3"], "--pause-periods must be > 0"),
    ],
    ids=["factor", "rank", "pause"],
)
def test_compare_refuses_bad_flags_before_launching(argv, match, monkeypatch):
    monkeypatch.setattr(compare, "_train_all", lambda *a: pytest.fail("launched"))
    with pytest.raises(ValueError, match=match):
        compare.main(["--np", "4", *argv])


@pytest.mark.timeout(400)  # the launch tier (tests/conftest.py): a whole run, about 30 s
def test_thread_workers_slowed_and_paused_train_the_same_bits(tmp_path):
    # Two thread workers, rank 0 the straggler (rank 0 writes the summary): a busy-wait and a
    # pause change the time, not the arithmetic.
    def run(*flags: str) -> dict:
        out = tmp_path / f"run{len(flags)}.json"
        argv = ["--threads", "2", "--algo", "localsgd", "--slowmo", "--tau", "4"]
        argv += ["--epoch-steps", "12", "--epochs", "1", "--no-progress", "--validation"]
        argv += ["--logdir", str(tmp_path), "--summary-json", str(out), *flags]
        assert common.run_cli(mnist1d_cnn.main, argv) == 0
        return json.loads(out.read_text())

    plain = run()
    slowed = run("--slow-factor", "1.5", "--pause-at", "1", "--pause-periods", "1",
                 "--straggler-rank", "0")  # fmt: skip
    assert "straggler" not in plain
    assert slowed["straggler"]["busy_s"] > 0 and slowed["straggler"]["paused_s"] > 0
    assert slowed["steps"] == plain["steps"] == 12 and slowed["outer_steps"] == 3
    assert slowed["val_loss"] == plain["val_loss"] and slowed["train_loss"] == plain["train_loss"]


@pytest.mark.slow  # two whole runs of a few seconds: the default tier, not the fast one
def test_main_job_runs_the_unequal_workers_policies(tmp_path):
    """The main job's policy flags: a quorum of 2 of 3 thread workers goes on without a paused
    worker (an outer step closes without it), and time-based periods with the weighted merge
    run their epochs by outer steps; both end with every outer step."""

    def run(*flags: str) -> dict:
        out = tmp_path / "summary.json"
        argv = ["--threads", "3", "--algo", "localsgd", "--slowmo", "--tau", "4"]
        argv += ["--epoch-steps", "8", "--epochs", "2", "--no-progress"]
        argv += ["--logdir", str(tmp_path), "--summary-json", str(out), *flags]
        assert common.run_cli(mnist1d_cnn.main, argv) == 0
        return json.loads(out.read_text())

    quorum = run("--quorum", "2", "--grace", "0.05", "--pause-at", "1", "--pause-periods", "30")
    assert quorum["run"].endswith("_quorum2") and quorum["outer_steps"] == 4
    assert quorum["quorum_partial_steps"] >= 1
    timed = run("--period-seconds", "0.3s", "--merge", "samples", "--slow-factor", "2")
    assert timed["run"].endswith("_period0.3s_weighted") and timed["outer_steps"] == 4


def test_emulated_clock_adds_the_step_times_the_factor_and_never_waits():
    clock = unequal.EmulatedClock(0.5, slow_factor=2.0)
    for outer in (0, 0, 1):
        clock.before_step()
        clock.after_step(outer)
    assert clock() == 3.0
    with pytest.raises(ValueError, match="--emulated-step must be seconds > 0"):
        unequal.EmulatedClock(float("nan"))
    with pytest.raises(ValueError, match="--slow-factor must be >= 1"):
        unequal.EmulatedClock(1.0, slow_factor=0.5)


def test_emulated_time_gives_every_worker_a_clock_and_refuses_real_waits():
    args = _parsed(["--slow-factor", "2", "--emulated-step", "1", "--straggler-rank", "1"])
    clocks = [unequal.straggler_from_args(args, r, 3) for r in range(3)]
    assert [c.slow_factor for c in clocks] == [1.0, 2.0, 1.0]
    assert unequal.straggler_summary(clocks[1]) == {}
    for extra in (["--pause-at", "2", "--pause-periods", "1"], ["--quorum", "2"]):
        bad = _parsed(["--emulated-step", "1", *extra])
        with pytest.raises(ValueError, match="--emulated-step emulates a slowed worker only"):
            unequal.straggler_from_args(bad, 0, 3)
    with pytest.raises(ValueError, match="--emulated-step must be seconds > 0"):
        unequal.straggler_from_args(_parsed(["--emulated-step", "-1"]), 0, 3)
    assert "--emulated-step" in unequal.straggler_flags(args)


def _opt(outer_steps: int, tau: int, plans: list[list[int]] | None, steps: int = 0):
    period = None if plans is None else argparse.Namespace(plans=plans, steps=steps)
    return argparse.Namespace(outer_steps=outer_steps, tau=tau, period=period)


def test_emulated_seconds_wait_for_the_slowest_worker_of_each_period():
    args = _parsed(["--slow-factor", "2", "--emulated-step", "0.5"])  # rank 3: 1 s a step
    assert unequal.emulated_seconds(args, _opt(0, 4, None), 4) == 0.0
    assert unequal.emulated_seconds(args, _opt(3, 4, None), 4) == 12.0  # 3 x 4 steps x 1 s
    # First period 4 steps everywhere (4 s); then [8, 8, 8, 4]: 4 s; then [8, 8, 8, 2]: 4 s
    # (fast: 8 x 0.5); the plan of the period in progress does not count.
    plans = [[8, 8, 8, 4], [10, 8, 8, 2], [8, 8, 8, 4]]
    assert unequal.emulated_seconds(args, _opt(3, 4, plans), 4) == 4.0 + 4.0 + 5.0


def test_schedule_step_is_the_count_based_step_with_tau_planned_steps():
    assert unequal.schedule_step(_opt(2, 12, None), 12, 5) == 29.0
    assert unequal.schedule_step(_opt(2, 12, [[24, 12]], steps=12), 12, 5) == 29.0
    assert unequal.schedule_step(_opt(2, 12, [[24, 12]], steps=24), 12, 6) == 27.0  # half a step
    assert unequal.schedule_step(_opt(2, 12, [[24, 12]], steps=24), 12, 30) == 36.0  # capped


@pytest.mark.slow  # three whole runs of a few seconds: the default tier, not the fast one
def test_emulated_time_based_periods_train_the_count_based_run_when_speeds_are_equal(tmp_path):
    """With emulated time, equal speeds and a period of tau steps, time-based periods plan tau
    steps everywhere, read the lr schedule at the same steps, and train the count-based run bit
    for bit; with one worker slowed 2x and a period of 2 tau seconds the fast workers take 2 tau
    steps, and the evaluations fall at the same emulated seconds."""

    def run(*flags: str) -> dict:
        out = tmp_path / "summary.json"
        argv = ["--threads", "3", "--algo", "localsgd", "--slowmo", "--tau", "4", "--seed", "3"]
        argv += ["--epoch-steps", "8", "--epochs", "2", "--no-progress", "--emulated-step", "1"]
        argv += ["--logdir", str(tmp_path), "--summary-json", str(out), *flags]
        assert common.run_cli(mnist1d_cnn.main, argv) == 0
        return json.loads(out.read_text())

    count = run()
    timed = run("--period-seconds", "4")
    assert timed["steps_all_workers"] == count["steps_all_workers"] == 3 * 16
    assert timed["val_loss"] == count["val_loss"] and timed["train_loss"] == count["train_loss"]
    assert timed["emulated_curve"] == count["emulated_curve"]
    assert [s for s, _ in count["emulated_curve"]] == [8.0, 16.0]
    slowed = run("--period-seconds", "8", "--slow-factor", "2", "--merge", "samples")
    # First period 4 steps each, then 3 periods of [8, 8, 4]: 12 + 3 x 20 steps.
    assert slowed["steps_all_workers"] == 12 + 3 * 20
    assert [s for s, _ in slowed["emulated_curve"]] == [16.0, 32.0]
