"""The old spellings of ``DistributedOptimizer``'s arguments keep working (issue 27): a codec name
passed as ``compression=`` (now ``codec=``) and ``eager=True``/``False`` (now ``"shares"``/None)
warn with a ``DeprecationWarning``, train bit for bit as the new spellings do on thread workers,
and a state saved by the version that only knew the old spellings loads without complaint.

``tests/data/state_old_words/`` holds that version's states (saved at commit aa14d4f, before
the rename, by ``python tests/test_deprecations.py --write-states`` run on that commit's code):
3 thread workers, ``compression="int8", error_feedback=True, overlap=2, eager=True``, saved at
step 9 with the outer step of step 8 in flight.
"""

import argparse
import os
import sys
import warnings
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hvd_slowmo import DistributedOptimizer, SlowMoConfig
from hvd_slowmo.comm.base import Communicator
from hvd_slowmo.comm.local import ThreadWorld, run_threads
from hvd_slowmo.config import saved_config_changes

from reference import loss_at, lr_at, make_model, params_of

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "state_old_words")
#: The settings of the saved states, in the old words and in the new ones.
SAVED_OLD = dict(compression="int8", error_feedback=True, overlap=2, eager=True)
SAVED_NEW = dict(codec="int8", error_feedback=True, overlap=2, eager="shares")
SAVED_AT, STEPS, WORKERS = 9, 14, 3

#: old arguments, new arguments, what the warning says to pass instead
SPELLINGS = {
    "compression-codec": (
        dict(compression="int8", error_feedback=True),
        dict(codec="int8", error_feedback=True),
        "codec='int8'",
    ),
    "compression-fp16-codec": (dict(compression="fp16"), dict(codec="fp16"), "codec='fp16'"),
    "eager-true": (dict(overlap=2, eager=True), dict(overlap=2, eager="shares"), "'shares'"),
    "eager-false": (dict(overlap=1, eager=False), dict(overlap=1, eager=None), "eager=None"),
    "both": (SAVED_OLD, SAVED_NEW, "codec='int8'|'shares'"),
}


def _optimizer(comm: Communicator, model: torch.nn.Module, **kwargs: Any) -> DistributedOptimizer:
    return DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters(),
        communicator=comm,
        tau=4,
        slow_momentum=0.6,
        **kwargs,
    )


def _train(opt: DistributedOptimizer, model: torch.nn.Module, rank: int, start: int, stop: int):
    """Steps ``[start, stop)``; the parameters after each."""
    out = []
    for k in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()
        out.append(params_of(model))
    return out


def _trajectories(kwargs: dict[str, Any]) -> list[Any]:
    """Each thread worker's parameters after every step, and its final state_dict."""

    models = [make_model() for _ in range(WORKERS)]  # torch's seed is global: not in threads

    def worker(comm: Communicator) -> Any:
        model = models[comm.rank]
        opt = _optimizer(comm, model, **kwargs)
        return _train(opt, model, comm.rank, 0, STEPS), opt.state_dict()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return run_threads(WORKERS, worker)


