"""The mixing factor of the overlapped landing (``mix=``; Streaming DiLoCo, arXiv 2501.18512):
the pure landing math against the paper's form, thread workers against the hand-written
reference (tests/reference_streaming.py) bit for bit, the anchors and slow buffers identical on
every rank after each landing, ``mix=0`` unchanged, the refusals and resume."""

import warnings

import pytest
import torch
from reference_streaming import reference_streaming

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.config import SlowMoConfig, saved_config_changes
from hvd_slowmo.slowmo import land_

from helpers import anchor_of, assert_same_models, resume_in_fresh_workers, slow_buffer_of
from helpers import train_steps as train
from reference import loss_at, lr_at, make_model, params_of
from streaming_harness import SGD, InFlight, build


@pytest.mark.parametrize("mix", [0.0, 0.25, 0.5, 0.9])
def test_landing_is_the_papers_mixing_of_local_and_landed(mix):
    """``land_`` is ``mix x_i + (1 - mix) (x0 + (x_i - s_i))`` (the paper's alpha local +
    (1 - alpha) global, the global carrying the progress since the snapshot), in float64."""
    torch.manual_seed(0)
    x, s, x0 = (torch.randn(7, dtype=torch.float64) for _ in range(3))
    live, snap = [x.clone()], [s.clone()]
    land_(live, snap, [x0], mix)
    torch.testing.assert_close(live[0], mix * x + (1 - mix) * (x0 + (x - s)))
    if mix == 0:  # no mixing: the landing's two operations, bit for bit
        assert torch.equal(live[0], (x - s) + x0) and torch.equal(snap[0], s)


def _run(m, steps, **kwargs):
    """Thread workers; per rank: the model, its optimizer, and after every step the anchor and
    the slow buffer (cloned)."""
    models = [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=InFlight(comm),
            **kwargs,
        )
        anchors, slows, params = [], [], []
        for k in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(k)
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
            anchors.append([a.clone() for a in anchor_of(opt) or []])
            slows.append([u.clone() for u in slow_buffer_of(opt) or []])
            params.append(params_of(model))
        return model, opt, anchors, slows, params

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_threads(m, worker)


CASES = {  # tau, overlap, fragments, eager, alpha, beta, buffers, outer, mix
    "p1-d2-mix0.5": (4, 2, 1, None, 0.7, 0.6, "reset", "heavyball", 0.5),
    "p2-d2-maintain-mix0.25": (4, 2, 2, None, 1.0, 0.5, "maintain", "heavyball", 0.25),
    "p3-d1-tau5-nesterov-mix0.5": (5, 1, 3, None, 0.8, 0.6, "reset", "nesterov", 0.5),
    "local-p2-d2-mix0.5": (4, 2, 2, "local", 1.0, 0.7, "reset", "heavyball", 0.5),
    "shares-p1-d1-mix0.25": (4, 1, 1, "shares", 0.7, 0.6, "reset", "heavyball", 0.25),
    "local-p3-d2-plain-mix0.9": (6, 2, 3, "local", 1.0, 0.0, "maintain", "heavyball", 0.9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_thread_workers_with_mix_equal_the_reference_bitwise(case, one_intra_op_thread):
    """Every worker's model (parameters and BatchNorm buffers, which mix like the parameters)
    equals the hand-written replay bit for bit; after every step the anchor and the slow buffer
    are bitwise the same on every rank (the mixing touches only the workers' own copies)."""
    tau, d, p, eager, alpha, beta, buffers, outer, mix = CASES[case]
    m, steps = 3, 15
    got = _run(
        m, steps, tau=tau, overlap=d, fragments=p, eager=eager, slow_lr=alpha,
        slow_momentum=beta, buffers=buffers, outer_optimizer=outer, mix=mix,
    )  # fmt: skip
    flag = {None: False, "shares": True, "local": "local"}[eager]
    want, anchors = reference_streaming(
        m, steps, tau, d, p, flag, alpha, beta, SGD, buffers, lr_at, outer == "nesterov",
        mix=mix,
    )  # fmt: skip
    assert len(anchors) >= 3
    assert_same_models([r[0] for r in got], want)
    assert all(torch.equal(a, b) for a, b in zip(got[0][2][-1], anchors[-1]))
    for k in range(steps):
        for kept in (2, 3):  # the anchor, the slow buffer
            for tensors in zip(*[r[kept][k] for r in got]):
                assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), (k, kept)
    if beta:
        assert any(u.abs().sum() > 0 for u in got[0][3][-1])  # a slow buffer was compared
    # A test of the test: the mixing changes the trajectory, and keeps the workers apart.
    plain, _ = reference_streaming(
        m, steps, tau, d, p, flag, alpha, beta, SGD, buffers, lr_at, outer == "nesterov"
    )
    assert not torch.equal(want[0][0].weight, plain[0][0].weight)


def test_mix_zero_is_the_default_bit_for_bit(one_intra_op_thread):
    kwargs = dict(tau=4, overlap=2, fragments=2, eager="local", slow_lr=0.8, slow_momentum=0.6)
    default = _run(3, 13, **kwargs)
    zero = _run(3, 13, mix=0.0, **kwargs)
    assert_same_models([r[0] for r in zero], [r[0] for r in default])
    assert default[0][1].config.mix == 0.0 and default[0][1].config.summary()["mix"] == 0.0
    want, _ = reference_streaming(3, 13, 4, 2, 2, "local", 0.8, 0.6, SGD, "reset", lr_at)
    assert_same_models([r[0] for r in default], want)


REFUSED = {  # settings -> error, what the message names
    "mix-one": (dict(overlap=1, mix=1.0), ValueError, "mix"),
    "mix-negative": (dict(overlap=1, mix=-0.1), ValueError, "mix"),
    "mix-nan": (dict(overlap=1, mix=float("nan")), ValueError, "mix"),
    "mix-string": (dict(overlap=1, mix="0.5"), TypeError, "mix"),
    "mix-bool": (dict(overlap=1, mix=True), TypeError, "mix"),
    "mix-without-overlap": (dict(mix=0.5), ValueError, "overlap >= 1"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_bad_mix_is_refused_naming_it(case):
    kwargs, error, match = REFUSED[case]
    with pytest.raises(error, match=match) as e:
        SlowMoConfig(**kwargs)
    assert "mix=" in str(e.value)


def test_resume_with_mix_and_a_fragment_in_flight_is_bitwise(one_intra_op_thread):
    kwargs = dict(overlap=3, fragments=2, eager="local", mix=0.5)

    def check(opt):
        assert opt.outer.in_flight is not None and opt.config.mix == 0.5

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = resume_in_fresh_workers(3, build(**kwargs), train, 10, 17, check=check)
        whole = resume_in_fresh_workers(3, build(**kwargs), train, 17, 17)
    assert_same_models(resumed, whole)


def test_a_state_saved_before_mix_existed_loads_quietly_and_a_changed_mix_is_named():
    before = {"tau": 4, "overlap": 2}
    assert saved_config_changes(before, dict(before, mix=0.0)) == []
    assert saved_config_changes({"mix": 0.25}, {"mix": 0.5}) == ["mix: 0.25 -> 0.5"]
