"""The straggler quorum on real processes: torchrun over Gloo, 4 ranks, rank 3 paused for about
eight outer periods (tests/workers/quorum_worker.py). Nobody hangs; every rank ends bitwise
identical; the result is the hand-written reference replayed with the members rank 0 recorded."""

import os

import pytest
import torch
from reference_quorum import reference_quorum

from torchrun_launch import torchrun

pytestmark = [pytest.mark.torchdist, pytest.mark.timeout(300)]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "quorum_worker.py")


def test_torchrun_paused_rank_is_left_out_and_resynchronized(tmp_path):
    torchrun(4, [WORKER, str(tmp_path)], timeout=240)
    out = [torch.load(tmp_path / f"quorum.{r}.pt") for r in range(4)]
    members = out[0]["members"]
    assert len(members) == 12 and members[0] == [0, 1, 2, 3]
    assert 3 not in members[1], members
    assert any(3 in m for m in members[2:]), f"rank 3 never rejoined: {members}"
    assert out[3]["steps"] < out[0]["steps"]  # its dropped steps and the ones it skipped
    for o in out[1:]:
        for key, value in o["state"].items():
            if value.is_floating_point():
                assert torch.equal(value, out[0]["state"][key]), f"ranks differ at {key}"
    want = reference_quorum(members, 4, 0.05, 0.9, 1.0, 0.5).state_dict()
    # The reference adds in another order and replays the slow step as SGD: with rank 3 out for
    # eight periods (how long depends on timing) it drifted up to 2.2e-6 from the run (3.6e-5
    # relative, 2026-11-29), where one period replayed with the wrong members moves it by over
    # 5 relative; this tolerance holds the first with room for other CPUs' kernels.
    for key, value in out[0]["state"].items():
        if value.is_floating_point():
            torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-5)
