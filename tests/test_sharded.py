"""shard_slow_state=True (hvd_slowmo/slow_state/sharded.py) on in-process thread workers: bitwise
equal to the unsharded optimizer on the same inputs, ~2/m of the slow-state memory per rank, exact
resume, bad input."""

import importlib.util
import io
import os
import warnings

import pytest
import torch

from hvd_slowmo import DistributedOptimizer, broadcast_optimizer_state
from hvd_slowmo.comm.base import Communicator, shard_range, shard_sizes
from hvd_slowmo.comm.local import ThreadWorld, run_threads
from hvd_slowmo.slow_state.sharded import Bucket, ShardedSlowState, make_buckets

from helpers import (
    anchor_of,
    assert_same_models,
    resume_in_fresh_workers,
    slow_buffer_of,
    state_tensors_of,
)
from reference import loss_at, lr_at, make_model, params_of

pytestmark = pytest.mark.timeout(120)


def group_lrs(k):
    """The lr of each param group (one bucket each) at step ``k``: group 0 rises every 4 steps,
    group 1 starts at 0.37x and decays every 3 steps. The ratio is not a power of two and changes
    between outer steps, so a bucket that read another group's lr cannot land on the same numbers
    (with one schedule and a power-of-two ratio the wrong lr cancels out exactly in u and x0)."""
    return lr_at(k), 0.37 * 0.05 * 0.8 ** (k // 3)


def two_groups(model, lr=0.05):
    """SGD with Nesterov momentum over two param groups: the first Linear layer, and the rest."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return torch.optim.SGD(
        [{"params": first}, {"params": rest, "lr": group_lrs(0)[1]}],
        lr=lr,
        momentum=0.9,
        nesterov=True,
    )


def set_lr(opt, k):
    for g, lr in zip(opt.param_groups, group_lrs(k)):
        g["lr"] = lr


def train(opt, model, rank, start, stop, snaps=None):
    for k in range(start, stop):
        set_lr(opt, k)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()
        if snaps is not None and opt.inner_step == 0:
            snaps.append(params_of(model))


def build(comm, model, **kwargs):
    return DistributedOptimizer(
        two_groups(model),
        named_parameters=model.named_parameters(),
        model_buffers=model.buffers(),
        communicator=comm,
        **kwargs,
    )


def run(m, steps, **kwargs):
    """Train m thread workers; per rank (model, [params after each outer step], optimizer)."""
    models = [make_model() for _ in range(m)]  # built here: torch's global RNG is not thread-safe

    def worker(comm):
        model = models[comm.rank]
        opt = build(comm, model, **kwargs)
        snaps = []
        train(opt, model, comm.rank, 0, steps, snaps)
        return model, snaps, opt

    return run_threads(m, worker)


def assert_same_runs(got, want):
    for (model_a, snaps_a, _), (model_b, snaps_b, _) in zip(got, want):
        assert len(snaps_a) == len(snaps_b) > 0
        for sa, sb in zip(snaps_a, snaps_b):
            for a, b in zip(sa, sb):
                assert torch.equal(a, b), "sharded outer step differs from the unsharded one"
        for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()):
            assert torch.equal(a, b)


def assert_ranks_equal(results):
    for per_rank in zip(*[snaps for _, snaps, _ in results]):
        for tensors in zip(*per_rank):
            assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), (
                "ranks differ after an outer step"
            )


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


# --- shard-range math ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "numel,size,want",
    [(10, 4, [3, 3, 2, 2]), (47, 3, [16, 16, 15]), (2, 3, [1, 1, 0]), (0, 2, [0, 0]), (8, 1, [8])],
    ids=["10-over-4", "47-over-3", "fewer-elements-than-ranks", "empty", "one-rank"],
)
def test_shard_sizes_follow_horovod(numel, size, want):
    # Horovod 0.28.1 ReducescatterOp::ComputeOutputShapeForRank: n // m, one more for ranks < n % m.
    assert shard_sizes(numel, size) == want


def test_shard_ranges_tile_the_vector():
    for size in range(1, 7):
        for numel in range(0, 30):
            ranges = [shard_range(numel, r, size) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == numel
            assert all(ranges[r][1] == ranges[r + 1][0] for r in range(size - 1))
            assert [e - s for s, e in ranges] == shard_sizes(numel, size)


def test_shard_math_rejects_bad_input():
    with pytest.raises(ValueError, match="rank 3"):
        shard_range(10, 3, 3)
    with pytest.raises(ValueError, match="size >= 1"):
        shard_sizes(10, 0)


def test_buckets_per_group_and_dtype():
    f32 = lambda n: torch.zeros(n)  # noqa: E731
    f64 = lambda n: torch.zeros(n, dtype=torch.float64)  # noqa: E731
    groups = [[f32(3), f64(2), f32(4)], [f32(5)]]
    assert make_buckets(groups, rank=1, size=2) == [
        Bucket(group=0, indices=(0, 2), numel=7, start=4, end=7),
        Bucket(group=0, indices=(1,), numel=2, start=1, end=2),
        Bucket(group=1, indices=(3,), numel=5, start=3, end=5),
    ]


# --- communicator methods -----------------------------------------------------------------
@pytest.mark.parametrize("m", [2, 3, 4], ids=["m2", "m3", "m4"])
def test_thread_reduce_scatter_is_a_slice_of_average(m):
    data = [
        [torch.randn(11, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(2)]
        for r in range(m)
    ]

    def worker(comm):
        full = [t.clone() for t in data[comm.rank]]
        comm.average_(full, name="avg")
        shards = comm.reduce_scatter_mean(data[comm.rank], name="rs")
        return full, shards, comm.allgather_flat(shards, name="ag")

    for rank, (full, shards, gathered) in enumerate(run_threads(m, worker)):
        for f, s, g in zip(full, shards, gathered):
            start, end = shard_range(11, rank, m)
            assert torch.equal(s, f[start:end])
            assert torch.equal(g, f)


# --- the optimizer: bitwise equal to unsharded --------------------------------------------
OUTER = {
    "heavyball": dict(slow_lr=0.7, slow_momentum=0.6),
    "nesterov": dict(slow_lr=1.0, slow_momentum=0.6, outer_optimizer="nesterov"),
    "custom-sgd": dict(
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
    ),
    "custom-adam": dict(outer_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01)),
    "allreduce-base": dict(base="allreduce", slow_lr=1.0, slow_momentum=0.5),
}
CASES = [(m, name) for m in (2, 3, 4) for name in OUTER]


@pytest.mark.parametrize("m,outer", CASES, ids=[f"m{m}-{name}" for m, name in CASES])
def test_sharded_equals_unsharded_bitwise(m, outer):
    # The model has 25 + 22 parameters in its two groups: not divisible by 2, 3 or 4 (uneven
    # shards).
    kwargs = dict(tau=3, buffers="maintain", **OUTER[outer])
    sharded = run(m, 10, shard_slow_state=True, **kwargs)
    plain = run(m, 10, **kwargs)
    assert_ranks_equal(sharded)
    assert_same_runs(sharded, plain)
    assert len(sharded[0][1]) == 3
    # It trained.
    assert not torch.equal(sharded[0][1][-1][0], make_model().state_dict()["0.weight"])
    for _, _, opt in sharded:
        assert all(isinstance(s, ShardedSlowState) and s.captured for s in opt.slow_states)
        # Shards of flat buckets
        assert all(a.dim() == 1 for s in opt.slow_states for a in s.anchor)


FRAGMENT_CASES = {  # m, fragments, overlap
    "m2-p2-d0": (2, 2, 0),
    "m3-p3-d0": (3, 3, 0),
    "m3-p2-d1": (3, 2, 1),
    "m2-p3-d2": (2, 3, 2),
}


@pytest.mark.parametrize("case", list(FRAGMENT_CASES))
def test_sharded_fragments_equal_unsharded_fragments_bitwise(case):
    """Streaming over the sharded layout: buckets are cut by fragment, and each fragment's
    outer step reduce-scatters, updates and gathers its own; the same bits as the full layout."""
    m, fragments, overlap = FRAGMENT_CASES[case]
    kwargs = dict(tau=6, fragments=fragments, overlap=overlap, slow_lr=0.7, slow_momentum=0.6)
    sharded = run(m, 14, shard_slow_state=True, **kwargs)
    plain = run(m, 14, **kwargs)
    # (Ranks differ at a period's end: the other fragments moved on since their averages.)
    assert_same_runs(sharded, plain)
    assert not torch.equal(sharded[0][1][0][0], sharded[1][1][0][0])  # it is not one replica
    for _, _, opt in sharded:  # each fragment's own buckets cover its parameters once
        assert len(opt.slow_states) == fragments
        for f in opt.outer.fragments:
            held = sorted(j for b in f.slow_state.buckets for j in b.indices)
            assert held == list(range(len(f.members)))


def test_sharded_sends_the_bytes_of_one_allreduce():
    kwargs = dict(tau=2, buffers="maintain", slow_lr=1.0, slow_momentum=0.5)
    sharded = run(4, 2, shard_slow_state=True, **kwargs)
    plain = run(4, 2, **kwargs)
    # int() rounding per tensor differs (one flat bucket per group vs one tensor per parameter).
    assert sharded[0][2].comm.bytes_sent == pytest.approx(plain[0][2].comm.bytes_sent, abs=16)


@pytest.mark.parametrize("m", [2, 3, 4], ids=["m2", "m3", "m4"])
def test_slow_state_memory_is_two_over_m(m):
    sharded = run(m, 3, tau=3, shard_slow_state=True, slow_lr=1.0, slow_momentum=0.5)
    plain = run(m, 3, tau=3, slow_lr=1.0, slow_momentum=0.5)
    model, _, opt = sharded[0]
    param_bytes = tensor_bytes(list(model.parameters()))
    assert tensor_bytes(anchor_of(plain[0][2]) + slow_buffer_of(plain[0][2])) == 2 * param_bytes
    per_rank = [tensor_bytes(state_tensors_of(o)) for _, _, o in sharded]
    assert sum(per_rank) == 2 * param_bytes  # the shards tile the state: nothing kept twice
    numels = [sum(p.numel() for p in g["params"]) for g in opt.param_groups]
    ceil_bytes = 2 * 4 * sum(-(-n // m) for n in numels)  # float32; rounding up per bucket
    assert all(b <= ceil_bytes for b in per_rank)
    assert max(per_rank) < 2 * param_bytes / m + 2 * 4 * len(numels)


# --- checkpoints --------------------------------------------------------------------------
@pytest.mark.parametrize("outer", ["heavyball", "custom-sgd"], ids=["heavyball", "custom-sgd"])
def test_resume_sharded_mid_inner_loop_equals_uninterrupted(outer):
    m, steps, stop = 3, 11, 5
    kwargs = dict(tau=3, buffers="maintain", shard_slow_state=True, **OUTER[outer])
    full = run(m, steps, **kwargs)

    def check(opt):
        assert opt.inner_step == stop % 3 and opt.outer.captured

    resumed = resume_in_fresh_workers(
        m, lambda comm, model: build(comm, model, **kwargs), train, stop, steps, check
    )
    assert_same_models(resumed, [model for model, _, _ in full])


def test_resume_sharded_fragments_with_one_in_flight_equals_uninterrupted():
    m, steps, stop = 3, 14, 4  # tau=6, fragments=3: fragment 1's boundary at 4 lands at 5
    kwargs = dict(tau=6, fragments=3, overlap=1, shard_slow_state=True, slow_momentum=0.6)
    full = run(m, steps, **kwargs)

    def check(opt):
        assert opt.outer.in_flight is not None and opt.outer.in_flight.fragment == 1

    resumed = resume_in_fresh_workers(
        m, lambda comm, model: build(comm, model, **kwargs), train, stop, steps, check
    )
    assert_same_models(resumed, [model for model, _, _ in full])


def _saved_states(m, shard):
    """Each rank's state_dict after 2 steps of tau=3 (mid inner loop), as bytes."""
    models = [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        opt = build(comm, model, tau=3, shard_slow_state=shard)
        train(opt, model, comm.rank, 0, 2)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        return buf.getvalue()

    return [torch.load(io.BytesIO(b), weights_only=False) for b in run_threads(m, worker)]


def _try_load(m, shard, state_for_rank):
    """Build fresh optimizers, load ``state_for_rank(rank)``; per rank (error message,
    unchanged?)."""
    models = [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        opt = build(comm, model, tau=3, shard_slow_state=shard)
        train(opt, model, comm.rank, 0, 1)
        snapshot = (
            opt.inner_step,
            opt.num_steps,
            [t.clone() for t in state_tensors_of(opt)],
        )
        try:
            opt.load_state_dict(state_for_rank(comm.rank))
            msg = ""
        except ValueError as e:
            msg = str(e)
        after = (opt.inner_step, opt.num_steps, state_tensors_of(opt))
        unchanged = snapshot[:2] == after[:2] and all(
            torch.equal(a, b) for a, b in zip(snapshot[2], after[2])
        )
        return msg, unchanged

    return run_threads(m, worker)


def test_load_sharded_state_into_another_world_size_is_refused():
    saved = _saved_states(2, shard=True)
    for msg, unchanged in _try_load(3, True, lambda r: saved[min(r, 1)]):
        assert "saved by 2 workers, this job has 3" in msg and unchanged


def test_load_sharded_state_into_unsharded_optimizer_is_refused():
    saved = _saved_states(2, shard=True)
    for msg, unchanged in _try_load(2, False, lambda r: saved[r]):
        assert "saved with shard_slow_state=True" in msg and unchanged


def test_load_unsharded_state_into_sharded_optimizer_is_refused():
    saved = _saved_states(2, shard=False)
    for msg, unchanged in _try_load(2, True, lambda r: saved[r]):
        assert "saved with shard_slow_state=False" in msg and unchanged


def test_load_another_ranks_shard_is_refused():
    saved = _saved_states(2, shard=True)
    for rank, (msg, unchanged) in enumerate(_try_load(2, True, lambda r: saved[1 - r])):
        assert f"rank {1 - rank}'s shard, loaded on rank {rank}" in msg and unchanged


def test_broadcast_optimizer_state_is_refused_when_sharded():
    models = [make_model() for _ in range(2)]

    def worker(comm):
        opt = build(comm, models[comm.rank], tau=3, shard_slow_state=True)
        with pytest.raises(ValueError, match="each rank holds its own shard"):
            broadcast_optimizer_state(opt)

    run_threads(2, worker)


# --- other paths --------------------------------------------------------------------------
def _poisoned(m, shard):
    """NaN on rank 1 at the second outer step (tau=2, step 3), nonfinite='skip'."""
    models = [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        opt = build(
            comm,
            model,
            tau=2,
            slow_lr=0.8,
            slow_momentum=0.6,
            nonfinite="skip",
            shard_slow_state=shard,
        )
        snaps = []
        for k in range(6):
            set_lr(opt, k)
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            if comm.rank == 1 and k == 3:
                model[0].weight.grad[0, 0] = float("nan")
            opt.step()
            if opt.inner_step == 0:
                snaps.append(params_of(model))
        return model, snaps, opt

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threads(m, worker)
    assert any("outer step skipped" in str(w.message) for w in caught)
    return results


def test_nonfinite_skip_restores_the_gathered_anchor():
    sharded, plain = _poisoned(3, True), _poisoned(3, False)
    assert_ranks_equal(sharded)
    assert_same_runs(sharded, plain)
    # The skipped outer step restarted from the anchor.
    for a, b in zip(sharded[0][1][1], sharded[0][1][0]):
        assert torch.equal(a, b)


def test_add_param_group_after_capture_matches_unsharded():
    def run_with_extra(shard):
        models = [make_model() for _ in range(3)]

        def worker(comm):
            model = models[comm.rank]
            opt = build(comm, model, tau=2, slow_lr=0.8, slow_momentum=0.6, shard_slow_state=shard)
            train(opt, model, comm.rank, 0, 3)
            extra = torch.nn.Parameter(torch.arange(5.0))
            opt.add_param_group({"params": [extra], "lr": 0.1})
            for k in range(3, 8):
                opt.zero_grad()
                loss_at(model, comm.rank, k).backward()
                extra.grad = torch.full((5,), float(comm.rank + 1))
                opt.step()
            return extra.detach().clone(), params_of(model)

        return run_threads(3, worker)

    for (ea, pa), (eb, pb) in zip(run_with_extra(True), run_with_extra(False)):
        assert torch.equal(ea, eb) and not torch.equal(ea, torch.arange(5.0))
        assert all(torch.equal(a, b) for a, b in zip(pa, pb))


# --- bad input ----------------------------------------------------------------------------
def _make(**kwargs):
    model = make_model()
    return DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        communicator=kwargs.pop("communicator", ThreadWorld(1).communicator(0)),
        **kwargs,
    )


def test_shard_slow_state_must_be_bool():
    with pytest.raises(TypeError, match="shard_slow_state must be True or False, got 'yes'"):
        _make(shard_slow_state="yes")


def test_shard_slow_state_needs_a_slow_update():
    with pytest.raises(ValueError, match="no slow state to shard"):
        _make(shard_slow_state=True, slow_lr=1.0, slow_momentum=0.0)


def test_shard_slow_state_needs_the_exact_average():
    with pytest.raises(ValueError, match="needs the exact average"):
        _make(shard_slow_state=True, average=False)


def test_shard_slow_state_needs_a_capable_communicator():
    class AverageOnly(Communicator):
        rank, size = 0, 1

        def _average_(self, tensors, name):
            return 0

        def _allgather_object(self, obj):
            return [obj]

        def _broadcast_object(self, obj, root_rank):
            return obj

    with pytest.raises(TypeError, match="needs a communicator with reduce_scatter_mean"):
        _make(shard_slow_state=True, communicator=AverageOnly())


def test_shard_slow_state_must_agree_across_ranks():
    def worker(comm):
        model = models[comm.rank]
        with pytest.raises(ValueError, match="shard_slow_state=False .rank 0: True."):
            build(comm, model, shard_slow_state=comm.rank == 0)

    models = [make_model() for _ in range(2)]
    run_threads(2, worker)


# --- under horovodrun ---------------------------------------------------------------------
HOROVOD_LAUNCHES = [2, 3]


@pytest.mark.horovod
@pytest.mark.timeout(400)
@pytest.mark.parametrize("np_", HOROVOD_LAUNCHES, ids=[f"np{n}-gloo" for n in HOROVOD_LAUNCHES])
def test_horovod_sharded_ranks_bitwise_equal_and_close_to_unsharded(tmp_path, np_):
    from horovod_launch import horovodrun

    worker = os.path.join(os.path.dirname(__file__), "workers", "sharded_worker.py")
    horovodrun(np_, "gloo", [worker, str(tmp_path)], timeout=300)
    spec = importlib.util.spec_from_file_location("sharded_worker", worker)
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    results = [torch.load(tmp_path / f"sharded.{r}.pt", weights_only=False) for r in range(np_)]
    for name in results[0]:
        plain = [res[name]["plain"] for res in results]
        for variant in ("sharded-reducescatter", "sharded-alltoall"):
            sharded = [res[name][variant] for res in results]
            what = f"np={np_} {name} {variant}"
            assert len(sharded[0]["snaps"]) == 3
            for per_rank in zip(*[s["snaps"] for s in sharded]):  # after every outer step
                for tensors in zip(*per_rank):
                    assert all(torch.equal(t, tensors[0]) for t in tensors[1:]), (
                        f"{what}: ranks differ"
                    )
            # Not bitwise in general: Horovod's allreduce (unsharded) and the reduce-scatter add
            # the workers' values in different orders (Gloo's ring or halving-doubling vs rank
            # order), so the averages can differ in the last bit, and three outer steps carry that.
            bitwise = all(
                torch.equal(a, b)
                for sa, sb in zip(sharded[0]["snaps"], plain[0]["snaps"])
                for a, b in zip(sa, sb)
            )
            print(f"{what}: sharded vs unsharded bitwise equal: {bitwise}")
            for s, p in zip(sharded, plain):
                for a, b in zip(s["final"], p["final"]):
                    torch.testing.assert_close(
                        a, b, rtol=1e-5, atol=1e-5, msg=f"{what}: sharded vs unsharded"
                    )
            # Shards tile the state
            assert sum(s["state_bytes"] for s in sharded) == plain[0]["state_bytes"]
            assert max(s["state_bytes"] for s in sharded) < plain[0]["state_bytes"] / np_ + 64
            # Reduce-scatter + all-gather move what one allreduce does (up to int rounding).
            assert sharded[0]["bytes_sent"] == pytest.approx(plain[0]["bytes_sent"], abs=32)
        # The alltoall transport sums in rank order, as the thread communicator does: the same run
        # on in-process threads must give the same parameters bit for bit.
        models = [make_model() for _ in range(np_)]

        def replayed(comm, cfg=replay.CONFIGS[name], models=models):
            return replay.run(cfg, comm, True, models[comm.rank])

        threads = run_threads(np_, replayed)
        for rank, want in enumerate(threads):
            for a, b in zip(results[rank][name]["sharded-alltoall"]["snaps"], want["snaps"]):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (
                    f"np={np_} {name}: alltoall vs threads"
                )


def test_horovod_communicator_rejects_unknown_reduce_scatter():
    from hvd_slowmo.comm.horovod import HorovodCommunicator

    with pytest.raises(
        ValueError,
        match="reduce_scatter must be one of 'auto', 'reducescatter', 'alltoall', got 'ring'",
    ):
        HorovodCommunicator(reduce_scatter="ring")


def test_sharded_reduce_scatter_runs_behind_the_overlapped_steps():
    """With overlap the reduce-scatter starts at the boundary on the exchange's own thread
    (started, not deferred to the landing), and its shard waits in ``sent`` for the landing."""

    def worker(comm):
        model = make_model()
        opt = build(comm, model, tau=4, overlap=2, shard_slow_state=True, slow_momentum=0.5)
        seen = []
        for k in range(6):
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
            f = opt.outer.in_flight
            seen.append(None if f is None else (f._average is None or f._average.started))
        return seen

    for seen in run_threads(2, worker):
        assert seen[3] is True  # in flight after the boundary at step 4, already started
        assert seen[5] is None  # landed at step 6


def test_sharded_reduce_scatter_over_torch_distributed_waits_for_the_landing():
    """torch.distributed pairs collectives by order per group: no second thread, deferred."""
    from hvd_slowmo.exchange.sharded import ShardedExchange

    comm = ThreadWorld(2).communicator(0)
    assert ShardedExchange(comm, None, overlap=2)._thread is not None  # type: ignore[arg-type]
    comm.collectives_any_thread = False  # as TorchDistCommunicator declares
    assert ShardedExchange(comm, None, overlap=2)._thread is None  # type: ignore[arg-type]
    assert ShardedExchange(ThreadWorld(2).communicator(0), None, overlap=0)._thread is None  # type: ignore[arg-type]
