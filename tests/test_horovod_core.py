"""The core optimizer for real, under horovodrun with Gloo and with MPI."""

import os

import pytest
import torch

from horovod_launch import horovodrun
from reference import reference_allreduce, reference_slowmo

WORKER = os.path.join(os.path.dirname(__file__), "workers", "core_worker.py")
pytestmark = pytest.mark.horovod
LAUNCHES = [(2, "gloo"), (4, "gloo"), (2, "mpi"), (4, "mpi")]

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
REFS = {
    "sgd-reset": lambda m: reference_slowmo(m, 9, 3, 0.7, 0.6, SGD, buffers="reset"),
    "adam-average": lambda m: reference_slowmo(m, 9, 2, 1.0, 0.5, ADAM, buffers="average"),
    "sgd-fp16": lambda m: reference_slowmo(m, 9, 3, 1.0, 0.5, SGD, buffers="reset"),
    "allreduce": lambda m: reference_allreduce(m, 9, SGD),
}


@pytest.mark.parametrize("np_,controller", LAUNCHES, ids=[f"np{n}-{c}" for n, c in LAUNCHES])
def test_ranks_bitwise_equal_and_match_replay(tmp_path, np_, controller):
    horovodrun(np_, controller, [WORKER, str(tmp_path), "train"])
    results = [torch.load(tmp_path / f"train.{r}.pt", weights_only=False) for r in range(np_)]
    for name in results[0]:
        snaps = [res[name]["snaps"] for res in results]
        assert len(snaps[0]) >= 3, name
        for per_rank in zip(*snaps):  # every exact average: bitwise identical on every rank
            for tensors in zip(*per_rank):
                assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), f"{name}: ranks differ"
        assert results[0][name]["bytes"] > 0
        if name in REFS:
            atol = 2e-3 if name == "sgd-fp16" else 1e-5  # fp16 rounds the averaged payload
            for rank, want in enumerate(REFS[name](np_)):
                got = results[rank][name]["final"]
                for key, value in want.state_dict().items():
                    torch.testing.assert_close(
                        got[key], value, rtol=1e-4, atol=atol, msg=f"{name} {key} rank {rank}"
                    )


def test_resume_in_fresh_processes_equals_uninterrupted(tmp_path):
    horovodrun(2, "gloo", [WORKER, str(tmp_path), "save", "4"])  # and the uninterrupted run
    horovodrun(2, "gloo", [WORKER, str(tmp_path), "resume", "4"])
    for rank in range(2):
        full = torch.load(tmp_path / f"save.{rank}.pt", weights_only=False)["final"]
        resumed = torch.load(tmp_path / f"resume.{rank}.pt", weights_only=False)["final"]
        for key in full:
            assert torch.equal(full[key], resumed[key]), key


def test_configuration_mismatch_is_an_error_not_a_hang(tmp_path):
    horovodrun(2, "gloo", [WORKER, str(tmp_path), "mismatch"], timeout=120)
    for rank in range(2):
        msg = (tmp_path / f"mismatch.{rank}.pt.txt").read_text()
        assert "rank 1: tau=4 (rank 0: 3)" in msg, msg
