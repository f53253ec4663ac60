"""Islands (``worker=Islands(mesh)``): SlowMo across islands of ranks that shard the model with
FSDP2 or replicate it with DDP inside (docs/islands.md).

The launches run 2 islands x 2 ranks under torchrun over Gloo (tests/islands_run.py): every rank
trains its island's model and the unsharded 2-worker reference side by side and records their
largest difference at every step, and whether its outer state (and, right after a whole-model
exact average, its shard) equals its peer's in the other island bit for bit. The in-process tests
check the bad input on a one-rank job.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

import hvd_slowmo
from hvd_slowmo.config import saved_config_changes

from torchrun_launch import torchrun

WORKER = os.path.join(os.path.dirname(__file__), "islands_run.py")

# The island's inner steps are, element for element, those of the unsharded worker (its ranks see
# one batch, so FSDP's reduction inside the island is g/2 + g/2 = g); the outer step's arithmetic
# is per element too, and the codecs' 256-value chunks are whole rows of every weight, sharded or
# not. So the two runs agree to the bit here (the records say 0.0); the bound allows another
# CPU's kernels to round a sharded and a whole tensor differently (vector body against scalar
# tail) without hiding a wrong average, which moves parameters by ~1e-3 per step.
ATOL = 1e-6


def _records(out, n=4):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _check_equal(rec, case, steps=12):
    """What every case must show: at most ATOL from the reference at every step, the outer
    state bitwise equal to the peer's at every step, the outer steps all taken."""
    problems = []
    if len(rec["diffs"]) != steps or max(rec["diffs"]) > ATOL:
        problems.append(f"{case}: differs from the unsharded run: {rec['diffs']}")
    if not rec["bitwise"] or not all(rec["bitwise"]):
        problems.append(f"{case}: outer state differs from the peer's: {rec['bitwise']}")
    # Between exact averages the consensus model (opt.consensus(): this rank's shards of the
    # islands' average) equals the unsharded run's consensus.
    if not rec["consensus"] or max(rec["consensus"]) > ATOL:
        problems.append(f"{case}: consensus differs from the unsharded run's: {rec['consensus']}")
    if rec["outer_steps"] != (steps // 6 if case == "fragments" else steps // 4):
        problems.append(f"{case}: {rec['outer_steps']} outer steps")
    return problems


@pytest.mark.torchdist
def test_two_islands_equal_the_unsharded_run(tmp_path):
    torchrun(4, [WORKER, str(tmp_path), "plain", "12"])
    problems = [p for rec in _records(tmp_path) for p in _check_equal(rec, "plain")]
    assert not problems, problems


FEATURES = ["fragments", "nesterov", "int8", "sparse", "ddp", "ddp-hierarchical", "average-buffers"]


@pytest.mark.torchdist
@pytest.mark.timeout(600)
def test_every_feature_on_islands_equals_the_unsharded_run(tmp_path):
    """One launch (one process start-up) for every feature: fragments with overlap and eager
    updates, a Nesterov outer step with fragments, int8 with error feedback, the sparse codec,
    DDP islands (also with hierarchical=True: each rank's half through int8), averaged base
    buffers; then a rank configured unlike its island. Every case is
    checked before the test fails, so one failure does not hide the others."""
    torchrun(4, [WORKER, str(tmp_path), ",".join([*FEATURES, "mismatch"]), "12"], timeout=540)
    problems = [
        p for case in FEATURES for rec in _records(tmp_path / case) for p in _check_equal(rec, case)
    ]
    for rank, rec in enumerate(_records(tmp_path / "mismatch")):
        if "configured differently across ranks" not in rec.get(
            "error", ""
        ) or "tau=5" not in rec.get("error", ""):
            problems.append(f"mismatch: rank {rank} did not refuse: {rec}")
    # The outer state is sharded like the model: an FSDP rank holds half of a DDP rank's
    # (anchor + slow buffer of 3 x 256 x 256 float32 parameters, whole or halved).
    ddp = [r["state_bytes"] for r in _records(tmp_path / "ddp")]
    fsdp = [r["state_bytes"] for r in _records(tmp_path / "int8")]
    if ddp != [2 * 3 * 256 * 256 * 4] * 4 or fsdp != [b // 2 for b in ddp]:
        problems.append(f"outer state bytes per rank: FSDP {fsdp}, DDP {ddp}")
    hierarchical = [r["exchange"] for r in _records(tmp_path / "ddp-hierarchical")]
    if hierarchical != ["hierarchical"] * 4:
        problems.append(f"ddp-hierarchical ran the exchanges {hierarchical}")
    assert not problems, problems


# --- bad input, on a one-rank job --------------------------------------------------------------
@pytest.fixture
def one_rank(tmp_path):
    """A torch.distributed job of one rank (Gloo, a file store), destroyed after the test."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mesh(shape=(1, 1), names=("islands", "shard")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _opt(model, **kw):
    return hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        **kw,
    )


def test_islands_refuse_what_is_not_a_two_dimensional_named_mesh(one_rank):
    with pytest.raises(TypeError, match="DeviceMesh"):
        hvd_slowmo.Islands("islands")
    with pytest.raises(ValueError, match="2-D mesh"):
        hvd_slowmo.Islands(_mesh((1,), ("islands",)))
    with pytest.raises(ValueError, match="across='replicate'.*not a dimension"):
        hvd_slowmo.Islands(_mesh(), across="replicate")
    islands = hvd_slowmo.Islands(_mesh())
    assert (islands.count, islands.ranks_per_island, islands.index) == (1, 1, 0)


def test_island_settings_that_cannot_run_are_refused_before_any_state(one_rank):
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    islands = hvd_slowmo.Islands(_mesh())
    cases = [
        ({"base": "allreduce"}, "HSDP"),
        ({"nonfinite": "skip"}, "nonfinite='skip' with worker=Islands"),
        ({"engine": "horovod"}, "torch.distributed"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            _opt(model, worker=islands, **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_partly_sharded_model_names_the_unsharded_parameters(one_rank):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh["shard"])  # the root and model[1] left out
    with pytest.raises(ValueError, match=r"\['1.weight', '1.bias'\] are not sharded"):
        _opt(model, worker=hvd_slowmo.Islands(mesh))


def test_a_shard_on_another_mesh_is_refused(one_rank):
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    model = torch.nn.Linear(4, 2)
    fully_shard(model, mesh=mesh["islands"])  # sharded across islands: the wrong dimension
    with pytest.raises(ValueError, match="fully_shard\\(module, mesh=mesh\\['shard'\\]\\)"):
        _opt(model, worker=hvd_slowmo.Islands(mesh))


def test_sharded_parameters_without_islands_point_to_islands(one_rank):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(4, 2)
    fully_shard(model, mesh=_mesh()["shard"])
    with pytest.raises(ValueError, match="worker=hvd_slowmo.Islands"):
        _opt(model, engine="torch")


def test_a_one_rank_island_trains_like_lookahead(one_rank):
    """One island of one rank: the outer step is the slow update of one worker (Lookahead), the
    same as the plain one-worker run over torch.distributed."""
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 2)
    b = torch.nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    opt_a = _opt(a, worker=hvd_slowmo.Islands(_mesh()), tau=2, slow_momentum=0.5)
    opt_b = _opt(b, engine="torch", tau=2, slow_momentum=0.5)
    for step in range(6):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert opt_a.state_dict()["slowmo"]["config"]["worker"] == "islands(1 x 1 ranks)"


def test_a_state_of_another_island_layout_is_refused():
    saved = {"base": "localsgd", "worker": "islands(2 x 2 ranks)"}
    for running in ("islands(4 x 1 ranks)", "islands(1 x 4 ranks)", "process"):
        with pytest.raises(ValueError, match="loads only into the same layout"):
            saved_config_changes(saved, {"base": "localsgd", "worker": running})
    assert saved_config_changes(saved, dict(saved)) == []


@pytest.mark.torchdist
@pytest.mark.timeout(600)
def test_torchrun_restart_resumes_the_islands_bitwise(tmp_path):
    """Resume in fresh processes: under torchrun --max-restarts=1 rank 1 (island 0) dies before
    step 8 of 14 (fragments=3, overlap=2, eager='local': mid-period, a fragment in flight);
    torchrun restarts all four, every rank loads the last step all of them saved (each rank its
    own file: the model's DTensor shards and opt.state_dict()), and the run ends where the
    uninterrupted one ends, bit for bit (trained first, by the first attempt's fresh processes:
    one launch for both)."""
    import signal
    import subprocess
    import sys

    from horovod_launch import ROOT, launch_env
    from torchrun_launch import free_port

    (tmp_path / "killed").mkdir()
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [exe, "--nnodes=1", "--nproc-per-node=4", "--max-restarts=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           WORKER, str(tmp_path / "killed"), "fragments", "14", "restart"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=500)
    finally:  # the workers too: torchrun killed alone would leave them running
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, err[-4000:]
    assert (tmp_path / "killed" / "killed").exists(), "rank 1 never killed itself"
    assert "exitcode: -9" in err, "torchrun saw no killed worker"
    starts = {int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "resumed at step" in line}
    assert len(starts) == 1 and 0 < starts.pop() <= 8, out[-2000:]
    for resumed in _records(tmp_path / "killed"):
        assert all(resumed["bitwise"]) and max(resumed["diffs"]) <= ATOL
    uninterrupted = _records(tmp_path / "killed" / "uninterrupted")
    problems = [p for rec in uninterrupted for p in _check_equal(rec, "fragments", steps=14)]
    assert not problems, problems
    for r in range(4):
        resumed = torch.load(tmp_path / "killed" / f"rank{r}.final.pt")
        full = torch.load(tmp_path / "killed" / "uninterrupted" / f"rank{r}.final.pt")
        assert len(resumed) == len(full) == 3
        assert all(torch.equal(a, b) for a, b in zip(resumed, full)), f"rank {r} ends elsewhere"
