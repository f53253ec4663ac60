"""The torch.distributed engine for real: processes under torchrun over Gloo.

The exact-reference checks of the Horovod tests (core, overlap, sharded slow state, every gossip
base, worker="node", resume, configuration mismatch) run in tests/workers/torchdist_worker.py
with the engine chosen automatically; the assertions are here. One launch per case keeps the
start-up cost (~10 s per torchrun on a loaded 2-core machine) down.
"""

import os
import subprocess
import sys

import pytest
import torch

from hvd_slowmo.comm.base import shard_range

from horovod_launch import ROOT, horovodrun
from reference import lr_at, reference_allreduce, reference_slowmo
from reference_overlap import reference_overlapped
from torchrun_launch import torchrun

WORKER = os.path.join(ROOT, "tests", "workers", "torchdist_worker.py")
pytestmark = [pytest.mark.torchdist, pytest.mark.timeout(900)]

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
CORE_REFS = {  # as tests/test_horovod_core.py
    "sgd-reset": lambda m: reference_slowmo(m, 9, 3, 0.7, 0.6, SGD, buffers="reset"),
    "adam-average": lambda m: reference_slowmo(m, 9, 2, 1.0, 0.5, ADAM, buffers="average"),
    "sgd-fp16": lambda m: reference_slowmo(m, 9, 3, 1.0, 0.5, SGD, buffers="reset"),
    "allreduce": lambda m: reference_allreduce(m, 9, SGD),
}
OVERLAP_REFS = {  # name: (tau, d, alpha, beta, buffers, atol), as tests/test_overlap_horovod.py
    "localsgd-d1": (3, 1, 0.7, 0.6, "reset", 1e-5),
    "localsgd-d2-maintain": (4, 2, 1.0, 0.5, "maintain", 1e-5),
}


def load(path, mode, np_):
    return [torch.load(path / f"{mode}.{r}.pt", weights_only=False) for r in range(np_)]


def assert_ranks_bitwise_equal(per_rank, what):
    """``per_rank[r]`` is rank r's list (one entry per outer step) of tensor lists."""
    assert len(per_rank[0]) >= 2, f"{what}: too few outer steps recorded"
    for step, tensors in enumerate(zip(*per_rank)):
        for group in zip(*tensors):
            assert all(torch.equal(t, group[0]) for t in group[1:]), (
                f"{what}: ranks differ after outer step {step}"
            )


def assert_close_to(got_state, ref_model, atol, what):
    for key, value in ref_model.state_dict().items():
        torch.testing.assert_close(got_state[key], value, rtol=1e-4, atol=atol, msg=f"{what} {key}")


@pytest.mark.parametrize("np_", [3])
def test_communicator_collectives_config_check_and_amp(tmp_path, np_):
    """Every hook on rank-dependent tensors: the exact average (sync and async) bitwise equal on
    every rank and equal to the mean, reduce-scatter with uneven and empty shards, all-gather,
    point-to-point exchange with two peers, objects, byte counting. In the same launch: the
    configuration check names the rank that differs (an error, not a hang), and AMP overflows
    on one rank are skipped everywhere (tests/test_amp_horovod.py's checks)."""
    torchrun(np_, [WORKER, str(tmp_path), "comm"])
    res = load(tmp_path, "comm", np_)
    for key in ("average", "average_start", "gathered"):
        for r in res[1:]:
            assert all(torch.equal(a, b) for a, b in zip(res[0][key], r[key])), key
    for i, sent in enumerate(zip(*[r["sent"] for r in res])):
        torch.testing.assert_close(res[0]["average"][i], sum(sent) / np_, rtol=0, atol=1e-6)
        assert torch.equal(res[0]["average_start"][i], res[0]["average"][i])
    for i, flats in enumerate(zip(*[r["flats"] for r in res])):
        total = flats[0].clone()
        for f in flats[1:]:
            total += f  # rank order, as the communicator sums the received shards
        want = total / np_
        assert torch.equal(res[0]["gathered"][i], want)
        for rank in range(np_):
            start, end = shard_range(want.numel(), rank, np_)
            assert torch.equal(res[rank]["shards"][i], want[start:end]), (i, rank)
    for rank, r in enumerate(res):
        want = {(rank - h) % np_: torch.arange(3.0) + 10 * ((rank - h) % np_) + h for h in (1, 2)}
        assert r["received"].keys() == want.keys()
        assert all(torch.equal(r["received"][s], want[s]) for s in want), r["received"]
        assert r["objects"] == [("rank", i) for i in range(np_)]
        assert r["broadcast"] == f"from {np_ - 1}"
        assert r["bytes"] > 0
    assert res[0]["done_before_and_after"] == (False, True), "done() before the message arrived"
    for r in res:
        assert "rank 1: tau=4 (rank 0: 3)" in r["mismatch"], r["mismatch"]
    check_amp([r["amp"] for r in res])


