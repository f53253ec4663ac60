"""Bad input raises an error that names the argument and the fix, and changes nothing."""

import copy

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import ThreadWorld, run_threads

from helpers import anchor_of, slow_buffer_of
from reference import loss_at, make_model


def build(model=None, **kwargs):
    model = model or make_model()
    opt = kwargs.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kwargs.setdefault("communicator", ThreadWorld(1).communicator(0))
    return DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)


BAD = {
    "tau-zero": (dict(tau=0), ValueError, "tau"),
    "tau-float": (dict(tau=2.5), TypeError, "tau"),
    "tau-bool": (dict(tau=True), TypeError, "tau"),
    "tau-string": (dict(tau="3"), TypeError, "tau"),
    "slow_lr-negative": (dict(slow_lr=-1.0), ValueError, "slow_lr"),
    "slow_lr-zero": (dict(slow_lr=0.0), ValueError, "slow_lr"),
    "slow_lr-nan": (dict(slow_lr=float("nan")), ValueError, "slow_lr"),
    "slow_lr-inf": (dict(slow_lr=float("inf")), ValueError, "slow_lr"),
    "slow_lr-string": (dict(slow_lr="1"), TypeError, "slow_lr"),
    "slow_momentum-one": (dict(slow_momentum=1.0), ValueError, "slow_momentum"),
    "slow_momentum-negative": (dict(slow_momentum=-0.1), ValueError, "slow_momentum"),
    "base-unknown": (dict(base="gossip-magic"), ValueError, "base must be one of"),
    "buffers-unknown": (dict(buffers="zero"), ValueError, "buffers must be one of"),
    "average-not-bool": (dict(average="no"), TypeError, "average"),
    "compression-bogus": (dict(compression=object()), TypeError, "compression"),
    "unknown-base-option": (dict(staleness=2), TypeError, "staleness"),
    "noaverage-localsgd": (dict(average=False), ValueError, "average=False"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_invalid_arguments(case):
    kwargs, exc, words = BAD[case]
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(exc, match=words):
        build(model, **kwargs)
    for a, b in zip(model.state_dict().values(), before.values()):
        assert torch.equal(a, b)


def test_not_an_optimizer():
    model = make_model()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DistributedOptimizer(model.parameters(), communicator=ThreadWorld(1).communicator(0))


def test_wrapping_twice():
    opt = build()
    with pytest.raises(TypeError, match="already"):
        DistributedOptimizer(opt, communicator=ThreadWorld(1).communicator(0))


def test_parameters_missing_from_named_parameters():
    model, other = make_model(), make_model()
    opt = torch.optim.SGD(list(model.parameters()) + [torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="named_parameters lacks 1"):
        DistributedOptimizer(
            opt,
            named_parameters=model.named_parameters(),
            communicator=ThreadWorld(1).communicator(0),
        )
    with pytest.raises(ValueError, match="named_parameters lacks"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=other.named_parameters(),
            communicator=ThreadWorld(1).communicator(0),
        )


def test_named_parameters_malformed():
    model = make_model()
    with pytest.raises(TypeError, match=r"\(name, tensor\) pairs"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.parameters(),
            communicator=ThreadWorld(1).communicator(0),
        )


def test_non_floating_parameter():
    p = torch.zeros(3, dtype=torch.int64)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    # SGD's constructor would refuse; simulate a hand-built group
    opt.param_groups[0]["params"].append(p)
    with pytest.raises(TypeError, match="only floating-point"):
        DistributedOptimizer(opt, communicator=ThreadWorld(1).communicator(0))


def test_mismatched_configuration_across_ranks_fails_on_every_rank():
    models = [make_model() for _ in range(3)]

    def worker(comm):
        tau = 4 if comm.rank == 2 else 3
        try:
            build(models[comm.rank], communicator=comm, tau=tau)
        except ValueError as e:
            return str(e)
        return "no error"

    messages = run_threads(3, worker)
    for msg in messages:
        assert "rank 2: tau=4 (rank 0: 3)" in msg, msg


def test_mismatched_parameter_shapes_across_ranks():
    def worker(comm):
        model = torch.nn.Linear(3, 2 + comm.rank)
        try:
            DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=model.named_parameters(),
                communicator=comm,
            )
        except ValueError as e:
            return str(e)
        return "no error"

    for msg in run_threads(2, worker):
        assert "rank 1" in msg and "parameters differ" in msg and "weight" in msg, msg


def _trained(tau=3, steps=2):
    model = make_model()
    opt = build(model, tau=tau)
    for k in range(steps):
        opt.zero_grad()
        loss_at(model, 0, k).backward()
        opt.step()
    return model, opt


def _snapshot(opt):
    return copy.deepcopy(
        (
            opt.inner_step,
            opt.num_steps,
            anchor_of(opt),
            slow_buffer_of(opt),
            opt.optimizer.state_dict(),
        )
    )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def corrupt(state, case):
    s = copy.deepcopy(state)
    if case == "not-ours":
        return {"state": {}, "param_groups": []}
    if case == "future-format":
        s["format"] = 99
    elif case == "other-model":
        s["slowmo"]["num_params"] += 1
    elif case == "bigger-tau":
        s["slowmo"]["position"]["inner_step"] = 7
    elif case == "wrong-shape":
        s["slowmo"]["fragments"][0]["slow_state"]["anchor"][0] = torch.zeros(9, 9)
    elif case == "missing-anchor-entry":
        del s["slowmo"]["fragments"][0]["slow_state"]["slow_buffer"][1]
    elif case == "base-groups":
        s["base_optimizer"]["param_groups"][0]["params"] = [0]
    return s


@pytest.mark.parametrize(
    "case",
    [
        "not-ours",
        "future-format",
        "other-model",
        "bigger-tau",
        "wrong-shape",
        "missing-anchor-entry",
        "base-groups",
    ],
)
def test_load_state_dict_rejects_and_keeps_state(case):
    _, source = _trained()
    _, target = _trained(steps=1)
    before = _snapshot(target)
    with pytest.raises(ValueError):
        target.load_state_dict(corrupt(source.state_dict(), case))
    assert _same(_snapshot(target), before)


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"base": "allreduce"}, "saved with base='localsgd', this optimizer has base='allreduce'"),
        (
            {"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=0.5)},
            "outer_optimizer='heavyball'",
        ),
    ],
    ids=["other-base", "custom-outer-optimizer"],
)
def test_load_state_dict_checks_the_saved_configuration(settings, match):
    """A state whose base algorithm or slow-state kind differs is refused, naming both values."""
    _, source = _trained()
    model = make_model()
    target = build(model, tau=3, **settings)
    before = _snapshot(target)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(source.state_dict())
    assert _same(_snapshot(target), before)


