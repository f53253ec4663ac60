"""The hierarchical exchange in the optimizer (hvd_slowmo/exchange/hierarchical.py), on thread
workers in 2 nodes of 2: SlowMo with a codec across nodes equals a hand-written replay whose mean
is written from the description (each node's mean of each shard, the codec's reference mean
across nodes with each rank's residual over its shard, the shards concatenated), every rank is
bitwise identical after each average, the residual resumes bit for bit, a node of replicas
(worker="node") equals the flat run, and bad settings are refused before any state."""

import pytest
import torch
from reference_compression import (
    chunk_bounds,
    reference_compressed_mean,
    reference_slowmo_compressed,
)

from hvd_slowmo import DistributedOptimizer, Hierarchy
from hvd_slowmo.comm.local import run_threads

from helpers import (
    PLAIN_SGD,
    assert_bitwise_equal_across_ranks,
    assert_close_models,
    assert_same_models,
    resume_in_fresh_workers,
    run_slowmo,
    train_steps,
)
from reference import make_model

NODES, LOCAL = 2, 2
M = NODES * LOCAL
NODE_RANKS = [[n * LOCAL + i for i in range(LOCAL)] for n in range(NODES)]
PEERS = [[n * LOCAL + i for n in range(NODES)] for i in range(LOCAL)]


def levels(comm) -> Hierarchy:
    """This thread worker's node and its same-local-rank peers."""
    return Hierarchy(
        node=comm.world.split(NODE_RANKS)[comm.rank], cross=comm.world.split(PEERS)[comm.rank]
    )


def hierarchical_reference_mean(codec: str):
    """``pseudo_mean(grads, residuals)`` for reference_slowmo_compressed, written from the
    description (module docstring); the residuals are per rank, over its shard."""

    def mean(grads, residuals):
        bounds = chunk_bounds(grads[0].numel(), LOCAL)
        new = [None] * M if residuals is not None else None
        shards = []
        for local, (a, b) in enumerate(bounds):
            node_means = []
            for ranks in NODE_RANKS:
                total = grads[ranks[0]][a:b].clone()
                for r in ranks[1:]:
                    total = total + grads[r][a:b]
                node_means.append(total / LOCAL)
            carried = None
            if residuals is not None:
                carried = [
                    torch.zeros(b - a) if residuals[r] is None else residuals[r]
                    for r in PEERS[local]
                ]
            means, lost, _ = reference_compressed_mean(node_means, codec, 256, carried)
            shards.append(means[0])
            if new is not None:
                for r, residual in zip(PEERS[local], lost):
                    new[r] = residual
        whole = torch.cat(shards)
        return [whole.clone() for _ in range(M)], new

    return mean


@pytest.mark.parametrize("codec,feedback", [("int8", True), ("bf16", False)])
def test_codec_across_nodes_matches_the_replay(codec, feedback):
    steps, tau = 10, 3
    kwargs = dict(tau=tau, slow_lr=0.7, slow_momentum=0.6, buffers="reset")
    results = run_slowmo(
        M, steps, PLAIN_SGD, codec=codec, error_feedback=feedback,
        per_rank=lambda comm: {"hierarchical": levels(comm)}, **kwargs,
    )  # fmt: skip
    assert_bitwise_equal_across_ranks(results)  # after every outer step
    ref = reference_slowmo_compressed(
        M, steps, tau, 0.7, 0.6, PLAIN_SGD, codec, feedback,
        pseudo_mean=hierarchical_reference_mean(codec),
    )  # fmt: skip
    flat = reference_slowmo_compressed(M, steps, tau, 0.7, 0.6, PLAIN_SGD, codec, feedback)
    for rank, ((model, _, opt), want, other) in enumerate(zip(results, ref, flat)):
        assert_close_models(model, want, atol=1e-6)
        # A test of the test: the flat compressed average lands elsewhere.
        assert not torch.equal(model[0].weight, other[0].weight)
        saved = opt.state_dict()["slowmo"]["fragments"][0]["exchange"]
        assert (saved is not None) == feedback
        if feedback:  # over this rank's shard of the model, not the whole of it
            start, end = chunk_bounds(sum(p.numel() for p in model.parameters()), LOCAL)[
                rank % LOCAL
            ]
            assert saved["residual"].shape == (end - start,)


