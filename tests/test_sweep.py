"""The sweep runner (slowmo_lab.sweep): the commands and plans it builds for each
ablation, the paper's protocol (the base lr, then beta at that lr) and its argument checks, all
in dry-run mode (nothing is launched)."""

import json
import os
import shlex

import pytest

from slowmo_lab import sweep


def test_sweep_dry_run_prints_the_grid(capsys):
    assert (
        sweep.main(
            [
                "examples/digits.py",
                "--ablation",
                "alpha-beta",
                "--baseline",
                "--np",
                "3",
                "--dry-run",
                "--",
                "--epochs",
                "5",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 2 * 5  # the baseline, then alpha in {0.5, 1} x beta in {0.4, ..., 0.8}
    cmds = [shlex.split(line) for line in lines]
    assert all(
        c[1:3] == ["-np", "3"] and "--gloo" in c and c[-2:] == ["--epochs", "5"] for c in cmds
    )
    assert "--no-slowmo" in cmds[0]
    grid = {(c[c.index("--slow-lr") + 1], c[c.index("--slow-momentum") + 1]) for c in cmds[1:]}
    assert grid == {(a, b) for a in ("0.5", "1") for b in ("0.4", "0.5", "0.6", "0.7", "0.8")}
    assert all(c[c.index("--logdir") + 1] == os.path.join("runs", "sweep-alpha-beta") for c in cmds)
    names = [c[c.index("--run-name") + 1] for c in cmds]
    assert names[0] == "localsgd_tau12_maintain/seed0"
    assert "localsgd-slowmo_tau12_a0.5_b0.4_reset/seed0" in names


def test_sweep_tau_ablation_and_overrides(capsys):
    assert sweep.main(["x.py", "--dry-run", "--algo", "sgp", "--buffers", "reset,maintain"]) == 0
    cmds = [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert sorted((c[c.index("--tau") + 1], c[c.index("--buffers") + 1]) for c in cmds) == sorted(
        (t, b) for t in ("12", "24", "48", "96") for b in ("reset", "maintain")
    )
    assert all(c[c.index("--algo") + 1] == "sgp" for c in cmds)


def test_sweep_paper_protocol_lr_then_beta(capsys):
    """The base lr from the paper's grid (the base alone, buffers kept), each point once per
    seed, all in one launch; then beta at a fixed lr."""
    assert (
        sweep.main(
            [
                "examples/mnist1d_cnn.py",
                "--ablation",
                "lr",
                "--algo",
                "sgp",
                "--seeds",
                "100,101",
                "--one-launch",
                "--dry-run",
                "--",
                "--validation",
            ]
        )
        == 0
    )
    command, plan = capsys.readouterr().out.strip().splitlines()
    assert shlex.split(command)[-2:] == ["--plan", "PLAN.json"]
    plan = json.loads(plan)
    assert len(plan) == 5 * 2
    assert all(p[:5] == ["--no-slowmo", "--tau", "12", "--buffers", "maintain"] for p in plan)
    assert all(p[-1] == "--validation" for p in plan)
    assert [(p[p.index("--lr") + 1], p[p.index("--seed") + 1]) for p in plan] == [
        (lr, seed) for lr in ("0.01", "0.025", "0.05", "0.1", "0.15") for seed in ("100", "101")
    ]
    assert plan[0][plan[0].index("--run-name") + 1] == "sgp_tau12_maintain_lr0.01/seed100"
    assert sweep.main(["x.py", "--ablation", "beta", "--lrs", "0.05", "--dry-run"]) == 0
    cmds = [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [c[c.index("--slow-momentum") + 1] for c in cmds] == ["0.4", "0.5", "0.6", "0.7", "0.8"]
    assert all(c[c.index("--lr") + 1] == "0.05" for c in cmds)
    assert all(c[c.index("--slow-lr") + 1] == "1" for c in cmds)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["x.py", "--dry-run", "--buffers", "zero"], "--buffers: unknown strategy"),
        (["x.py", "--dry-run", "--taus", "12,many"], "--taus: 'many' is not a int"),
        (["x.py", "--dry-run", "--slow-momentums", ","], "--slow-momentums is empty"),
        (["x.py", "--dry-run", "--np", "0"], "np must be an integer >= 1"),
        (["x.py", "--dry-run", "--seeds", "one"], "--seeds: 'one' is not a int"),
        (["x.py", "--dry-run", "--lrs", ""], "--lrs is empty"),
    ],
    ids=["buffers", "taus", "betas-empty", "np", "seeds", "lrs"],
)
def test_sweep_rejects_bad_input(argv, match):
    with pytest.raises(ValueError, match=match):
        sweep.main(argv)
