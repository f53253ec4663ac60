"""Test tiers and run order.

**Tiers** (README, "Tests"). A *launch* is a test that starts real processes (horovodrun, mpirun,
torchrun: marked ``horovod``/``torchdist``) or is allowed more than the default timeout (builds,
Docker, the main job). Launches cost 5-80 s each on 2 cores, most of it process start-up, and
many repeat one check at another world size or engine.

- ``./test.sh --tier fast``: the unit and in-process reference tests that take seconds, for every
  edit (budget: 3 minutes on 2 cores). An in-process test that takes longer is marked ``slow``
  (or its module allows itself more than the default timeout): it runs in the default tier.
- ``./test.sh`` (``--tier default``): every in-process test, and one launch per engine and per
  feature (:data:`DEFAULT_LAUNCHES`); budget: 10 minutes on 2 cores.
- ``./test.sh --tier launches``: only the launches the default tier leaves out (the other world
  sizes and engines, the whole fault matrix, torchrun restarts, the examples, the builds). CI
  runs it after the default tier.
- ``./test.sh --tier siblings``: the launches CI leaves out (:data:`SIBLING_LAUNCHES`): a check
  CI runs, repeated at another world size or on the other engine.
- ``./test.sh --tier full``: all of them.

The tier decides what is collected, never whether a collected test passes: a test left out is
reported as *deselected* in pytest's closing line, so the count of what ran is always visible.
The run ends with its tier's time against the tier's budget (:data:`BUDGET_S`), and a fast run
names any test that took longer than :data:`FAST_TEST_S` (mark it ``slow``); tests/test_tiers.py
checks the marks against the durations recorded in tests/data/fast_durations.json.

**Order.** pytest runs tests in collection order (file by file, alphabetically). The in-process
tests run first, so that a failure shows within the first minutes, then the launches; the order
inside each group is kept.
"""

import json
import os
import time

import pytest
import torch

MULTI_PROCESS_MARKERS = ("horovod", "torchdist")
DEFAULT_TIMEOUT_S = 300  # pytest.ini's timeout

