"""The test tiers (tests/conftest.py): every collected test in exactly one of the default and
launch tiers, the fast tier inside the default one with no launch in it, and no test recorded
as slow on these 2 cores (tests/data/fast_durations.json, from a ``--tier fast`` run) in the
fast tier, whose recorded total fits its budget."""

import json
import os
import subprocess
import sys

import pytest

from conftest import BUDGET_S, FAST_TEST_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "tests", "data", "fast_durations.json")

# Collecting every test module imports torch and Horovod: seconds, not a fast test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    """Test id -> the tiers that run it, as the conftest computes them."""
    out = tmp_path_factory.mktemp("tiers") / "tiers.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    cmd += ["--tier", "full", "--tier-report", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_each_test_runs_in_one_of_default_launches_siblings_and_fast_is_inside_default(tiers):
    assert len(tiers) > 500
    for nodeid, names in tiers.items():
        assert [t in names for t in ("default", "launches", "siblings")].count(True) == 1, nodeid
        assert "full" in names, nodeid
        assert "fast" not in names or "default" in names, nodeid
    fast = [n for n, names in tiers.items() if "fast" in names]
    assert 0 < len(fast) < len(tiers)


def test_no_launch_nor_recorded_slow_test_in_the_fast_tier(tiers):
    with open(RECORD, encoding="utf-8") as f:
        recorded = json.load(f)
    fast = {n for n, names in tiers.items() if "fast" in names}
    launches = {n for n, names in tiers.items() if "launches" in names}
    assert not fast & launches
    too_slow = {n: s for n, s in recorded["seconds"].items() if n in fast and s > FAST_TEST_S}
    assert not too_slow, f"recorded over {FAST_TEST_S:g} s: mark them slow: {too_slow}"
    total = sum(s for n, s in recorded["seconds"].items() if n in fast)
    assert total < BUDGET_S["fast"], f"the fast tier's recorded tests take {total:.0f} s"


def test_every_slow_listing_names_tests_that_exist(tiers):
    from conftest import SLOW_IN_PROCESS

    for entry in SLOW_IN_PROCESS:
        assert any(n == entry or n.startswith(entry + "::") for n in tiers), entry
        assert not any("fast" in names for n, names in tiers.items() if n.startswith(entry)), entry


def test_every_sibling_launch_has_its_check_in_ci(tiers):
    """A launch left to ``--tier siblings`` repeats a check CI runs: the same test function, in
    another parametrization, is in the default or the launch tier."""
    ci = {n.split("[")[0] for n, names in tiers.items() if {"default", "launches"} & set(names)}
    siblings = [n for n, names in tiers.items() if "siblings" in names]
    assert siblings
    assert all("[" in n and n.split("[")[0] in ci for n in siblings), siblings
