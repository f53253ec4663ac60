"""The outer step reproduces the golden trajectories recorded before its refactor, bit for bit
(tests/golden.py: every base, overlap 0/1/2, sharded, worker="node", AMP skips, non-finite skips,
two param groups, resume mid-flight), and states saved in every earlier format still load and
continue on the same trajectory."""

import json

import pytest
import torch

from golden import PATH, SCENARIOS, run_scenario, saved_state_path

with open(PATH, encoding="utf-8") as f:
    GOLDEN = json.load(f)


def _first_difference(got, want):
    for rank, (g, w) in enumerate(zip(got, want)):
        for step, (a, b) in enumerate(zip(g, w)):
            if a != b:
                return f"rank {rank} first differs after step {step}"
    return "lengths differ"


def test_every_scenario_has_a_golden_record():
    assert set(GOLDEN) == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reproduces_the_golden_trajectory(name):
    got = run_scenario(SCENARIOS[name])
    assert got == GOLDEN[name], _first_difference(got, GOLDEN[name])


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
    assert got == GOLDEN[name], _first_difference(got, GOLDEN[name])
