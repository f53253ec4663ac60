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
