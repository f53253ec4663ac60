"""The communicators' shared conventions (issue 27): one handle protocol (``done()`` never blocks,
``wait()`` completes) on every in-flight type, and one byte counter per optimizer with the
documented formula per collective and ``comm.uncounted()`` for evaluation traffic."""

import inspect

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.base import PendingAverage, PendingExchange, PendingTensors, joined
from hvd_slowmo.comm.hierarchy import Hierarchy
from hvd_slowmo.comm.local import ThreadWorld, run_threads
from hvd_slowmo.compression.exchange import PendingMean

from reference import loss_at, make_model

HANDLES = [PendingAverage, PendingTensors, PendingExchange, PendingMean]


@pytest.mark.parametrize("handle", HANDLES, ids=lambda h: h.__name__)
def test_every_handle_has_done_and_wait_as_methods(handle):
    for verb in ("done", "wait"):
        attr = inspect.getattr_static(handle, verb)
        assert inspect.isfunction(attr), f"{handle.__name__}.{verb} is {type(attr).__name__}"
    assert not hasattr(handle, "poll"), "poll() became done()"


def test_a_finished_average_is_done_and_a_deferred_one_is_not():
    assert PendingAverage().done() is True
    ran = []
    deferred = PendingAverage(lambda: ran.append(1), started=False)
    assert deferred.done() is False and not ran  # done() never runs the collective
    deferred.wait()
    deferred.wait()  # at most once
    assert ran == [1] and deferred.done() is True


M, N = 4, 1000  # workers, float32 elements


def test_bytes_per_collective_follow_the_documented_formula():
    def fn(comm):
        x = torch.full((N,), float(comm.rank))
        counts = []
        for op in (
            lambda: comm.average_([x], "a"),
            lambda: comm.average_start([x], "b").wait(),
            lambda: comm.reduce_scatter_mean([x], "c"),
            lambda: comm.allgather_flat([x[: N // M]], "d"),
            lambda: comm.alltoall_flat(list(x.split(N // M)), [N // M] * M, "e"),
            lambda: comm.exchange_start({(comm.rank + 1) % M: x}, [(comm.rank - 1) % M], 0).wait(),
        ):
            before = comm.bytes_sent
            op()
            counts.append(comm.bytes_sent - before)
        return counts

    payload = 4 * N
    want = [
        2 * (M - 1) * payload // M,  # allreduce: a ring's reduce-scatter and all-gather
        2 * (M - 1) * payload // M,
        (M - 1) * payload // M,  # reduce-scatter of the flat tensor
        (M - 1) * payload // M,  # all-gather: the gathered result is the payload
        (M - 1) * payload // M,  # all-to-all: the messages to the other workers
        payload,  # one neighbour message
    ]
    assert run_threads(M, fn) == [want] * M


def test_uncounted_traffic_is_not_counted_even_when_it_finishes_outside():
    def fn(comm):
        x = torch.ones(N)
        with comm.uncounted():
            comm.average_([x], "a")
            with comm.uncounted():  # nests
                comm.average_([x], "b")
            comm.average_([x], "c")
            pending = comm.allgather_flat_start([x], "d")
        pending.wait()
        quiet = comm.bytes_sent
        comm.allgather_flat([x], "e")
        return quiet, comm.bytes_sent

    for quiet, loud in run_threads(2, fn):
        assert quiet == 0 and loud == 4 * N  # (m-1)/m of the 2N gathered elements


def test_node_and_cross_levels_count_in_the_optimizers_one_counter():
    models = [make_model() for _ in range(4)]

    def fn(comm):
        world = comm.world
        node = world.split([[0, 1], [2, 3]])[comm.rank]
        cross = world.split([[0, 2], [1, 3]])[comm.rank]
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            communicator=comm,
            base="allreduce",
            tau=2,
            worker=Hierarchy(node=node, cross=cross),
        )
        before = (opt.bytes_sent, node.bytes_sent, cross.bytes_sent)
        opt.zero_grad()
        loss_at(model, comm.rank, 0).backward()
        opt.step()
        with opt.use_consensus():  # AR-SGD is at consensus: no traffic anyway
            pass
        return before, opt.bytes_sent, opt.comm.bytes_sent, node.counter is comm.counter

    grads = 4 * sum(p.numel() for p in models[0].parameters())
    for before, total, comm_total, shared in run_threads(4, fn):
        assert before == (0, 0, 0) and shared
        # One gradient allreduce inside the node (2 ranks), one across nodes (2 ranks).
        assert total == comm_total == 2 * grads


def test_consensus_traffic_is_uncounted():
    models = [make_model() for _ in range(2)]

    def fn(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), communicator=comm, tau=4
        )
        opt.zero_grad()
        loss_at(model, comm.rank, 0).backward()
        opt.step()
        before = opt.bytes_sent
        with opt.use_consensus() as already:
            pass
        return already, opt.bytes_sent - before

    assert run_threads(2, fn) == [(False, 0)] * 2


def test_a_thread_world_of_one_counts_nothing():
    comm = ThreadWorld(1).communicator(0)
    comm.average_([torch.ones(3)], "a")
    assert comm.bytes_sent == 0


def test_joined_views_packets_of_one_buffer_and_copies_anything_else():
    buffer = torch.arange(12, dtype=torch.uint8)
    pieces = list(buffer[1:].split([3, 0, 4, 4]))  # an empty piece too
    view = joined(pieces)
    assert torch.equal(view, buffer[1:]) and view.data_ptr() == buffer[1:].data_ptr()
    assert joined(pieces[:1]).data_ptr() == pieces[0].data_ptr()
    other = torch.arange(5, dtype=torch.uint8)
    for apart in (
        [buffer[:3], buffer[4:8]],  # a gap
        [buffer[4:8], buffer[:4]],  # out of order
        [buffer[:3], other],  # two storages
        [buffer[0:6:2], buffer[6:9]],  # strided
    ):
        out = joined(apart)
        assert torch.equal(out, torch.cat(apart))
        assert all(out.data_ptr() != t.data_ptr() for t in apart), "a copy"
