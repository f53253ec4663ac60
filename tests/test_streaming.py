"""Streaming SlowMo (fragments) and eager updates: the pure split, schedule and eager math,
the hand-written reference (tests/reference_streaming.py) checked against the other references,
and the configuration's refusals."""

import os
import warnings

import pytest
import torch
from reference_compression import pseudo_gradient_average
from reference_streaming import reference_streaming, strided_fragments

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import ThreadWorld, run_threads
from hvd_slowmo.config import SlowMoConfig
from hvd_slowmo.eager import LocalEstimate, NoEager, SharesEstimate
from hvd_slowmo.exchange import CompressedExchange, ShardedExchange
from hvd_slowmo.fragments import boundaries, fragment_of
from hvd_slowmo.slow_state import ShardedSlowState
from hvd_slowmo.slowmo import eager_anchor_, eager_landed_, local_anchor_, local_gradient

from helpers import (
    anchor_of,
    assert_same_models,
    residual_of,
    resume_in_fresh_workers,
    save_states,
)
from helpers import train_steps as train
from reference import loss_at, lr_at, make_model, params_of, reference_slowmo
from reference_overlap import reference_overlapped
from streaming_harness import SGD, InFlight, build, run

#: The optimizer's eager= for the reference's flag (True, False or "local").
EAGER_ARG = {True: "shares", False: None}


