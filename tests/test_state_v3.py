"""States saved in format 3 (tests/data/state_v3/, written by tests/data/make_state_v3.py on the
version before each fragment owned its outer state) load into today's optimizer and continue
on the trajectory the old version computed from them, and on an uninterrupted run's."""

import io
import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from make_state_v3 import CASES, STEPS, WORKERS, path

from helpers import resume_in_fresh_workers, save_states
from helpers import train_steps as train
from streaming_harness import build

#: Where this machine's float kernels differ from the one that wrote the files (its first
#: half does not reproduce the saved parameters bit for bit), the continuations are compared
#: with this tolerance: far below what a lost residual, share or outer momentum changes (~1e-3).
ATOL_ELSEWHERE = 1e-5


def _saved(case):
    out = []
    for rank in range(WORKERS):
        with open(path(case, rank), "rb") as f:
            out.append(f.read())
    return out


def _model(state_bytes):
    return torch.load(io.BytesIO(state_bytes), weights_only=False)["model"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_format_3_state_continues_as_the_old_version_did(case, one_intra_op_thread):
    kwargs, stop = CASES[case]
    saved = _saved(case)
    assert torch.load(io.BytesIO(saved[0]), weights_only=False)["opt"]["format"] == 3

    def check(opt):
        counters = opt.outer.counters()
        assert counters["num_steps"] == stop
        flight = opt.outer.in_flight
        assert (flight is not None) == bool(kwargs.get("overlap"))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = resume_in_fresh_workers(
            WORKERS, build(**kwargs), train, stop, STEPS, check=check, saved=saved
        )
        here = save_states(WORKERS, build(**kwargs), train, stop)
        whole = resume_in_fresh_workers(WORKERS, build(**kwargs), train, STEPS, STEPS)
    recorded = torch.load(path(case), weights_only=False)
    same_machine = all(
        torch.equal(x, _model(mine)[key])
        for theirs, mine in zip(saved, here)
        for key, x in _model(theirs).items()
    )
    atol = 0.0 if same_machine else ATOL_ELSEWHERE
    for rank, model in enumerate(resumed):
        for key, x in model.state_dict().items():
            for want in (recorded[rank][key], whole[rank].state_dict()[key]):
                torch.testing.assert_close(x, want, rtol=0, atol=atol, msg=f"{rank} {key}")
