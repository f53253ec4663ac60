"""Gossip bases under real horovodrun launches (Gloo -np 2/3/4, MPI -np 2/4).

One launch per case runs every check of tests/workers/gossip_worker.py; the assertions are
here, on what each rank wrote.
"""

import json
import os

import pytest

from horovod_launch import ROOT, horovodrun

WORKER = os.path.join(ROOT, "tests", "workers", "gossip_worker.py")


@pytest.mark.horovod
@pytest.mark.timeout(660)
@pytest.mark.parametrize(
    "np,controller",
    [(2, "gloo"), (3, "gloo"), (4, "gloo"), (2, "mpi"), (4, "mpi")],
    ids=["gloo-np2", "gloo-np3", "gloo-np4", "mpi-np2", "mpi-np4"],
)
def test_gossip_under_horovodrun(tmp_path, np, controller):
    # Generous timeout: the launch runs ~10 short trainings, on a machine shared with other jobs.
    horovodrun(np, controller, [WORKER, str(tmp_path)], timeout=600)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(np)]
    for r in results:
        where = f"rank {r['rank']} ({controller}, np={np})"
        assert r["size"] == np and r["mpi"] == (controller == "mpi"), where
        expected_auto = "MPICommunicator" if controller == "mpi" else "HorovodCommunicator"
        assert r["transports"]["auto"] == expected_auto, where
        for transport in ["horovod", "mpi"] if controller == "mpi" else ["horovod"]:
            assert r[f"sgp_error_{transport}"] < 1e-12, (
                f"{where}: SGP over {transport} vs the matrix reference"
            )
            assert r[f"dpsgd_error_{transport}"] < 1e-12, (
                f"{where}: D-PSGD over {transport} vs the matrix reference"
            )
            # 6 steps, one peer, 4 float64 parameters + the weight each.
            assert r[f"sgp_bytes_{transport}"] == 6 * 5 * 8, where
        if controller == "mpi":
            assert r["mpi_equals_horovod"], (
                f"{where}: MPI and Horovod transports gave different trajectories"
            )
        assert r["osgp_mass_error"] < 1e-12 and r["osgp_weight_error"] < 1e-12, (
            f"{where}: OSGP lost mass"
        )
        assert r["slowmo_identical"] == {"sgp": [True] * 3, "osgp": [True] * 3}, (
            f"{where}: ranks differ after an outer step"
        )
