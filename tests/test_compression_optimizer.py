"""DistributedOptimizer(codec=<name>) on thread workers: equal to a hand-written replay,
bitwise identical on every worker after each average, resumed bit for bit, with overlap, with
node workers, and its argument checks."""

import pytest
import torch
from reference_compression import reference_slowmo_compressed

from hvd_slowmo import DistributedOptimizer, Hierarchy
from hvd_slowmo.comm.local import ThreadWorld, run_threads

from helpers import (
    PLAIN_SGD,
    SGD_NESTEROV,
    anchor_of,
    assert_bitwise_equal_across_ranks,
    assert_close_models,
    assert_same_models,
    residual_of,
    resume_in_fresh_workers,
    run_slowmo,
)
from reference import loss_at, lr_at, make_model, reference_slowmo

CASES = {
    "bf16": ("bf16", False),
    "int8": ("int8", False),
    "int8-feedback": ("int8", True),
    "fp8-feedback": ("fp8", True),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_slowmo_with_compression_matches_replay(case):
    codec, feedback = CASES[case]
    m, steps, tau = 3, 13, 3
    kwargs = dict(tau=tau, slow_lr=0.7, slow_momentum=0.6, buffers="reset")
    results = run_slowmo(m, steps, PLAIN_SGD, codec=codec, error_feedback=feedback, **kwargs)
    assert_bitwise_equal_across_ranks(results)  # after every outer step
    ref = reference_slowmo_compressed(m, steps, tau, 0.7, 0.6, PLAIN_SGD, codec, feedback)
    plain = reference_slowmo(m, steps, tau, 0.7, 0.6, PLAIN_SGD, buffers="reset")
    for (model, _, opt), want, exact in zip(results, ref, plain):
        assert_close_models(model, want, atol=1e-6)
        # A test of the test: the codes really are lossy, the replay sees it too.
        assert not torch.equal(model[0].weight, exact[0].weight)
        residual = opt.state_dict()["slowmo"]["fragments"][0]["exchange"]["residual"]
        assert (residual is not None) == feedback


def _train(opt, model, rank, start, stop):
    for k in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()


@pytest.mark.parametrize("overlap", [0, 2], ids=["overlap0", "overlap2"])
def test_resume_is_bit_for_bit(overlap):
    def build(comm, model):
        return DistributedOptimizer(
            SGD_NESTEROV(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            tau=4,
            overlap=overlap,
            codec="int8",
            error_feedback=True,
        )

    def check(opt):
        assert residual_of(opt) is not None  # the saved one, taken back

    m, stop, steps = 3, 9, 15  # stop inside an inner loop (overlap 2: with an average in flight)
    models = [make_model() for _ in range(m)]

    def uninterrupted(comm):
        model = models[comm.rank]
        opt = build(comm, model)
        _train(opt, model, comm.rank, 0, steps)
        return model

    want = run_threads(m, uninterrupted)
    got = resume_in_fresh_workers(m, build, _train, stop, steps, check)
    assert_same_models(got, want)


def test_overlap_anchors_stay_identical():
    results = run_slowmo(3, 14, PLAIN_SGD, tau=4, overlap=2, codec="int8", slow_momentum=0.5)
    anchors = [anchor_of(opt) for _, _, opt in results]
    for rank in range(1, 3):
        assert all(torch.equal(a, b) for a, b in zip(anchors[0], anchors[rank])), rank
    plain = run_slowmo(3, 14, PLAIN_SGD, tau=4, overlap=2, slow_momentum=0.5)
    assert not torch.equal(anchors[0][0], anchor_of(plain[0][2])[0])  # really compressed


def test_node_workers_stay_identical():
    nodes, local, steps = 2, 2, 7
    models = [make_model() for _ in range(nodes * local)]
    groups_nodes = [[n * local + i for i in range(local)] for n in range(nodes)]
    groups_peers = [[n * local + i for n in range(nodes)] for i in range(local)]

    def worker(comm):
        r = comm.rank
        h = Hierarchy(
            node=comm.world.split(groups_nodes)[r], cross=comm.world.split(groups_peers)[r]
        )
        model = models[r]
        opt = DistributedOptimizer(
            PLAIN_SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            worker=h,
            tau=3,
            codec="int8",
            error_feedback=True,
        )
        snaps = []
        for k in range(steps):
            opt.zero_grad()
            loss_at(model, r, k).backward()
            opt.step()
            if opt.inner_step == 0:
                snaps.append([p.detach().clone() for p in model.parameters()])
        return snaps

    got = run_threads(nodes * local, worker)
    for k in range(len(got[0])):  # every rank bitwise identical after each outer step
        for r in range(1, nodes * local):
            assert all(torch.equal(a, b) for a, b in zip(got[r][k], got[0][k])), (r, k)


BAD = {
    "unknown-codec": (dict(codec="int4"), ValueError, "codec must be one of"),
    "feedback-without-codec": (dict(error_feedback=True), ValueError, "error_feedback=True"),
    "feedback-not-bool": (
        dict(codec="int8", error_feedback="yes"),
        TypeError,
        "error_feedback",
    ),
    "sharded": (
        dict(codec="int8", shard_slow_state=True),
        ValueError,
        "shard_slow_state=True is not supported",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_arguments(case):
    kwargs, error, match = BAD[case]
    model = make_model()
    with pytest.raises(error, match=match):
        DistributedOptimizer(
            PLAIN_SGD(model.parameters()), communicator=ThreadWorld(1).communicator(0), **kwargs
        )


def test_restart_from_the_anchor_forgets_the_residual():
    def worker(comm):
        model = make_model()
        opt = DistributedOptimizer(
            PLAIN_SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=3,
            codec="int8",
            error_feedback=True,
        )
        _train(opt, model, comm.rank, 0, 4)  # one outer step, then one step into the next
        before = residual_of(opt) is not None
        opt.adopt_world("a test")  # what a change of workers does
        return before, residual_of(opt)

    for before, after in run_threads(2, worker):
        assert before and after is None