def test_load_state_dict_warns_about_changed_settings():
    """Hyperparameters may change on resume: the load goes through and says what changed."""
    _, source = _trained()
    target = build(make_model(), tau=3, slow_lr=0.5, buffers="maintain")
    with pytest.warns(UserWarning, match=r"slow_lr: 1\.0 -> 0\.5; buffers: 'reset' -> 'maintain'"):
        target.load_state_dict(source.state_dict())
    assert target.num_steps == 2


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(base=3), TypeError, "base must be one of"),
        (dict(base=torch.optim.SGD), TypeError, "BaseAlgorithm subclass"),
        (dict(buffers=None), TypeError, "buffers must be one of"),
        (dict(nonfinite="warn"), ValueError, "nonfinite must be one of"),
        (dict(outer_optimizer="adam"), ValueError, "outer_optimizer must be one of"),
        (dict(outer_optimizer=1.0), TypeError, "outer_optimizer must be one of"),
        (dict(worker=2), TypeError, "worker must be one of"),
        (
            dict(communicator="horovod"),
            TypeError,
            "communicator must be a hvd_slowmo.comm.Communicator",
        ),
    ],
    ids=[
        "base-int",
        "base-not-a-base",
        "buffers-none",
        "nonfinite-unknown",
        "outer-unknown",
        "outer-float",
        "worker-int",
        "communicator-str",
    ],
)
def test_wrong_type_is_typeerror_wrong_value_is_valueerror(kwargs, err, match):
    with pytest.raises(err, match=match):
        build(**kwargs)