def _check_core_and_overlap(res, np_):
    for name, ref in CORE_REFS.items():
        assert res[0][name]["comm"] == "TorchDistCommunicator", "engine='auto' chose another engine"
        assert_ranks_bitwise_equal([r[name]["snaps"] for r in res], name)
        assert res[0][name]["bytes"] > 0
        atol = 2e-3 if name == "sgd-fp16" else 1e-5  # fp16 rounds the averaged payload
        for rank, want in enumerate(ref(np_)):
            assert_close_to(res[rank][name]["final"], want, atol, f"{name} rank {rank}")
    for name in ("localsgd-d1", "localsgd-d2-maintain", "sgp-d1"):
        assert_ranks_bitwise_equal([r[name]["anchors"] for r in res], name)
    for name, (tau, d, alpha, beta, buffers, atol) in OVERLAP_REFS.items():
        want = reference_overlapped(np_, 11, tau, d, alpha, beta, SGD, buffers, lr_schedule=lr_at)
        for rank, ref in enumerate(want):
            assert_close_to(res[rank][name]["final"], ref, atol, f"{name} rank {rank}")


def _check_sharded(res, np_):
    # Sharded slow state, ~2/m the memory: the reduce-scatter sums in rank order, the plain
    # average in Gloo's ring order, so with 3 or more ranks they agree to rounding (bitwise at 2:
    # a + b).
    plain, sharded = "sharded-False", "sharded-True"
    assert_ranks_bitwise_equal([r[sharded]["snaps"] for r in res], sharded)
    for r in res:
        for a, b in zip(r[plain]["snaps"], r[sharded]["snaps"]):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        assert r[sharded]["state_bytes"] < r[plain]["state_bytes"] * (1.5 / np_ + 0.1)


def _check_gossip(res):
    for rank, r in enumerate(res):
        g = r["gossip"]
        assert g["sgp_transport"] == "TorchDistCommunicator"
        assert g["sgp_error"] < 1e-12 and g["dpsgd_error"] < 1e-12, f"rank {rank}: {g}"
        assert g["osgp_mass_error"] < 1e-12 and g["osgp_weight_error"] < 1e-12
    for base in ("sgp", "osgp", "dpsgd"):
        assert_ranks_bitwise_equal([r["gossip"][f"slowmo_{base}"] for r in res], base)


@pytest.mark.parametrize("np_", [4])
def test_exactness_suite_over_gloo(tmp_path, np_):
    torchrun(np_, [WORKER, str(tmp_path), "train"], timeout=540)
    res = load(tmp_path, "train", np_)
    _check_core_and_overlap(res, np_)
    _check_sharded(res, np_)
    _check_gossip(res)


def test_resume_in_fresh_processes_equals_uninterrupted(tmp_path):
    """Saved at step 5: inside the core run's second outer step, and with the overlapped run's
    average in flight (boundary 4, lands 6). The uninterrupted runs share the saving launch."""
    torchrun(2, [WORKER, str(tmp_path), "save", "5"])
    torchrun(2, [WORKER, str(tmp_path), "resume", "5"])
    full, resumed = load(tmp_path, "save", 2), load(tmp_path, "resume", 2)
    for rank in range(2):
        for name in ("sgd-reset", "localsgd-d2-maintain"):
            for key, value in full[rank][name].items():
                assert torch.equal(value, resumed[rank][name][key]), (name, key, rank)


