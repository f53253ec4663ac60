"""examples/unequal_quality.py (issue 37's quality table) with hand-made rows and a fake pool:
the policies' flags, the resume, and the report's targets, times and paired tests."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import unequal_quality  # noqa: E402


def _row(policy: str, seed: int, accuracies: list[float]) -> dict:
    """An MNIST-1D row evaluated every 100 emulated seconds."""
    curve = [[100.0 * (i + 1), a] for i, a in enumerate(accuracies)]
    return dict(task="mnist1d", policy=policy, seed=seed, tau=12, final=accuracies[-1],
                curve=curve, steps_all_workers=10)  # fmt: skip


def test_report_dates_targets_and_pairs_the_seeds():
    rows = []
    for seed in range(3):
        rows.append(_row("count", seed, [50.0, 70.0, 80.0 + seed, 90.0 + seed]))
        rows.append(_row("time", seed, [60.0, 85.0 + seed, 92.0, 93.0 + seed + seed % 2]))
    rows.append(_row("time", 3, [1.0, 2.0, 3.0, 4.0]))  # no count run: left out
    text = unequal_quality.report(rows)
    # count's mean final 91: targets 81, 86, 90.
    assert "3 seeds [0, 1, 2]" in text and "s to 81.00 | s to 86.00 | s to 90.00" in text
    # count reaches 81 at 300 s on seeds 1, 2 (81, 82) and 400 s on seed 0; time at 200 s.
    assert "| count | 91.00 ± 1.00 | - | 333 ± 58 (3/3) | 400 ± 0 (3/3) | 400 ± 0 (3/3) |" in text
    # time's finals 93, 95, 95: 3, 4, 3 over count; it reaches each target one evaluation sooner
    # or more.
    time_row = "| time | 94.33 ± 1.15 | t = 10.00, p = 0.010 | 200 ± 0 (3/3) | 233 ± 58 (3/3) | "
    assert time_row + "300 ± 0 (3/3) |" in text
    assert "time to 90.00, time against count (3 seeds both reached): the same difference" in text
    assert "the weights alone" not in text  # no time-samples rows


def test_run_skips_finished_runs_and_refuses_unknown_policies(tmp_path):
    out = tmp_path / "rows.jsonl"
    out.write_text('{"task": "mnist1d", "policy": "count", "seed": 0}\n')
    submitted = []

    class Pool:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            submitted.append(args[:3])
            return type("Done", (), {"result": lambda self: None})()

    args = unequal_quality.parser().parse_args(
        ["run", "--task", "mnist1d", "--out", str(out), "--seeds", "2"]
    )
    unequal_quality.run(args, pool=Pool())
    assert submitted == [("mnist1d", p, s) for s in (0, 1) for p in unequal_quality.POLICIES][1:]
    args.policies = "count,sometimes"
    with pytest.raises(ValueError, match=r"--policies: \['sometimes'\] unknown"):
        unequal_quality.run(args, pool=Pool())


def test_the_policies_share_the_period_length():
    flags, tau = unequal_quality.task_flags("mnist1d")
    assert tau == 12 and "--slowmo" in flags
    period = [f.format(period="24") for f in unequal_quality.POLICIES["time-samples"]]
    assert period == ["--period-seconds", "24", "--merge", "samples"]
    with pytest.raises(ValueError, match="--task 'cifar'"):
        unequal_quality.task_flags("cifar")
