"""Time to accuracy (slowmo_lab.time_to_accuracy) on hand-made curves and event files."""

import os

import pytest
from torch.utils.tensorboard import SummaryWriter

from slowmo_lab import report
from slowmo_lab import time_to_accuracy as tta
from slowmo_lab.metrics import TAGS

pytestmark = pytest.mark.timeout(60)


def test_first_evaluation_at_or_above_the_target():
    curve = [(0.0, 10.0), (2.5, 84.9), (5.0, 85.0), (7.5, 91.0), (10.0, 89.0)]
    assert tta.time_to_accuracy(curve, 85.0) == 5.0  # reaching it exactly counts
    assert tta.time_to_accuracy(curve, 90.0) == 7.5  # the first time, not the last
    assert tta.time_to_accuracy(curve, 95.0) is None
    assert tta.time_to_accuracy([], 50.0) is None
    with pytest.raises(ValueError, match="must not decrease"):
        tta.time_to_accuracy([(2.0, 10.0), (1.0, 20.0)], 90.0)


def test_default_targets():
    finals = {"allreduce": [92.0, 93.0, 94.0], "localsgd-slowmo": [94.0, 94.4, 94.7]}
    # 85, 90, and the best mean (94.3667) minus one point, rounded down to 0.1.
    assert tta.default_targets(finals) == [85.0, 90.0, 93.3]
    # Below or at a fixed target: in order, once; no finals at all: the fixed ones.
    assert tta.default_targets({"a": [90.5]}) == [85.0, 89.5, 90.0]
    assert tta.default_targets({"a": [91.0]}) == [85.0, 90.0]
    assert tta.default_targets({"a": [None]}) == [85.0, 90.0]


def test_table_means_reached_seeds_and_speedup():
    curves = {
        "allreduce": [[(10.0, 80.0), (20.0, 90.0)], [(12.0, 85.0), (24.0, 91.0)]],
        "localsgd": [[(4.0, 86.0), (8.0, 90.5)], [(6.0, 88.0), (12.0, 89.0)]],
        "sgp": [[(5.0, 70.0)], [(5.0, 75.0)]],
    }
    rows = tta.time_to_accuracy_rows(curves, [85.0, 90.0])
    assert rows["allreduce"].to == {85.0: [20.0, 12.0], 90.0: [20.0, 24.0]}
    assert rows["localsgd"].to[90.0] == [8.0, None]
    assert rows["localsgd"].final == [90.5, 89.0] and rows["localsgd"].seconds == [8.0, 12.0]
    table = tta.time_to_accuracy_table(curves, [85.0, 90.0])
    cells = {
        line.split()[0]: [c.strip() for c in line.split("  ") if c.strip()]
        for line in table.splitlines()[2:]
    }
    assert table.splitlines()[0].split("  ")[-1].strip() == "speed-up to 90% vs allreduce"
    # allreduce: 85% at 20 and 12 s -> 16.0 ± 5.7; 90% at 20 and 24 s -> 22.0 ± 2.8.
    assert cells["allreduce"] == [
        "allreduce",
        "2",
        "90.50 ± 0.71",
        "22.0 ± 2.8",
        "16.0 ± 5.7",
        "22.0 ± 2.8",
        "1.00x",
    ]
    # One seed of two reached 90%: its time alone, marked, and no speed-up from half the seeds.
    assert cells["localsgd"][4:] == ["5.0 ± 1.4", "8.0 (1/2 seeds)", "-"]
    assert cells["sgp"][4:] == ["never", "never", "-"]
    # Without the reference method there is no speed-up column.
    no_ref = tta.time_to_accuracy_table({"sgp": curves["sgp"]}, [85.0, 90.0])
    assert "speed-up" not in no_ref


def test_run_curve_joins_seconds_and_accuracy_by_step(tmp_path):
    folder = str(tmp_path / "run")
    w = SummaryWriter(folder)
    for step, seconds in [(0, 0.0), (36, 1.5), (72, 3.0)]:
        w.add_scalar(TAGS["train_s"], seconds, step)
    for step, acc in [(36, 60.0), (72, 80.0)]:
        w.add_scalar(TAGS["val_accuracy"], acc, step)
    w.close()
    (run,) = report.load_runs([folder])
    assert tta.run_curve(run) == [(1.5, 60.0), (3.0, 80.0)]
    png = report.plot([run], os.path.join(folder, "fig.png"), extra_panel=tta.seconds_panel)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    bare = report.Run(name="old", path=folder, config={}, scalars={TAGS["val_accuracy"]: []})
    with pytest.raises(ValueError, match="time/train_s"):
        tta.run_curve(bare)


def test_a_loss_is_reached_at_or_below_the_target():
    curve = [(1.0, 3.0), (2.0, 2.5), (3.0, 2.6), (4.0, 2.4)]
    assert tta.time_to_accuracy(curve, 2.5, lower_is_better=True) == 2.0
    assert tta.time_to_accuracy(curve, 2.45, lower_is_better=True) == 4.0
    assert tta.time_to_accuracy(curve, 2.0, lower_is_better=True) is None
    assert tta.time_to_accuracy(curve, 2.5) == 1.0  # as an accuracy: the first at or above


def test_value_at_seconds_is_the_last_evaluation_by_then():
    curve = [(1.0, 3.0), (2.0, 2.5), (3.0, 2.6)]
    assert tta.value_at_seconds(curve, 2.0) == 2.5  # an evaluation exactly at the budget counts
    assert tta.value_at_seconds(curve, 2.9) == 2.5
    assert tta.value_at_seconds(curve, 99.0) == 2.6
    assert tta.value_at_seconds(curve, 0.5) is None
    with pytest.raises(ValueError, match="must not decrease"):
        tta.value_at_seconds([(2.0, 1.0), (1.0, 1.0)], 5.0)


def test_loss_targets_are_the_methods_finals_rounded_up():
    finals = {"allreduce": [2.251, 2.253], "localsgd": [2.32, 2.33], "x": [None]}
    assert tta.loss_targets(finals) == [2.33, 2.26]  # 2.325 -> 2.33, 2.252 -> 2.26
    assert tta.loss_targets({"a": [2.3]}) == [2.3]  # exactly on the grid: kept


def test_loss_table_at_equal_seconds_and_speedup():
    curves = {
        "allreduce": [[(10.0, 3.0), (20.0, 2.2)], [(12.0, 3.2), (24.0, 2.3)]],
        "localsgd": [[(4.0, 2.9), (8.0, 2.5)], [(6.0, 2.8), (12.0, 2.45)]],
    }
    table = tta.loss_table(curves, [2.5, 2.3])
    lines = table.splitlines()
    head = [c.strip() for c in lines[0].split("  ") if c.strip()]
    # The shortest run trained 8 s: every run is read at its last evaluation by then.
    assert head == [
        "Method",
        "Seeds",
        "Final loss",
        "Train s (total)",
        "loss at 8.0 s",
        "s to 2.5",
        "s to 2.3",
        "speed-up to 2.5 vs allreduce",
    ]
    cells = {
        line.split()[0]: [c.strip() for c in line.split("  ") if c.strip()] for line in lines[2:]
    }
    # allreduce has no evaluation by 8 s: said, not invented.
    assert cells["allreduce"][4] == "-"
    # localsgd at 8 s: 2.5 (seed 0) and 2.8 (seed 1, its 6 s evaluation); 2.5 at 8 and 12 s.
    assert cells["localsgd"][4:] == ["2.650 ± 0.212", "10.0 ± 2.8", "never", "2.20x"]
    assert cells["allreduce"][5:] == ["22.0 ± 2.8", "22.0 ± 2.8", "1.00x"]
