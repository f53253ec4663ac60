"""The saved state's format 4: one entry per fragment, each with the fragment's own outer state
(:mod:`hvd_slowmo.state_format`). States saved in format 3 (tests/data/state_v3/, written by
tests/data/make_state_v3.py on the version before each fragment owned its outer state) load and
continue on the trajectory the old version computed from them, and on an uninterrupted run's; a
state loads into another cut of fragments (joined, then cut again) where nothing is in flight."""

import io
import os
import sys
import warnings

import pytest
import torch

from hvd_slowmo.comm.local import run_threads

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from make_state_v3 import CASES, STEPS, WORKERS, path

from helpers import (
    anchor_of,
    residual_of,
    resume_in_fresh_workers,
    save_states,
    slow_buffer_of,
)
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
        assert opt.outer.counters()["num_steps"] == stop
        flight = opt.outer.in_flight
        assert (flight is not None) == bool(kwargs.get("overlap"))
        # Each fragment took its own part of the model-wide entries.
        for f in opt.outer.fragments:
            state = f.slow_state
            if state.outer_optimizer is not None:
                (group,) = state.outer_optimizer.param_groups
                assert len(group["params"]) == len(f.members)
                assert len(state.outer_optimizer.state) == len(f.members)  # momentum: from file
            if kwargs.get("error_feedback"):
                assert f.exchange.residual.numel() == sum(p.numel() for p in f.live())

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


def _outer_sgd(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.6)


def test_format_4_keeps_each_fragment_s_outer_state_in_its_entry(one_intra_op_thread):
    kwargs, stop = dict(overlap=3, fragments=2, codec="int8", error_feedback=True), 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        states = save_states(2, build(**kwargs), train, stop)
    saved = torch.load(io.BytesIO(states[0]), weights_only=False)
    assert saved["opt"]["format"] == 4
    slowmo = saved["opt"]["slowmo"]
    assert not {"slow_state", "exchange", "in_flight", "eager_shares"} & set(slowmo)
    model = saved["model"]
    numels = [model[k].numel() for k in ("0.weight", "0.bias", "2.weight", "2.bias")]
    numels += [model[k].numel() for k in ("3.weight", "3.bias")]
    entries = slowmo["fragments"]
    assert [e["members"] for e in entries] == [[0, 1, 4, 5], [2, 3]]  # layers 0 and 3, layer 2
    for e in entries:
        assert set(e["slow_state"]["anchor"]) == set(range(len(e["members"])))
        assert e["exchange"]["residual"].numel() == sum(numels[j] for j in e["members"])
    # Fragment 0 (boundary at 3) is in flight at step 10: its entry alone holds it.
    assert entries[0]["in_flight"]["land_at"] == 6 and entries[1]["in_flight"] is None


def _save(kwargs, stop, m=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return save_states(m, build(**kwargs), train, stop)


def _loaded(states, kwargs):
    """Each rank's optimizer after loading ``states`` (its model from the file too)."""
    from reference import make_model

    models = [make_model(seed=5) for _ in states]

    def worker(comm):
        ckpt = torch.load(io.BytesIO(states[comm.rank]), weights_only=False)
        models[comm.rank].load_state_dict(ckpt["model"])
        opt = build(**kwargs)(comm, models[comm.rank])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the settings differ: fragments
            opt.load_state_dict(ckpt["opt"])
        return opt

    return run_threads(len(states), worker)


def _momentum(opt):
    """Each parameter's slow buffer, or its custom outer optimizer's momentum."""
    if opt.slow_states[0].outer_optimizer is None:
        return slow_buffer_of(opt)
    out = [None] * len(opt.params)
    for f in opt.outer.fragments:
        outer = f.slow_state.outer_optimizer
        for j, a in zip(f.members, f.slow_state.anchor):
            out[j] = outer.state[a]["momentum_buffer"]
    return out


def _assert_same_outer_state(a, b):
    """Per parameter: the same anchor, slow buffer (or outer momentum) and residual."""
    assert all(torch.equal(x, y) for x, y in zip(anchor_of(a), anchor_of(b)))
    assert all(torch.equal(x, y) for x, y in zip(_momentum(a), _momentum(b)))
    assert torch.equal(residual_of(a), residual_of(b))


def _resaved(opts):
    """Each optimizer's state_dict, as torch.save wrote it (no model)."""
    out = []
    for opt in opts:
        buf = io.BytesIO()
        torch.save({"model": {}, "opt": opt.state_dict()}, buf)
        out.append(buf.getvalue())
    return out


@pytest.mark.parametrize("outer", ["heavyball", "custom"])
def test_a_state_loads_into_other_fragments_per_parameter(outer, one_intra_op_thread):
    """Saved by 2 fragments, loaded by 3 and by 1, and saved again and loaded back by 2: every
    parameter keeps its anchor, slow buffer (or outer momentum) and residual."""
    common = dict(codec="int8", error_feedback=True)
    if outer == "custom":
        common["outer_optimizer"] = _outer_sgd
    states = _save(dict(fragments=2, **common), 8)  # no average in flight (overlap=0)
    want = _loaded(states, dict(fragments=2, **common))
    assert all(residual_of(opt) is not None for opt in want)  # both fragments averaged
    for fragments in (3, 1):
        got = _loaded(states, dict(fragments=fragments, **common))
        for a, b in zip(got, want):
            assert len(a.outer.fragments) == fragments
            _assert_same_outer_state(a, b)
        back = _loaded_opt_only(_resaved(got), dict(fragments=2, **common), states)
        for a, b in zip(back, want):
            _assert_same_outer_state(a, b)


def _loaded_opt_only(opt_states, kwargs, model_states):
    """As :func:`_loaded`, the models from ``model_states``, the optimizers from ``opt_states``."""
    mixed = []
    for opt_bytes, model_bytes in zip(opt_states, model_states):
        ckpt = torch.load(io.BytesIO(model_bytes), weights_only=False)
        ckpt["opt"] = torch.load(io.BytesIO(opt_bytes), weights_only=False)["opt"]
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        mixed.append(buf.getvalue())
    return _loaded(mixed, kwargs)


def test_a_state_cut_otherwise_is_refused_where_it_cannot_be_recut():
    """An outer step in flight, and a sharded slow state, belong to their fragments: loading
    them into another cut says so (as format 3 did), and changes nothing."""
    in_flight = _save(dict(fragments=2, overlap=1), 9)
    with pytest.raises(ValueError, match="fragments=2 and one in flight.*fragments=3"):
        _loaded(in_flight, dict(fragments=3, overlap=1))
    sharded = _save(dict(fragments=2, shard_slow_state=True), 8)
    with pytest.raises(ValueError, match="shard layout"):
        _loaded(sharded, dict(fragments=3, shard_slow_state=True))