def test_split_is_strided_by_layer():
    names = ["emb.weight", "0.w", "0.b", "1.w", "1.b", "2.w", "head", "3.w"]
    #          layer 0       1      1      2      2      3      4       5
    assert fragment_of(names, 1) == [0] * 8
    assert fragment_of(names, 2) == [0, 1, 1, 0, 0, 1, 0, 1]
    assert fragment_of(names, 3) == [0, 1, 1, 2, 2, 0, 1, 2]
    assert fragment_of(names, 6) == [0, 1, 1, 2, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "value,error", [(0, ValueError), (7, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_split_refuses_bad_counts(value, error):
    names = ["a.w", "a.b", "b.w", "c.w", "d", "e", "f.w"]  # 6 layers
    with pytest.raises(error, match="fragments"):
        fragment_of(names, value)


def test_schedule_ends_at_the_period_and_spreads_the_boundaries():
    assert boundaries(12, 1) == [12]
    assert boundaries(12, 4) == [3, 6, 9, 12]
    assert boundaries(5, 3) == [1, 3, 5]
    for tau in range(1, 20):
        for p in range(1, tau + 1):
            b = boundaries(tau, p)
            assert b[-1] == tau and all(y - x >= tau // p for x, y in zip([0] + b, b))
    with pytest.raises(ValueError, match="tau=3"):
        boundaries(3, 4)


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavyball", "nesterov"])
def test_eager_math_is_the_recurrence(nesterov):
    """x^0 = x0 - alpha gamma (beta u + c + g/m) [Nesterov: (G^ + beta u^)], c <- -g/m, and after
    the landing c = G - g/m: the other workers' shares (checked against direct formulas)."""
    torch.manual_seed(0)
    x0, u, s, c, avg = (torch.randn(5, dtype=torch.float64) for _ in range(5))
    gamma, alpha, beta, m = 0.3, 0.7, 0.6, 4
    snap, others = [s.clone()], [c.clone()]
    eager_anchor_(snap, [x0], [u.clone()], others, gamma, alpha, beta, m, nesterov=nesterov)
    g = (x0 - s) / gamma
    est = c + g / m
    u_hat = beta * u + est
    want = x0 - alpha * gamma * ((est + beta * u_hat) if nesterov else u_hat)
    torch.testing.assert_close(snap[0], want)
    torch.testing.assert_close(others[0], -g / m)
    eager_landed_(others, [x0], [avg], gamma)
    torch.testing.assert_close(others[0], (x0 - avg) / gamma - g / m)


@pytest.mark.parametrize("slow", ["heavyball", "nesterov", "none"])
def test_local_eager_math_is_the_recurrence(slow):
    """eager="local": x^0 = x0 - alpha gamma (beta u + g) [Nesterov: (g + beta u^)], and the
    spread's ``gamma g = x0 - s`` is recovered from it (no slow buffer: alpha = 1, beta = 0)."""
    torch.manual_seed(0)
    x0, u, s = (torch.randn(5, dtype=torch.float64) for _ in range(3))
    gamma, alpha, beta = 0.3, 0.7, 0.6
    if slow == "none":
        alpha, beta, u = 1.0, 0.0, None
    nesterov = slow == "nesterov"
    snap = [s.clone()]
    local_anchor_(snap, [x0], None if u is None else [u], gamma, alpha, beta, nesterov=nesterov)
    g = (x0 - s) / gamma
    u_hat = g if u is None else beta * u + g
    want = x0 - alpha * gamma * ((g + beta * u_hat) if nesterov else u_hat)
    torch.testing.assert_close(snap[0], want)
    back = local_gradient(snap[0], x0, u, gamma, alpha, beta, nesterov=nesterov)
    torch.testing.assert_close(back, x0 - s)


def test_eager_with_one_worker_and_plain_averaging_changes_nothing():
    """alpha = 1, beta = 0, m = 1, no stale share: the provisional anchor is the snapshot."""
    x0, s = torch.randn(6), torch.randn(6)
    snap = [s.clone()]
    eager_anchor_(snap, [x0], [torch.zeros(6)], [torch.zeros(6)], 0.5, 1.0, 0.0, 1)
    torch.testing.assert_close(snap[0], s)


def _same(a, b, exact):
    for x, y in zip(a, b):
        for p, q in zip(x.state_dict().values(), y.state_dict().values()):
            if exact:
                assert torch.equal(p, q)
            else:
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("delay", [0, 2])
def test_reference_with_one_fragment_is_the_overlapped_reference(delay):
    """A test of the reference: P = 1, not eager, is overlap=d (d = 0: the paper's algorithm),
    from two independently written replays."""
    got, _ = reference_streaming(3, 11, 4, delay, 1, False, 0.7, 0.6, SGD, lr_schedule=lr_at)
    want = reference_overlapped(3, 11, 4, delay, 0.7, 0.6, SGD, lr_schedule=lr_at)
    _same(got, want, exact=False)
    if delay == 0:
        _same(got, reference_slowmo(3, 11, 4, 0.7, 0.6, SGD, lr_schedule=lr_at), exact=False)


def test_reference_fragments_and_eager_change_the_trajectory():
    """A test of the test: fragments and eager each change where the workers end."""
    base, _ = reference_streaming(3, 9, 4, 1, 1, False, 0.7, 0.6, SGD, lr_schedule=lr_at)
    frag, _ = reference_streaming(3, 9, 4, 1, 3, False, 0.7, 0.6, SGD, lr_schedule=lr_at)
    eager, _ = reference_streaming(3, 9, 4, 1, 1, True, 0.7, 0.6, SGD, lr_schedule=lr_at)
    local, _ = reference_streaming(3, 9, 4, 1, 1, "local", 0.7, 0.6, SGD, lr_schedule=lr_at)
    w = [next(mods[0].parameters()) for mods in (base, frag, eager, local)]
    assert all(not torch.equal(w[a], w[b]) for a, b in ((0, 1), (0, 2), (0, 3), (2, 3)))


REFUSED = {  # settings -> what the message names
    "eager-without-overlap": (dict(eager="shares"), "overlap"),
    "fragments-over-tau": (dict(tau=3, fragments=4), "tau=3"),
    "fragments-zero": (dict(fragments=0), "fragments"),
    "eager-not-bool": (dict(overlap=1, eager=1), "eager"),
    "eager-unknown-estimate": (dict(overlap=1, eager="stale"), "'local'"),
    "eager-local-without-overlap": (dict(eager="local"), "overlap"),
    "fragments-sgp": (dict(fragments=2, base="sgp"), "push-sum"),
    "eager-osgp": (dict(overlap=1, eager="shares", base="osgp"), "push-sum"),
    "eager-custom-outer": (
        dict(overlap=1, eager="shares", outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7)),
        "outer_optimizer",
    ),
    "fragments-skip": (dict(fragments=2, nonfinite="skip"), "nonfinite"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_combinations_are_refused(case):
    kwargs, match = REFUSED[case]
    with pytest.raises((ValueError, TypeError), match=match):
        SlowMoConfig(**kwargs)


@pytest.mark.parametrize(
    "eager,estimate,strategy",
    [(False, None, NoEager), (True, "shares", SharesEstimate), ("local", "local", LocalEstimate)],
    ids=["off", "shares", "local"],
)
def test_eager_is_normalised_once_and_picks_its_strategy(eager, estimate, strategy):
    assert SlowMoConfig(overlap=1, eager=eager).estimate == estimate
    model = make_model()
    opt = DistributedOptimizer(
        SGD(model.parameters()),
        named_parameters=model.named_parameters(),
        communicator=ThreadWorld(1).communicator(0),
        tau=4,
        overlap=1,
        fragments=2,
        eager=eager,
    )
    assert [type(f.eager) for f in opt.outer.fragments] == [strategy, strategy]


SHARDED_REFUSES = {  # what the sharded layout declares unsupported -> the settings that ask
    "eager": dict(overlap=1, eager=True),
    "codec": dict(compression="int8"),
    "merge": dict(merge="samples"),
    "period": dict(period_seconds=1.0),
    "hierarchy": dict(hierarchical=True),
}


@pytest.mark.parametrize("feature", list(SHARDED_REFUSES))
def test_the_sharded_layout_refuses_what_it_declares(feature):
    """A refusal is the layout's declared capability, with its reason, at construction."""
    assert set(ShardedSlowState.unsupported) == set(SHARDED_REFUSES)  # fragments: supported
    assert ShardedSlowState.unsupported[feature] in str(ShardedExchange.unsupported[feature])
    model = make_model()
    with pytest.raises(ValueError, match="shard_slow_state=True is not supported") as e:
        DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=ThreadWorld(1).communicator(0),
            shard_slow_state=True,
            tau=4,
            **SHARDED_REFUSES[feature],
        )
    assert ShardedSlowState.unsupported[feature] in str(e.value)


# --- the library on thread workers against the reference -------------------------------------


CASES = {  # tau, overlap, fragments, eager, alpha, beta, buffers, outer
    "p1-d2": (4, 2, 1, False, 0.7, 0.6, "reset", "heavyball"),
    "p2-d0": (4, 0, 2, False, 0.7, 0.6, "reset", "heavyball"),
    "p2-d2": (4, 2, 2, False, 1.0, 0.5, "maintain", "heavyball"),
    "p3-d1-tau5": (5, 1, 3, False, 0.8, 0.6, "reset", "nesterov"),
    "eager-p1-d1": (4, 1, 1, True, 0.7, 0.6, "reset", "heavyball"),
    "eager-p1-d3-plain": (4, 3, 1, True, 1.0, 0.0, "maintain", "heavyball"),
    "eager-p2-d2-nesterov": (4, 2, 2, True, 0.8, 0.5, "reset", "nesterov"),
    "eager-p3-d2": (6, 2, 3, True, 1.0, 0.6, "maintain", "heavyball"),
    "local-p1-d1": (4, 1, 1, "local", 0.7, 0.6, "reset", "heavyball"),
    "local-p1-d3-plain": (4, 3, 1, "local", 1.0, 0.0, "maintain", "heavyball"),
    "local-p2-d2-nesterov": (4, 2, 2, "local", 0.8, 0.5, "reset", "nesterov"),
    "local-p3-d2": (6, 2, 3, "local", 1.0, 0.6, "maintain", "heavyball"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_thread_workers_equal_the_reference_bitwise(case, one_intra_op_thread):
    tau, d, p, eager, alpha, beta, buffers, outer = CASES[case]
    m, steps = 3, 15
    got = run(
        m, steps, tau=tau, overlap=d, fragments=p, eager=EAGER_ARG.get(eager, eager),
        slow_lr=alpha, slow_momentum=beta, buffers=buffers, outer_optimizer=outer,
    )  # fmt: skip
    spreads: list[list[float]] = []
    want, anchors = reference_streaming(
        m, steps, tau, d, p, eager, alpha, beta, SGD, buffers, lr_at, outer == "nesterov",
        spreads=spreads,
    )  # fmt: skip
    assert len(anchors) >= 3
    assert_same_models([r[0] for r in got], want)
    for per_rank in zip(*[r[1] for r in got]):  # the anchor: bitwise the same on every rank
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), "anchors differ"
    assert all(torch.equal(a, b) for a, b in zip(got[0][1][-1], anchors[-1]))
    # The replica spread, measured at overlapped landings only, against its value: each worker's
    # RMS distance from the average over the last landed fragment (eager: reconstructed from the
    # provisional anchor, hence a tolerance; a dropped 1/m or a flipped sign is far outside it).
    got_spreads = [r[2].replica_spread for r in got]
    if d:
        assert got_spreads == pytest.approx(spreads[-1], rel=1e-4), (got_spreads, spreads[-1])
        assert len(set(spreads[-1])) == m  # the workers' distances differ: a rank mix-up shows
    else:
        assert got_spreads == [None] * m
    assert all((r[2].outer.eager_shares is not None) == (eager is True) for r in got)


@pytest.mark.parametrize(
    "tau,d,p", [(6, 1, 3), (4, 0, 2), (4, 2, 2)], ids=["p3-d1", "p2-d0", "p2-d2"]
)
def test_custom_outer_optimizer_per_fragment_equals_the_reference_bitwise(
    tau, d, p, one_intra_op_thread
):
    """A torch optimizer as the outer step with fragments: each landing steps the landing
    fragment's anchor tensors alone (the others have no gradient, so torch skips them)."""
    m, steps = 3, 15
    outer = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.6)  # noqa: E731
    got = run(m, steps, tau=tau, overlap=d, fragments=p, outer_optimizer=outer)
    want, anchors = reference_streaming(
        m, steps, tau, d, p, False, 1.0, 0.0, SGD, "reset", lr_at, outer_sgd=(0.7, 0.6)
    )
    assert len(anchors) >= 3
    assert_same_models([r[0] for r in got], want)
    assert all(torch.equal(a, b) for a, b in zip(got[0][1][-1], anchors[-1]))
    assert all(torch.equal(a, b) for r in got[1:] for a, b in zip(r[1][-1], got[0][1][-1]))


CODEC_CASES = {  # tau, overlap, fragments, eager, codec, error feedback
    "int8-feedback-p2-d2": (4, 2, 2, False, "int8", True),
    "int8-feedback-p2-d0": (4, 0, 2, False, "int8", True),
    "int8-feedback-p3-d1-tau5": (5, 1, 3, False, "int8", True),
    "eager-bf16-p2-d1": (4, 1, 2, True, "bf16", False),
}


@pytest.mark.parametrize("case", list(CODEC_CASES))
def test_fragments_with_a_codec_equal_the_reference_bitwise(case, one_intra_op_thread):
    """Each fragment's average is the compressed pseudo-gradient average of its parameters from
    their anchor, with each parameter's residual carried into its fragment's next average (the
    reference keeps one per worker and parameter; fragment 0 of P = 2 is not contiguous in the
    residual). The anchors are bitwise identical on every rank after every step; with d = 0 so
    are a fragment's parameters right after its landing."""
    tau, d, p, eager, codec, feedback = CODEC_CASES[case]
    m, steps = 3, 15
    got = run(
        m, steps, tau=tau, overlap=d, fragments=p, eager=EAGER_ARG.get(eager, eager),
        slow_lr=0.8, slow_momentum=0.6,
        codec=codec, error_feedback=feedback,
    )  # fmt: skip
    average = pseudo_gradient_average(codec, feedback)
    want, anchors = reference_streaming(
        m, steps, tau, d, p, eager, 0.8, 0.6, SGD, "reset", lr_at, average=average
    )
    assert_same_models([r[0] for r in got], want)
    assert all(torch.equal(a, b) for a, b in zip(got[0][1][-1], anchors[-1]))
    for per_rank in zip(*[r[1] for r in got]):
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), "anchors differ"
    split = strided_fragments([n for n, _ in want[0].named_parameters()], p)
    lands = {b % tau: f for f, b in enumerate(boundaries(tau, p))}  # d = 0: inner step -> fragment
    for k in range(steps) if d == 0 else ():
        if (k + 1) % tau in lands:
            landed = [j for j, f in enumerate(split) if f == lands[(k + 1) % tau]]
            for r in range(1, m):
                assert all(torch.equal(got[r][3][k][j], got[0][3][k][j]) for j in landed), (k, r)
    if feedback:  # each fragment's average wrote its own parameters' residual
        residual = residual_of(got[0][2])
        sizes = [t.numel() for t in got[0][3][0]]
        assert all(part.abs().sum() > 0 for part in residual.split(sizes))
    # A test of the test: the codes are lossy, and the reference sees it.
    plain, _ = reference_streaming(m, steps, tau, d, p, eager, 0.8, 0.6, SGD, "reset", lr_at)
    assert not torch.equal(want[0][0].weight, plain[0][0].weight)


RESUMES = {  # settings, the step to save at (a fragment in flight there), its fragment
    "p3-d2-average": (dict(overlap=2, fragments=3, buffers="average"), 11, 1),
    "eager-p2-d3": (dict(overlap=3, fragments=2, eager="shares"), 10, 0),
    "eager-p1-d2": (dict(overlap=2, eager="shares"), 13, 0),
    "int8-feedback-p2-d3": (
        dict(overlap=3, fragments=2, codec="int8", error_feedback=True),
        10,
        0,
    ),
    "local-p2-d3": (dict(overlap=3, fragments=2, eager="local"), 10, 0),
}


@pytest.mark.parametrize("case", list(RESUMES))
def test_resume_with_a_fragment_in_flight_is_bitwise(case, one_intra_op_thread):
    kwargs, stop, fragment = RESUMES[case]

    def check(opt):
        assert opt.outer.in_flight is not None and opt.outer.in_flight.fragment == fragment
        assert (opt.outer.eager_shares is not None) == (kwargs.get("eager") == "shares")
        compressed = isinstance(opt.exchanges[0], CompressedExchange)
        assert not compressed or residual_of(opt) is not None

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = resume_in_fresh_workers(3, build(**kwargs), train, stop, 17, check=check)
        whole = resume_in_fresh_workers(3, build(**kwargs), train, 17, 17)
    assert_same_models(resumed, whole)


#: States saved in format 2 (hvd_slowmo at aa14d4f, before the landing step was renamed and the
#: codec's residual moved to the exchange), by ``write_format_2_states`` run on that version.
FORMAT_2 = ("eager-p2-d3", "int8-feedback-p2-d3", "eager-p1-d2")
FORMAT_2_ATOL = 1e-5


def _format_2_path(case, rank):
    return os.path.join(os.path.dirname(__file__), "data", "state_v2", f"{case}-rank{rank}.pt")


def write_format_2_states():  # pragma: no cover - run once, on the version that wrote format 2
    for case in FORMAT_2:
        kwargs, stop, _ = RESUMES[case]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            states = save_states(3, build(**kwargs), train, stop)
        for rank, state in enumerate(states):
            os.makedirs(os.path.dirname(_format_2_path(case, rank)), exist_ok=True)
            with open(_format_2_path(case, rank), "wb") as f:
                f.write(state)


@pytest.mark.parametrize("case", FORMAT_2)
def test_a_format_2_state_with_a_fragment_in_flight_continues_bitwise(case, one_intra_op_thread):
    """The upgrade of format 2 (``apply_at``, the residual in the slow state, the eager shares)
    resumes on the trajectory of an uninterrupted run."""
    kwargs, stop, fragment = RESUMES[case]
    saved = []
    for rank in range(3):
        with open(_format_2_path(case, rank), "rb") as f:
            saved.append(f.read())
    assert torch.load(_format_2_path(case, 0), weights_only=False)["opt"]["format"] == 2

    def check(opt):
        assert opt.outer.in_flight is not None and opt.outer.in_flight.fragment == fragment
        assert (opt.outer.eager_shares is not None) == (kwargs.get("eager") == "shares")
        if kwargs.get("error_feedback"):
            assert residual_of(opt) is not None  # taken from the slow state's old key

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = resume_in_fresh_workers(
            3, build(**kwargs), train, stop, 17, check=check, saved=saved
        )
        whole = resume_in_fresh_workers(3, build(**kwargs), train, 17, 17)
    # The states were written on another machine (the first half's last bits may differ from
    # this machine's): a tolerance, far below what a lost residual or lost shares change (~1e-3).
    for a, b in zip(resumed, whole):
        for key, x in a.state_dict().items():
            torch.testing.assert_close(x, b.state_dict()[key], rtol=0, atol=FORMAT_2_ATOL)


def test_flush_and_a_change_of_workers_with_a_fragment_in_flight():
    models = [make_model() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        opt = build(overlap=2, fragments=3, eager=True)(comm, model)
        train(opt, model, comm.rank, 0, 3)  # fragment 0: boundary at 2, lands at 4
        assert opt.outer.in_flight is not None and opt.outer.in_flight.fragment == 0
        opt.flush()
        assert opt.outer.in_flight is None and opt.replica_spread > 0
        train(opt, model, comm.rank, 3, 5)  # fragment 1: boundary at 4, lands at 6
        anchor = [a.clone() for a in anchor_of(opt)]
        opt.adopt_world("a test")
        assert opt.outer.in_flight is None and opt.outer.eager_shares is None
        # Back to fragment 0's boundary at 2, the last that landed (its anchor holds steps
        # 1..2: going back to 0 would count them twice); every fragment at its anchor.
        assert (opt.num_steps, opt.inner_step) == (2, 2)
        assert all(torch.equal(p, a) for p, a in zip(params_of(model), anchor))
        train(opt, model, comm.rank, 2, 12)  # and it trains on
        return params_of(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = run_threads(2, worker)
    assert all(torch.isfinite(x).all() for x in a)


def test_allreduce_base_and_node_workers_keep_ranks_identical():
    """AR-SGD keeps workers identical, so every rank lands on the same parameters (eager's
    estimate differs from the average there, and the landing corrects it); with worker="node"
    the two ranks of a node are identical at every step, also with an int8 exchange."""
    from hvd_slowmo.comm.hierarchy import Hierarchy

    def worker(comm, models, kwargs):
        r = comm.rank
        model = models[r]
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=InFlight(comm),
            tau=4,
            slow_momentum=0.5,
            overlap=2,
            fragments=2,
            eager=True,
            **kwargs(comm),
        )
        train(opt, model, r, 0, 11)
        return params_of(model)

    node = lambda c: dict(  # noqa: E731
        worker=Hierarchy(
            node=c.world.split([[0, 1], [2, 3]])[c.rank],
            cross=c.world.split([[0, 2], [1, 3]])[c.rank],
        )
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Fresh models for each run: one model's parameters carry one optimizer's hooks.
        models = [make_model() for _ in range(4)]
        same = run_threads(4, lambda c: worker(c, models, lambda _: dict(base="allreduce")))
        models = [make_model() for _ in range(4)]
        nodes = run_threads(4, lambda c: worker(c, models, node))
        models = [make_model() for _ in range(4)]
        int8 = lambda c: dict(node(c), codec="int8", error_feedback=True)  # noqa: E731
        coded = run_threads(4, lambda c: worker(c, models, int8))
    for got, pairs in (
        (same, [(0, 1), (0, 2), (0, 3)]),
        (nodes, [(0, 1), (2, 3)]),
        (coded, [(0, 1), (2, 3)]),
    ):
        for a, b in pairs:
            assert all(torch.equal(x, y) for x, y in zip(got[a], got[b])), (a, b)
    assert not all(torch.equal(x, y) for x, y in zip(nodes[0], nodes[2]))
    assert not all(torch.equal(x, y) for x, y in zip(nodes[0], coded[0]))  # really compressed


def test_local_eager_spread_is_measured_from_the_snapshot():
    """AR-SGD keeps the workers identical, so s_i = avg and the spread is 0 up to rounding,
    although with eager="local" the snapshot was overwritten by a provisional anchor far from
    the average (the spread recovers s_i from it)."""

    models = [make_model() for _ in range(2)]  # in the main thread: the same seeded init

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=InFlight(comm),
            base="allreduce",
            tau=4,
            slow_lr=0.8,
            slow_momentum=0.5,
            overlap=1,
            eager="local",
        )
        train(opt, model, comm.rank, 0, 9)  # landings at 5 and 9
        return opt.replica_spread, params_of(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_threads(2, worker)
    assert all(0 <= spread < 1e-6 for spread, _ in got), [spread for spread, _ in got]
    assert all(torch.equal(x, y) for x, y in zip(got[0][1], got[1][1]))


def test_bad_settings_at_construction_name_the_fix():
    model = make_model()  # 3 layers

    def worker(comm):
        def make(**kwargs):
            return DistributedOptimizer(
                SGD(model.parameters()),
                named_parameters=model.named_parameters(),
                communicator=comm,
                tau=6,
                **kwargs,
            )

        with pytest.raises(ValueError, match="number of layers"):
            make(fragments=4)
        with pytest.raises(ValueError, match="tau // fragments = 2"):
            make(fragments=3, overlap=3)
        opt = make(fragments=2)
        with pytest.raises(ValueError, match="add_param_group"):
            opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
        assert len(opt.params) == 6 and len(opt.param_groups) == 1
        train(opt, model, 0, 0, 4)  # fragment 0 in flight? no: overlap=0 lands at once
        saved = make(fragments=2, overlap=1)
        train(saved, model, 0, 0, 3)  # fragment 0: boundary at 3, lands at 4
        state = saved.state_dict()
        other = make(fragments=3, overlap=1)
        with pytest.raises(ValueError, match="fragments=3"):
            other.load_state_dict(state)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_threads(1, worker)


def test_nonfinite_raise_names_the_rank_and_eager_skip_restarts_from_the_anchor():
    models = [make_model() for _ in range(2)]

    def worker(comm, **kwargs):
        model = models[comm.rank] if kwargs.get("nonfinite") == "skip" else make_model()
        opt = DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=InFlight(comm),
            tau=4,
            overlap=2,
            slow_momentum=0.5,
            **kwargs,
        )
        anchor = None
        for k in range(6):  # boundary at 4, lands at 6
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            if k == 2 and comm.rank == 1:
                next(model.parameters()).grad.fill_(float("nan"))
            if k == 5:
                anchor = [a.clone() for a in anchor_of(opt)]
            opt.step()
        return params_of(model), anchor, opt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_threads(2, lambda c: worker(c, nonfinite="skip", eager=True))
        for params, anchor, opt in got:
            assert opt.outer.in_flight is None and opt.outer.eager_shares is None
            assert all(torch.equal(p, a) for p, a in zip(params, anchor))
        with pytest.raises(FloatingPointError, match=r"rank\(s\) \[1\]"):
            run_threads(2, lambda c: worker(c, nonfinite="raise", fragments=2))


# --- fragments named by module (torchtitan's module_fqns_per_model_fragment) -------------------


def test_fragments_named_by_module_equal_the_same_split_given_as_a_count(one_intra_op_thread):
    """Layers 0, 2, 3 strided into 2 fragments are {0, 3} and {2}: naming those modules gives the
    same run, bit for bit."""
    kw = dict(tau=4, overlap=2, slow_lr=0.7, slow_momentum=0.6)
    by_count = run(2, 9, fragments=2, **kw)
    by_name = run(2, 9, fragments=[["0", "3"], ["2"]], **kw)
    for a, b in zip(by_count, by_name):
        assert all(torch.equal(p, q) for p, q in zip(a[0].parameters(), b[0].parameters()))
    summary = by_name[0][2].config.summary()  # saved in the state, compared across ranks
    assert summary["fragment_modules"] == (("0", "3"), ("2",))
    other = run(2, 9, fragments=[["0"], ["2", "3"]], **kw)  # another split: another run
    assert not torch.equal(next(other[0][0].parameters()), next(by_name[0][0].parameters()))


NAMED_REFUSED = {
    "unknown-module": ([["0", "2"], ["3", "head"]], "hold no parameter.*'head'"),
    "parameter-left-out": ([["0"], ["2"]], r"leaves parameters \['3.weight', '3.bias'\]"),
    "module-twice": ([["0", "2"], ["2", "3"]], "module '2' in fragments 0 and 1"),
    "not-a-list-of-lists": (["0", "2"], "list of lists of module names"),
    "empty-fragment": ([["0", "2", "3"], []], "list of lists of module names"),
}


@pytest.mark.parametrize("case", list(NAMED_REFUSED))
def test_named_fragments_that_do_not_fit_the_model_are_refused(case):
    fragments, message = NAMED_REFUSED[case]
    model = make_model()
    with pytest.raises((ValueError, TypeError), match=message):
        DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=ThreadWorld(1).communicator(0),
            tau=4,
            fragments=fragments,
        )


def test_named_fragments_unbalanced_in_bytes_are_warned():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    with pytest.warns(UserWarning, match="balance them by bytes"):
        DistributedOptimizer(
            SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=ThreadWorld(1).communicator(0),
            tau=4,
            fragments=[["0"], ["1"]],
        )
