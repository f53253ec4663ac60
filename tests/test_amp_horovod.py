"""AMP overflows on one rank under horovodrun (Gloo and MPI): every rank skips the step, ranks
stay bitwise identical after every exact average, and the run equals the one in which the
overflowed iterations never happened (see tests/amp_run.py)."""

import os

import pytest
import torch

from horovod_launch import horovodrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "amp_worker.py")
pytestmark = pytest.mark.horovod
LAUNCHES = [(3, "gloo"), (2, "mpi")]
STEPS, SKIPPED, TAU = 11, 2, 3


@pytest.mark.parametrize("np_,controller", LAUNCHES, ids=[f"np{n}-{c}" for n, c in LAUNCHES])
def test_overflow_on_one_rank_is_skipped_everywhere(tmp_path, np_, controller):
    horovodrun(np_, controller, [WORKER, str(tmp_path)])
    ranks = [torch.load(tmp_path / f"amp.{r}.pt", weights_only=False) for r in range(np_)]
    applied = STEPS - SKIPPED
    for (case, recipe), mine in ranks[0].items():
        everyone = [res[(case, recipe)] for res in ranks]
        want = ranks[0][(case, "reference")]
        assert len(mine["snaps"]) == applied // TAU, (case, recipe)
        for res in everyone:
            assert res["counters"] == (applied, applied % TAU, applied // TAU), (case, recipe)
            assert res["unchanged_by_skip"], (case, recipe)
            assert res["skipped_steps"] == (0 if recipe == "reference" else SKIPPED), (case, recipe)
            for got, ref in zip(res["snaps"], mine["snaps"]):
                assert all(torch.equal(a, b) for a, b in zip(got, ref)), (
                    f"{case} {recipe}: ranks differ"
                )
        for res, ref in zip(everyone, [r[(case, "reference")] for r in ranks]):
            assert all(torch.equal(a, b) for a, b in zip(res["final"], ref["final"])), (
                case,
                recipe,
            )
        assert want["snaps"], case
