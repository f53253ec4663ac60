"""Time-based periods and the weighted merge on real processes (torchrun over Gloo; horovodrun
over Gloo): ranks bitwise identical after every outer step, and the hand-written reference
(tests/reference_unequal.py) matched at every outer step (tests/workers/unequal_worker.py)."""

import os

import pytest
import torch
from reference_unequal import reference_unequal, time_plan

from horovod_launch import ROOT, horovodrun
from reference import lr_at
from torchrun_launch import torchrun

WORKER = os.path.join(ROOT, "tests", "workers", "unequal_worker.py")
COSTS = {2: [0.125, 0.25], 4: [0.125, 0.25, 0.25, 0.5]}
SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
pytestmark = pytest.mark.timeout(600)


def samples_of(rank: int, k: int) -> float:
    return float(3 + rank + (k % 3))


def _check(out, m):
    got = [torch.load(out / f"unequal.{r}.pt", weights_only=False) for r in range(m)]
    counts = time_plan(COSTS[m], 1.0, 4, first=4)
    assert got[0]["plans"] == counts[1:] + counts[-1:]
    assert [g["steps"] for g in got] == [sum(c[i] for c in counts) for i in range(m)]
    _, want = reference_unequal(counts, samples_of, 0.7, 0.6, SGD, lr_at)
    for t in range(4):
        for g in got:
            for key in ("anchors", "params"):
                for a, b in zip(g[key][t], got[0][key][t]):
                    assert torch.equal(a, b), (key, t)
            torch.testing.assert_close(g["anchors"][t], want[t], rtol=1e-5, atol=1e-6)


@pytest.mark.torchdist
@pytest.mark.parametrize("m", [2, 4])
def test_torchrun_matches_the_reference(tmp_path, m):
    torchrun(m, [WORKER, str(tmp_path)], timeout=300)
    _check(tmp_path, m)


@pytest.mark.horovod
def test_horovodrun_matches_the_reference(tmp_path):
    pytest.importorskip("horovod.torch")
    horovodrun(2, "gloo", [WORKER, str(tmp_path)], timeout=300)
    _check(tmp_path, 2)
