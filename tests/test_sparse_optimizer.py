"""DistributedOptimizer(codec=SparseCodec(...)) on thread workers: equal bit for bit to the
hand-written replay (whole model, fragments, overlap, eager "local", SparseLoCo's form), the
anchor identical on every rank, resumed bit for bit, and its argument checks."""

import warnings

import pytest
import torch
from reference_sparse import sparse_pseudo_gradient_average
from reference_streaming import reference_streaming

from hvd_slowmo import DistributedOptimizer, SparseCodec
from hvd_slowmo.comm.local import ThreadWorld

from helpers import assert_same_models, residual_of, resume_in_fresh_workers
from helpers import train_steps as train
from reference import lr_at, make_model
from streaming_harness import SGD, build, run

# Chunks far smaller than the default, so that the test model's 47 parameters are sparsified.
SETTINGS = dict(density=0.2, bits=2, chunk=16)

CASES = {  # tau, overlap, fragments, eager, alpha, beta, ef_decay, bits
    "whole-model": (4, 0, 1, False, 0.8, 0.6, 1.0, 2),
    "p2-d1": (4, 1, 2, False, 0.8, 0.6, 1.0, 2),
    "local-p2-d1": (4, 1, 2, "local", 0.8, 0.6, 1.0, 4),
    "eager-p1-d2": (4, 2, 1, True, 0.8, 0.6, 0.9, 2),
    "sparseloco-form": (4, 0, 1, False, 1.0, 0.0, 0.9, 2),  # no slow momentum, decaying EF
    "sparseloco-form-p2-d1": (4, 1, 2, False, 1.0, 0.0, 0.95, 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_thread_workers_equal_the_reference_bitwise(case, one_intra_op_thread):
    tau, d, p, eager, alpha, beta, decay, bits = CASES[case]
    settings = {**SETTINGS, "bits": bits}
    codec = SparseCodec(**settings, ef_decay=decay)
    m, steps = 3, 15
    got = run(
        m, steps, tau=tau, overlap=d, fragments=p, eager=eager, slow_lr=alpha,
        slow_momentum=beta, codec=codec, error_feedback=True,
    )  # fmt: skip
    average = sparse_pseudo_gradient_average(**settings, error_feedback=True, decay=decay)
    want, anchors = reference_streaming(
        m, steps, tau, d, p, eager, alpha, beta, SGD, "reset", lr_at, average=average
    )
    assert len(anchors) >= 3
    assert_same_models([r[0] for r in got], want)
    assert all(torch.equal(a, b) for a, b in zip(got[0][1][-1], anchors[-1]))
    for per_rank in zip(*[r[1] for r in got]):  # the anchor: bitwise the same on every rank
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), "anchors differ"
    residual = residual_of(got[0][2])
    assert residual is not None and residual.abs().sum() > 0
    # A test of the test: the sparse average differs from the exact one, the reference sees it.
    plain, _ = reference_streaming(m, steps, tau, d, p, eager, alpha, beta, SGD, "reset", lr_at)
    assert not torch.equal(want[0][0].weight, plain[0][0].weight)


RESUMES = {  # settings, the step to save at
    "whole-model": (dict(), 9),
    "p2-d3-in-flight": (dict(overlap=3, fragments=2), 10),
    "local-p2-d1": (dict(overlap=1, fragments=2, eager="local"), 7),
    "owners-p2-d3-in-flight": (dict(overlap=3, fragments=2), 10),  # exchange="owners"
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_mid_run_is_bitwise(case, one_intra_op_thread):
    kwargs, stop = RESUMES[case]
    exchange = "owners" if case.startswith("owners") else "allgather"
    codec = SparseCodec(**SETTINGS, ef_decay=0.9, exchange=exchange)
    make = build(codec=codec, error_feedback=True, **kwargs)

    def check(opt):
        residual = residual_of(opt)
        assert residual is not None and residual.abs().sum() > 0  # the saved one, taken back
        assert all(e.average.codec == codec for e in opt.exchanges)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = resume_in_fresh_workers(3, make, train, stop, 17, check=check)
        whole = resume_in_fresh_workers(3, make, train, 17, 17)
    assert_same_models(resumed, whole)


def test_the_scaling_exchange_through_the_optimizer(one_intra_op_thread):
    """``SparseCodec(exchange="owners")`` over fragments and overlap: the anchor bitwise the same
    on every rank after each outer step, and not the all-gather form's (its owners re-select)."""
    common = dict(tau=4, overlap=1, fragments=2, error_feedback=True)
    owners = run(4, 13, codec=SparseCodec(**SETTINGS, exchange="owners"), **common)
    gathered = run(4, 13, codec=SparseCodec(**SETTINGS), **common)
    assert len(owners[0][1]) >= 3
    for per_rank in zip(*[r[1] for r in owners]):
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), "anchors differ"
    last = zip(owners[0][1][-1], gathered[0][1][-1])
    assert not all(torch.equal(a, b) for a, b in last), "the owners' exchange changed nothing"


def test_the_string_is_the_default_codec_and_a_change_of_workers_forgets_the_residual():
    def worker(comm):
        model = make_model()
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=3,
            codec="sparse",
            error_feedback=True,
        )
        train(opt, model, comm.rank, 0, 4)
        before = residual_of(opt) is not None
        opt.adopt_world("a test")  # what a change of workers does
        return opt.config.codec, before, residual_of(opt)

    from hvd_slowmo.comm.local import run_threads

    for codec, before, after in run_threads(2, worker):
        assert codec == SparseCodec() and before and after is None


BAD = {
    "sharded": (
        dict(codec="sparse", error_feedback=True, shard_slow_state=True),
        ValueError,
        "shard_slow_state=True is not supported",
    ),
    "unknown-name": (dict(codec="topk"), ValueError, "'sparse' or a SparseCodec"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments(case):
    kwargs, error, match = BAD[case]
    model = make_model()
    with pytest.raises(error, match=match):
        DistributedOptimizer(
            SGD(model.parameters()), communicator=ThreadWorld(1).communicator(0), **kwargs
        )


def test_without_error_feedback_it_warns():
    model = make_model()
    with pytest.warns(UserWarning, match="without error_feedback drops for good"):
        DistributedOptimizer(
            SGD(model.parameters()),
            communicator=ThreadWorld(1).communicator(0),
            codec="sparse",
        )


def test_sparseloco_form_through_a_custom_outer_optimizer(one_intra_op_thread):
    """``outer_optimizer=SGD(lr=alpha)`` steps ``x0 - alpha (x0 - avg)``: the same as
    ``slow_momentum=0, slow_lr=alpha`` up to the rounding of the 1/lr scaling; ranks identical."""
    codec = SparseCodec(**SETTINGS, ef_decay=0.95)
    common = dict(tau=4, codec=codec, error_feedback=True)
    custom = run(3, 13, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7), **common)
    slow = run(3, 13, slow_lr=0.7, slow_momentum=0.0, **common)
    for per_rank in zip(*[r[1] for r in custom]):
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), "anchors differ"
    for a, b in zip(custom[0][1][-1], slow[0][1][-1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
