"""hvd_slowmo.memory.held_bytes: each part of a running optimizer, each storage counted once,
against the sizes the parts must have (and the planner's kept parts)."""

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.memory import PARTS, held_bytes
from hvd_slowmo.plan import Cluster, Setting, memory_parts

N = 100 * 100 + 100  # a Linear(100, 100)


def run(steps: int, **options):
    def fn(comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(100, 100)
        opt = DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=4,
            slow_momentum=0.5,
            **options,
        )
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 100)).sum().backward()
            opt.step()
        return held_bytes(opt)

    return run_threads(2, fn)[0]


def test_each_part_of_an_int8_run_with_an_average_in_flight():
    # Step 9 of tau=4 with overlap=2: the average started at step 8 is in flight (sent and
    # snapshot copies); Adam's two moments, an anchor, a slow buffer, a residual, and the kept
    # pseudo-gradient buffer, each one copy of the model.
    held = run(9, codec="int8", error_feedback=True, overlap=2)
    assert list(held) == list(PARTS)
    copy = 4 * N
    assert held["parameters"] == held["gradients"] == held["anchor"] == copy
    assert held["slow buffer"] == held["residual"] == held["codec scratch"] == copy
    assert 2 * copy <= held["optimizer state"] <= 2 * copy + 16  # the moments and step counters
    assert held["in flight"] == 2 * copy
    planned = memory_parts(Setting("int8", overlap=2), N, Cluster(2))
    for part in ("parameters", "gradients", "anchor", "slow buffer", "residual", "in flight"):
        assert held[part] == planned[part], part


def test_without_overlap_nothing_is_counted_twice():
    # overlap=0: the outer step averages the parameters themselves; no codec, no residual.
    held = run(8)
    assert held["in flight"] == held["residual"] == held["codec scratch"] == 0
    assert held["parameters"] == held["anchor"] == 4 * N


@pytest.mark.parametrize("codec", ["int8", "sparse"])
def test_the_fragments_share_one_scratch_buffer(codec):
    # Four fragments of 930 parameters, each averaged three times: one buffer (the
    # pseudo-gradient, then the mean; sparse: padded to a whole chunk, the sum's length) serves
    # them all, the same storage every outer step, where each fragment kept its own
    # pseudo-gradient buffer and, sparse, its sum buffer before (four or eight times the bytes).
    fragment = 30 * 30 + 30

    def fn(comm):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(30, 30) for _ in range(4)])
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=8,
            fragments=4,
            overlap=1,
            codec=codec,
            error_feedback=True,
        )
        pointers = []
        for step in range(1, 25):
            opt.zero_grad()
            model(torch.randn(4, 30)).square().mean().backward()
            opt.step()
            if step % 8 == 0:
                scratch = {
                    t.data_ptr() for f in opt.outer.fragments for t in f.exchange.average.scratch
                }
                pointers.append(scratch)
        return held_bytes(opt), pointers

    held, pointers = run_threads(2, fn)[0]
    assert len(pointers[0]) == 1 and pointers[0] == pointers[1] == pointers[2]
    assert held["codec scratch"] == 4 * (4096 if codec == "sparse" else fragment)
