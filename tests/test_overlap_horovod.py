"""The overlapped outer step under horovodrun (Gloo and MPI): Horovod's asynchronous grouped
allreduce, anchors bitwise identical on every rank after every landing, equal to the delayed
reference (tests/reference_overlap.py), and resume with an average in flight."""

import os

import pytest
import torch

from horovod_launch import horovodrun
from reference_overlap import reference_overlapped

WORKER = os.path.join(os.path.dirname(__file__), "workers", "overlap_worker.py")
pytestmark = pytest.mark.horovod
LAUNCHES = [(3, "gloo"), (2, "mpi")]
SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
REFS = {  # name: (tau, d, alpha, beta, buffers, atol)
    "localsgd-d1": (3, 1, 0.7, 0.6, "reset", 1e-5),
    "localsgd-d2-maintain": (4, 2, 1.0, 0.5, "maintain", 1e-5),
    "fp16-d1": (3, 1, 1.0, 0.6, "reset", 2e-3),  # fp16 rounds the averaged payload
}


@pytest.mark.parametrize("np_,controller", LAUNCHES, ids=[f"np{n}-{c}" for n, c in LAUNCHES])
def test_anchors_bitwise_equal_and_match_reference(tmp_path, np_, controller):
    from reference import lr_at

    horovodrun(np_, controller, [WORKER, str(tmp_path), "train"])
    results = [torch.load(tmp_path / f"train.{r}.pt", weights_only=False) for r in range(np_)]
    for name in results[0]:
        anchors = [res[name]["anchors"] for res in results]
        assert len(anchors[0]) >= 2, name
        for per_rank in zip(*anchors):
            for tensors in zip(*per_rank):
                assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), (
                    f"{name}: anchors differ"
                )
        if name in REFS:
            tau, d, alpha, beta, buffers, atol = REFS[name]
            want = reference_overlapped(
                np_, 11, tau, d, alpha, beta, SGD, buffers, lr_schedule=lr_at
            )
            for rank, ref in enumerate(want):
                got = results[rank][name]["final"]
                for key, value in ref.state_dict().items():
                    torch.testing.assert_close(
                        got[key], value, rtol=1e-4, atol=atol, msg=f"{name} {key}"
                    )


def test_resume_with_an_average_in_flight(tmp_path):
    horovodrun(2, "gloo", [WORKER, str(tmp_path), "train"])
    horovodrun(2, "gloo", [WORKER, str(tmp_path), "save", "5"])  # boundary at 4, lands at 6
    horovodrun(2, "gloo", [WORKER, str(tmp_path), "resume", "5"])
    for rank in range(2):
        full = torch.load(tmp_path / f"train.{rank}.pt", weights_only=False)["localsgd-d2-maintain"]
        resumed = torch.load(tmp_path / f"resume.{rank}.pt", weights_only=False)["final"]
        for key in full["final"]:
            assert torch.equal(full["final"][key], resumed[key]), key