# The launches of the default tier: per engine (Horovod over Gloo and MPI, torch.distributed,
# plain mpirun) and per feature (the exact average, overlap, streaming, the int8 and sparse codecs,
# gossip, gradient buckets, AMP, sharding, faults, restart, the straggler quorum), the
# cheapest test that checks it against its reference across real processes. Their siblings at
# other world sizes and engines are in the launch tier.
DEFAULT_LAUNCHES = (
    "tests/test_amp_horovod.py::test_overflow_on_one_rank_is_skipped_everywhere[np2-mpi]",
    "tests/test_compression_horovod.py::test_equals_reference_on_every_rank[np3-gloo]",
    "tests/test_compression_horovod.py::test_torch_distributed_equals_reference_on_every_rank",
    "tests/test_fault_matrix.py::test_fault_cell[horovod-gloo-plain-kill]",
    "tests/test_gossip_horovod.py::test_gossip_under_horovodrun[gloo-np2]",
    "tests/test_gossip_horovod.py::test_gossip_under_horovodrun[mpi-np2]",
    "tests/test_grad_buckets_horovod.py::test_buckets_equal_the_reference[2]",
    "tests/test_horovod_core.py::test_ranks_bitwise_equal_and_match_replay[np2-gloo]",
    "tests/test_horovod_core.py::test_ranks_bitwise_equal_and_match_replay[np2-mpi]",
    "tests/test_islands.py::test_two_islands_equal_the_unsharded_run",
    "tests/test_overlap_horovod.py::test_anchors_bitwise_equal_and_match_reference[np3-gloo]",
    "tests/test_sharded.py::test_horovod_sharded_ranks_bitwise_equal_and_close_to_unsharded[np2-gloo]",
    "tests/test_sparse_horovod.py::test_equals_reference_on_every_rank[np2-gloo]",
    "tests/test_streaming_horovod.py::test_fragments_and_eager_match_the_reference_on_gloo",
    "tests/test_torchdist.py::test_communicator_collectives_config_check_and_amp[3]",
    "tests/test_torchdist.py::test_examples_detect_their_launcher[torchrun]",
    "tests/test_quorum_launch.py::test_torchrun_paused_rank_is_left_out_and_resynchronized",
    "tests/test_unequal_launch.py::test_torchrun_matches_the_reference[2]",
)
# Launches only `--tier siblings` (and `--tier full`) runs, not CI: the same check as a launch CI
# runs, at another world size or on another engine or controller, where CI already runs that
# feature at a world size above 2 (Horovod or torch.distributed: tests/test_torchdist.py's
# exactness suite at 4 ranks holds the core, overlap, sharded and gossip checks; its sparse and
# AMP launches run 3; grad buckets run 4 ranks as nodes) and on Horovod with Gloo or MPI. Kept
# out so that CI's whole run fits its 35 minutes (2451 s on 2026-11-28, over it).
SIBLING_LAUNCHES = (
    "tests/test_amp_horovod.py::test_overflow_on_one_rank_is_skipped_everywhere[np3-gloo]",
    "tests/test_compression_horovod.py::test_equals_reference_on_every_rank[np3-mpi]",
    "tests/test_cuda.py::test_two_islands_on_the_device[cpu-ddp]",
    "tests/test_gossip_horovod.py::test_gossip_under_horovodrun[gloo-np4]",
    "tests/test_gossip_horovod.py::test_gossip_under_horovodrun[mpi-np4]",
    "tests/test_grad_buckets_horovod.py::test_buckets_equal_the_reference[3]",
    "tests/test_horovod_core.py::test_ranks_bitwise_equal_and_match_replay[np4-gloo]",
    "tests/test_overlap_horovod.py::test_anchors_bitwise_equal_and_match_reference[np2-mpi]",
    "tests/test_sharded.py::test_horovod_sharded_ranks_bitwise_equal_and_close_to_unsharded[np3-gloo]",
    "tests/test_sparse_horovod.py::test_equals_reference_on_every_rank[np3-gloo]",
    "tests/test_sparse_horovod.py::test_equals_reference_on_every_rank[np3-mpi]",
)
# In-process tests that run with the builds, in the launch tier: the GPU check's whole runs on
# faked builds, each waiting on its step budgets (about 20 s each), moved out of the default tier
# when it took 621 of its 600 s on a quiet machine.
WITH_THE_BUILDS = (
    "tests/test_gpu_check.py::test_the_budget_bounds_the_whole_run",
    "tests/test_gpu_check.py::test_the_nccl_build_and_the_thread_tests_overlap",
)
# In-process tests too slow for the fast tier (they start shell scripts, MPI or Horovod
# processes, or train for seconds): measured in a --tier fast run (tests/data/fast_durations.json
# has the rest). A file, or one test of a file (every parametrization). New tests take the
# `slow` mark instead.
SLOW_IN_PROCESS = (
    "tests/test_async_start.py",
    "tests/test_cuda.py::test_codec_cost_runs_tiny_on_cpu",
    "tests/test_deadline.py",
    "tests/test_docker.py",
    "tests/test_gpu_check.py",
    "tests/test_install_horovod.py",
    "tests/test_regime_map.py::test_table_and_clearest_cell_from_the_rows",
    "tests/test_run_log.py::test_docker_check_reads_what_the_example_prints_now",
    "tests/test_serial.py",
)
TIERS = ("fast", "default", "launches", "siblings", "full")
#: Each tier's budget in seconds on the 2 cores of the build machine: CI's whole run (lint, the
#: site, the portability tier, the default and launch tiers) fits in 35 minutes.
BUDGET_S = {"fast": 180, "default": 600, "launches": 1200, "siblings": 360, "full": 2100}
#: A test of the fast tier that takes longer than this on 2 cores belongs in the default tier.
FAST_TEST_S = 10.0
_STARTED = pytest.StashKey[float]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=TIERS,
        default="default",
        help="fast: the in-process tests that take seconds; default: every in-process test and "
        "one launch per engine and feature; launches: the other launches only; full: default and "
        "launches (tests/conftest.py)",
    )
    parser.addoption(
        "--tier-report",
        metavar="FILE",
        default=None,
        help="write each collected test's tiers as JSON to FILE (tests/test_tiers.py reads it)",
    )
    parser.addoption(
        "--record-durations",
        metavar="FILE",
        default=None,
        help="write each test's seconds (setup, call and teardown) and the load as JSON to FILE "
        "(tests/data/fast_durations.json is a --tier fast run's)",
    )