def test_worker_node_over_two_emulated_nodes(tmp_path):
    """Two torchrun launches of 2 processes (``--node-rank 0/1``): ranks 0,1 and 2,3 are nodes;
    each case of tests/test_hierarchy.py equals the flat run over the two nodes on threads
    (tests/test_hierarchy_horovod.py)."""
    from hierarchy_cases import flat_reference

    torchrun(2, [WORKER, str(tmp_path), "node"], nnodes=2)
    everyone = load(tmp_path, "node", 4)
    for case in ("localsgd-slowmo", "sgp-slowmo", "allreduce"):
        res = [r[case] for r in everyone]
        assert [r["node_gather"] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [r["cross_gather"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
        for node in ((0, 1), (2, 3)):
            for k in range(7):
                a, b = res[node[0]]["steps"][k], res[node[1]]["steps"][k]
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (
                    f"{case}: node {node}, step {k}"
                )
        want = flat_reference(case)
        for n, node in enumerate(((0, 1), (2, 3))):
            for x, y in zip(res[node[0]]["steps"][-1], want[n]):
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def check_amp(ranks, steps=11, skipped=2, tau=3):
    """tests/test_amp_horovod.py's checks on every rank's AMP results: every rank skips rank 1's
    overflowed steps, ranks stay bitwise identical, the run equals the one without them."""
    applied = steps - skipped
    for (case, recipe), mine in ranks[0].items():
        want = ranks[0][(case, "reference")]
        assert want["snaps"] and len(mine["snaps"]) == applied // tau, (case, recipe)
        for rank, res in enumerate(ranks):
            r = res[(case, recipe)]
            assert r["counters"] == (applied, applied % tau, applied // tau), (case, recipe)
            assert r["unchanged_by_skip"], (case, recipe)
            assert r["skipped_steps"] == (0 if recipe == "reference" else skipped), (case, recipe)
            for got, ref in zip(r["snaps"], mine["snaps"]):
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), f"{case} {recipe} differ"
            ref = res[(case, "reference")]["final"]
            assert all(torch.equal(a, b) for a, b in zip(r["final"], ref)), (case, recipe, rank)


@pytest.mark.horovod
def test_horovod_and_torch_distributed_give_the_same_trajectory(tmp_path):
    """Two ranks: every sum is a + b, so the engines agree bitwise (with ``m >= 3`` the ring's
    summation order depends on each engine's buffer layout, and only the references bound both).
    The Horovod run is tests/workers/core_worker.py, whose configurations the worker copies."""
    hvd_dir, td_dir = tmp_path / "hvd", tmp_path / "td"
    hvd_dir.mkdir()
    td_dir.mkdir()
    horovodrun(
        2, "gloo", [os.path.join(ROOT, "tests", "workers", "core_worker.py"), str(hvd_dir), "train"]
    )
    torchrun(2, [WORKER, str(td_dir), "core"])
    hvd_res, td_res = load(hvd_dir, "train", 2), load(td_dir, "core", 2)
    for name in ("sgd-reset", "adam-average", "allreduce", "sgd-fp16"):
        for rank in range(2):
            for step, (a, b) in enumerate(
                zip(hvd_res[rank][name]["snaps"], td_res[rank][name]["snaps"])
            ):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (
                    f"{name} rank {rank}: Horovod and torch.distributed differ at outer step {step}"
                )
            assert hvd_res[rank][name]["bytes"] == td_res[rank][name]["bytes"], name


# --- in-process: the engine choice and the launcher detection -----------------------------------
def test_engine_choice_without_any_engine_is_a_clear_error(monkeypatch):
    import hvd_slowmo
    from hvd_slowmo.comm import factory

    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # as if Horovod were not imported
    model = torch.nn.Linear(2, 2)
    make = lambda **kw: hvd_slowmo.DistributedOptimizer(  # noqa: E731
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), **kw
    )
    with pytest.raises(ValueError, match="init_process_group"):
        make()
    with pytest.raises(
        ValueError, match="engine must be one of 'auto', 'horovod', 'torch', got 'gpu'"
    ):
        make(engine="gpu")
    with pytest.raises(RuntimeError, match="init_process_group"):
        make(engine="torch")
    with pytest.raises(ImportError, match="scripts/install_horovod.sh"):
        make(engine="horovod")
    assert factory.choose_engine("torch") == "torch"


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovodrun"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "horovodrun"),
        ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, "torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "2"}, "none"),
        ({}, "none"),
    ],
    ids=["horovodrun-gloo", "mpirun", "torchrun", "env-init", "incomplete", "plain-python"],
)
def test_examples_detect_their_launcher(env, expected):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from launch import detect_launcher
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
    assert detect_launcher(env) == expected


@pytest.mark.horovod
def test_main_job_under_torchrun_equals_horovodrun(tmp_path):
    """examples/compare.py, tiny, with each launcher: 2 workers, so every sum is a + b and every
    value the run logs (losses, accuracies, consensus distance, lr) must be identical. SGP: its
    gossip and the evaluation of the workers' average go through the launcher's engine (the
    exact average's equality is test_horovod_and_torch_distributed_give_the_same_trajectory)."""
    pytest.importorskip("mnist1d", reason="pip install mnist1d (scripts/setup_env.sh installs it)")
    from slowmo_lab import report

    runs = {}
    for launcher in ("gloo", "torchrun"):
        logdir = tmp_path / launcher
        cmd = [sys.executable, os.path.join(ROOT, "examples", "compare.py"), "--np", "2"]
        cmd += ["--epochs", "2", "--max-steps", "12", "--algos", "sgp"]
        cmd += ["--seeds", "0", "--launcher", launcher, "--logdir", str(logdir), "--no-progress"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        name = "torchrun" if launcher == "torchrun" else "horovodrun"
        assert f"one {name} launch" in proc.stdout
        runs[launcher] = {r.name: r for r in report.load_runs([str(logdir / "mnist1d")])}
    assert sorted(runs["gloo"]) == sorted(runs["torchrun"]) == ["sgp/seed0"]
    for name, hvd_run in runs["gloo"].items():
        td_run = runs["torchrun"][name]
        tags = [t for t in hvd_run.scalars if t.split("/")[0] in ("train", "val", "consensus")]
        assert "train/full_loss" in tags and "val/accuracy" in tags
        for tag in tags:
            assert hvd_run.scalars[tag] == td_run.scalars[tag], f"{name} {tag}"