def _same(a: Any, b: Any) -> bool:
    """Nested containers of tensors equal bitwise."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("case", list(SPELLINGS))
def test_old_spelling_warns_and_is_stored_in_new_words(case):
    old, new, fix = SPELLINGS[case]
    comm = ThreadWorld(1).communicator(0)
    with pytest.warns(DeprecationWarning, match=fix) as record:
        opt = _optimizer(comm, make_model(), **old)
    # The warning points at the caller's line, not into the library.
    assert all(w.filename == __file__ for w in record if w.category is DeprecationWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new words do not warn
        want = _optimizer(comm, make_model(), **new)
    assert opt.config == want.config
    assert opt.config.eager in (None, "shares", "local")
    assert opt._settings() == want._settings()


@pytest.mark.parametrize("case", list(SPELLINGS))
def test_old_spelling_trains_bit_for_bit_as_the_new(case):
    old, new, _ = SPELLINGS[case]
    got, want = _trajectories(old), _trajectories(new)
    for rank in range(WORKERS):
        assert _same(got[rank][0], want[rank][0]), f"rank {rank}: parameters differ"
        assert _same(got[rank][1], want[rank][1]), f"rank {rank}: state_dicts differ"


def test_config_takes_the_old_eager_with_a_warning():
    with pytest.warns(DeprecationWarning, match="eager=True is deprecated: pass eager='shares'"):
        config = SlowMoConfig(overlap=1, eager=True)
    assert config.eager == "shares"
    assert config.summary()["eager"] == "shares"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(codec="int8", compression="fp16"), ValueError, ["codec='int8'", "compression="]),
        (dict(codec="int8", compression="int8"), ValueError, ["codec='int8'", "compression="]),
        (dict(eager="yes", overlap=1), ValueError, ["eager", "'shares'"]),
        (dict(eager=1, overlap=1), TypeError, ["eager", "'shares'"]),
        (dict(codec=8), TypeError, ["codec"]),
    ],
    ids=[
        "codec-and-codec-in-compression",
        "same-codec-twice",
        "unknown-eager",
        "int-eager",
        "codec-not-a-name",
    ],  # fmt: skip
)
def test_conflicting_or_bad_words_raise(kwargs, error, words):
    with pytest.raises(error) as info:
        _optimizer(ThreadWorld(1).communicator(0), make_model(), **kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_a_saved_configuration_in_old_words_is_no_change():
    new = {"codec": "int8", "eager": "shares", "tau": 4}
    assert saved_config_changes({"compression": "int8", "eager": True, "tau": 4}, new) == []
    assert saved_config_changes({"compression": None, "eager": False}, {"codec": None}) == []
    # A real change still shows, under the new word.
    assert saved_config_changes({"compression": "fp16", "eager": True}, new) == [
        "codec: 'fp16' -> 'int8'"
    ]


def _saved(rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(DATA, f"rank{rank}.pt"), weights_only=False)


def test_a_state_saved_in_old_words_loads_and_resumes():
    assert _saved(0)["opt"]["slowmo"]["config"]["compression"] == "int8"  # the old words
    models = [make_model() for _ in range(WORKERS)]

    def resumed(comm: Communicator) -> Any:
        state = _saved(comm.rank)
        model = models[comm.rank]
        model.load_state_dict(state["model"])
        opt = _optimizer(comm, model, **SAVED_NEW)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "saved with other settings" warning
            opt.load_state_dict(state["opt"])
        config = opt.state_dict()["slowmo"]["config"]
        return _train(opt, model, comm.rank, SAVED_AT, STEPS), config

    fresh = [make_model() for _ in range(WORKERS)]

    def whole(comm: Communicator) -> Any:
        model = fresh[comm.rank]
        opt = _optimizer(comm, model, **SAVED_NEW)
        return _train(opt, model, comm.rank, 0, STEPS)[SAVED_AT:]

    got, want = run_threads(WORKERS, resumed), run_threads(WORKERS, whole)
    for rank in range(WORKERS):
        params, config = got[rank]
        assert config["codec"] == "int8" and config["eager"] == "shares"
        assert "compression" not in config
        # The states were written on another machine: compared with float32's tolerance.
        for step, (a, b) in enumerate(zip(params, want[rank])):
            for x, y in zip(a, b):
                torch.testing.assert_close(
                    x, y, rtol=1e-5, atol=1e-6, msg=lambda m, s=step: f"step {s}: {m}"
                )


def write_states() -> None:
    """Save the states of ``SAVED_OLD`` at step ``SAVED_AT`` (run with the pre-rename code)."""
    os.makedirs(DATA, exist_ok=True)

    models = [make_model() for _ in range(WORKERS)]

    def save(comm: Communicator) -> None:
        model = models[comm.rank]
        opt = _optimizer(comm, model, **SAVED_OLD)
        _train(opt, model, comm.rank, 0, SAVED_AT)
        state = {"model": model.state_dict(), "opt": opt.state_dict()}
        torch.save(state, os.path.join(DATA, f"rank{comm.rank}.pt"))

    run_threads(WORKERS, save)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-states", action="store_true", help=f"write {DATA}")
    if parser.parse_args().write_states:
        write_states()