_EXIT_STATUS = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STARTED] = time.monotonic()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End a command line's pytest process here, with its exit status, once the exit hooks
    have run (the library's threads joined, Horovod shut down), without the interpreter's
    finalization (:func:`helpers.end_process`): twice a run whose every test had passed then
    aborted there, which turns a passing CI run red. A session run inside a test
    (``pytest.main`` with plugins, as tests/test_gpu_check.py runs one, or any while a test
    runs) returns as usual."""
    nested = config.invocation_params.plugins or "PYTEST_CURRENT_TEST" in os.environ
    if nested or _EXIT_STATUS not in config.stash:
        return
    from helpers import end_process  # tests/, on sys.path as for the test files

    end_process(config.stash[_EXIT_STATUS])


def is_launch(item: pytest.Item) -> bool:
    """Whether ``item`` starts real processes, is allowed more than the default timeout, or is
    listed in :data:`WITH_THE_BUILDS`."""
    if any(item.get_closest_marker(name) for name in MULTI_PROCESS_MARKERS):
        return True
    if item.nodeid in WITH_THE_BUILDS:
        return True
    # Only the test's own timeout mark: a module-wide one also covers its fast tests.
    marks = [m for m in item.own_markers if m.name == "timeout" and m.args]
    return any(float(m.args[0]) > DEFAULT_TIMEOUT_S for m in marks)


def is_slow(item: pytest.Item) -> bool:
    """Whether an in-process ``item`` is too slow for the fast tier: marked ``slow``, listed in
    :data:`SLOW_IN_PROCESS`, or its module (or itself) allows more than the default timeout."""
    if item.get_closest_marker("slow"):
        return True
    test = item.nodeid.split("[")[0]
    if any(test == s or test.startswith(s + "::") for s in SLOW_IN_PROCESS):
        return True
    mark = item.get_closest_marker("timeout")
    return bool(mark and mark.args and float(mark.args[0]) > DEFAULT_TIMEOUT_S)


def _in_tier(item: pytest.Item, tier: str) -> bool:
    if tier == "full":
        return True
    if tier == "fast":
        return not is_launch(item) and not is_slow(item)
    if tier == "siblings" or item.nodeid in SIBLING_LAUNCHES:
        return tier == "siblings" and item.nodeid in SIBLING_LAUNCHES
    in_default = not is_launch(item) or item.nodeid in DEFAULT_LAUNCHES
    return in_default == (tier == "default")


def _check_listings(items: list[pytest.Item], config: pytest.Config) -> None:
    """A renamed test must not change its tier silently: every listed test must exist
    when its whole file is collected (not when the command line names some of its tests)."""
    ids = {item.nodeid for item in items}
    picked = {
        os.path.relpath(os.path.abspath(arg.split("::")[0]), config.rootpath)
        for arg in config.args
        if "::" in arg
    }
    files = {nodeid.split("::")[0] for nodeid in ids} - picked
    for listing, names in (
        ("DEFAULT_LAUNCHES", DEFAULT_LAUNCHES),
        ("SIBLING_LAUNCHES", SIBLING_LAUNCHES),
        ("WITH_THE_BUILDS", WITH_THE_BUILDS),
    ):
        missing = [n for n in names if n.split("::")[0] in files and n not in ids]
        if missing:
            raise pytest.UsageError(
                f"tests/conftest.py {listing} names tests that do not exist: {missing}; "
                "rename them there"
            )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_listings(items, config)
    report = config.getoption("--tier-report")
    if report:
        with open(report, "w", encoding="utf-8") as f:
            json.dump({i.nodeid: [t for t in TIERS if _in_tier(i, t)] for i in items}, f)
    tier = config.getoption("--tier")
    kept = [item for item in items if _in_tier(item, tier)]
    left_out = [item for item in items if not _in_tier(item, tier)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
    kept.sort(key=is_launch)  # stable: the order inside each group is unchanged
    items[:] = kept


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    """The tier's time against its budget; in the fast tier, the tests too slow for it."""
    tier = config.getoption("--tier")
    elapsed = time.monotonic() - config.stash[_STARTED]
    slow = [
        (r.nodeid, r.duration)
        for reports in terminalreporter.stats.values()
        for r in reports
        if isinstance(r, pytest.TestReport) and r.when == "call" and r.duration > FAST_TEST_S
    ]
    if tier == "fast" and slow:
        terminalreporter.write_sep("-", f"fast tier: tests over {FAST_TEST_S:g} s (mark them slow)")
        for nodeid, seconds in sorted(slow, key=lambda e: -e[1]):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
    record = config.getoption("--record-durations")
    if record:
        _record_durations(record, terminalreporter, tier, elapsed)
    over = "  OVER BUDGET" if elapsed > BUDGET_S[tier] else ""
    terminalreporter.write_line(
        f"tier {tier}: {elapsed:.0f} s (budget {BUDGET_S[tier]} s for the whole tier){over}"
    )


def _record_durations(
    path: str, terminalreporter: pytest.TerminalReporter, tier: str, elapsed: float
) -> None:
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(r, pytest.TestReport):
                seconds[r.nodeid] = round(seconds.get(r.nodeid, 0.0) + r.duration, 3)
    record = {"tier": tier, "elapsed_s": round(elapsed), "load_at_end": os.getloadavg()}
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**record, "seconds": dict(sorted(seconds.items()))}, f, indent=0)


@pytest.fixture
def one_intra_op_thread():
    """Bitwise comparisons need one intra-op thread: with two, a matmul in the main thread (the
    reference) may split its work differently from the same matmul in a worker thread (seen
    here: MKL, 2 OpenMP threads), which changes its last bits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