def test_the_residual_resumes_bit_for_bit():
    def build(comm, model):
        return DistributedOptimizer(
            PLAIN_SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            tau=4,
            codec="int8",
            error_feedback=True,
            hierarchical=levels(comm),
        )

    models = [make_model() for _ in range(M)]  # here: torch's global RNG is not thread-safe

    def uninterrupted(comm):
        model = models[comm.rank]
        train_steps(build(comm, model), model, comm.rank, 0, 14)
        return model

    def resumed_residual(opt):
        assert opt.exchanges[0].residual is not None  # its own residual was taken back

    want = run_threads(M, uninterrupted)
    got = resume_in_fresh_workers(M, build, train_steps, stop=9, steps=14, check=resumed_residual)
    assert_same_models(got, want)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(base="allreduce", tau=1), "hierarchical=True has nothing to exchange"),
        (dict(fragments=2, tau=4), "fragments=2 with the hierarchical exchange"),
        (dict(shard_slow_state=True), "drop one of shard_slow_state and hierarchical"),
        (dict(merge="samples"), "merge='samples' with the hierarchical exchange"),
    ],
)
def test_bad_settings_are_refused_before_any_state(kwargs, match):
    models = [make_model() for _ in range(M)]

    def fn(comm):
        model = models[comm.rank]
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(ValueError, match=match):
            DistributedOptimizer(
                PLAIN_SGD(model.parameters()),
                named_parameters=model.named_parameters(),
                communicator=comm,
                hierarchical=levels(comm),
                **kwargs,
            )
        return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    assert all(run_threads(M, fn))


def test_a_hierarchy_argument_goes_with_worker_process():
    models = [make_model() for _ in range(M)]

    def fn(comm):
        model = models[comm.rank]
        with pytest.raises(ValueError, match="hierarchical=Hierarchy\\(...\\) goes with"):
            DistributedOptimizer(
                PLAIN_SGD(model.parameters()),
                named_parameters=model.named_parameters(),
                communicator=comm,
                worker=levels(comm),
                hierarchical=levels(comm),
            )
        return True

    assert all(run_threads(M, fn))


@pytest.mark.parametrize("overlap", [0, 2])
def test_the_plain_average_in_two_levels_equals_the_flat_one(overlap):
    """No codec: the node means' mean is the workers' mean up to rounding (2 + 2 workers: the
    same to float32 accuracy); with overlap the two levels run on their own thread and the ranks
    still end each average bitwise identical."""
    kwargs = dict(tau=4, slow_lr=0.7, slow_momentum=0.6, overlap=overlap)
    got = run_slowmo(
        M, 13, PLAIN_SGD, per_rank=lambda comm: {"hierarchical": levels(comm)}, **kwargs
    )
    if overlap == 0:
        assert_bitwise_equal_across_ranks(got)
    else:  # each worker keeps its progress since the boundary: the anchors are the average's
        anchors = [opt.slow_states[0].anchor for _, _, opt in got]
        for rank in range(1, M):
            assert all(torch.equal(a, b) for a, b in zip(anchors[0], anchors[rank])), rank
    assert all(opt.exchanges[0].name == "hierarchical" for _, _, opt in got)
    assert all((opt.exchanges[0]._thread is not None) == (overlap > 0) for _, _, opt in got)
    want = run_slowmo(M, 13, PLAIN_SGD, **kwargs)
    for (a, _, _), (b, _, _) in zip(got, want):
        assert_close_models(a, b, atol=1e-6)
