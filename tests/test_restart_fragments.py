"""A restart (change of workers) with several fragments: the rule of
:meth:`hvd_slowmo.outer_step.OuterLoop.restart`, checked against hand-written expectations.

The base steps are made traceable: every parameter is one scalar, SGD with lr 1, and at global
step ``n`` worker ``r`` sets the gradient to ``-(r + 1) 2^n``, so the step adds ``(r + 1) 2^n``.
The pseudo-gradient of an outer step is then ``G = x0 - avg = -1.5 * (sum of 2^n over the base
steps it covers)`` (the mean of ``r + 1`` over two workers is 1.5): a set of steps is read off
``G`` exactly (sums of distinct powers of two in float64), and the slow buffer
``u <- beta u + G`` shows which steps each landing covered.
"""

import torch
from torch import nn
from torch.optim import SGD

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import run_threads

from helpers import anchor_of, slow_buffer_of

BETA = 0.5


def covered(steps: range | list[int]) -> float:
    """The pseudo-gradient of an outer step covering ``steps`` (two workers)."""
    return -1.5 * sum(2.0**n for n in steps)


def make(comm, tau=6, fragments=2, overlap=0):
    # Two layers of one scalar each: the strided split puts layer k in fragment k.
    model = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = DistributedOptimizer(
        SGD(model.parameters(), lr=1.0),
        communicator=comm,
        named_parameters=model.named_parameters(),
        tau=tau,
        fragments=fragments,
        overlap=overlap,
        slow_lr=1.0,
        slow_momentum=BETA,
    )
    return model, opt


def step(model, opt, rank):
    n = opt.num_steps + 1  # the global step this base step is counted as
    for p in model.parameters():
        p.grad = torch.full_like(p, -(rank + 1) * 2.0**n)
    opt.step()


def slow_buffers(opt):
    return [float(u) for u in slow_buffer_of(opt)]


def test_restart_right_after_a_fragment_landed_drops_nothing_and_lands_nothing_twice():
    """The issue's case (torchft's failure_recovery): tau 6, two fragments (boundaries at inner
    steps 3 and 6), a restart at step 9 just after fragment 0 landed. The counters stay at 9
    (fragment 0's anchor holds steps 1..9); fragment 1 goes back to its anchor (steps 1..6),
    losing 7..9; then fragment 1 lands at 12 on steps 10..12 and fragment 0 at 15 on 10..15."""
    history = {}

    def worker(comm):
        model, opt = make(comm)
        u = [0.0, 0.0]
        expect = {}
        for _ in range(9):
            step(model, opt, comm.rank)
        # Landed so far: fragment 0 at 3 (1..3) and 9 (4..9), fragment 1 at 6 (1..6).
        u[0] = BETA * covered(range(1, 4)) + covered(range(4, 10))
        u[1] = covered(range(1, 7))
        assert slow_buffers(opt) == u
        opt.adopt_world("a test")
        assert (opt.num_steps, opt.inner_step, opt.outer_steps) == (9, 3, 1)
        # Every fragment is at its anchor, the same on every worker.
        anchor = [float(a) for a in anchor_of(opt)]
        assert [float(p.detach()) for p in model.parameters()] == anchor
        for n in range(10, 16):
            step(model, opt, comm.rank)
            expect[n] = slow_buffers(opt)
        history[comm.rank] = expect
        # Fragment 1 at 12: steps 10..12 only (7..9 were dropped with its params).
        u[1] = BETA * u[1] + covered(range(10, 13))
        assert expect[12] == [u[0], u[1]]
        # Fragment 0 at 15: steps 10..15, each counted once (not 7..9 again, no second landing
        # in the period at 12).
        assert expect[13] == expect[12] == expect[14]
        u[0] = BETA * u[0] + covered(range(10, 16))
        assert expect[15] == u
        assert (opt.num_steps, opt.inner_step, opt.outer_steps) == (15, 3, 2)

    run_threads(2, worker)
    assert history[0] == history[1]


def test_restart_before_the_other_fragment_lands_goes_back_to_the_last_landing():
    """tau 6, two fragments, overlap 1 (fragment 0 starts at inner 3 and lands at 4; fragment 1
    starts at 6 and lands at 7). A restart at step 8 (inner 2): the last boundary that landed is
    fragment 1's at 6, so the counters go back to 6; fragment 0 (anchor: steps 1..3) loses
    4..6. A restart at step 12 (inner 0, fragment 1's outer step in flight) goes back to
    fragment 0's boundary at 9: fragment 1's average in flight is dropped and its boundary at 12
    comes again."""

    def worker(comm):
        model, opt = make(comm, overlap=1)
        for _ in range(8):
            step(model, opt, comm.rank)
        u = [covered(range(1, 4)), covered(range(1, 7))]
        assert slow_buffers(opt) == u
        opt.adopt_world("a test")
        assert (opt.num_steps, opt.inner_step, opt.outer_steps) == (6, 0, 1)
        assert [float(p.detach()) for p in model.parameters()] == [float(a) for a in anchor_of(opt)]
        for _ in range(6):  # to step 12: fragment 0 lands at 10 on 7..9; 1 starts at 12
            step(model, opt, comm.rank)
        u[0] = BETA * u[0] + covered(range(7, 10))
        assert slow_buffers(opt) == u and opt.outer.in_flight is not None
        opt.adopt_world("a test")
        assert opt.outer.in_flight is None
        assert (opt.num_steps, opt.inner_step, opt.outer_steps) == (9, 3, 1)
        for _ in range(4):  # fragment 1 starts at 12 again, lands at 13
            step(model, opt, comm.rank)
        # Its anchor held 1..6; its params went back to it at the restart (counter 9).
        u[1] = BETA * u[1] + covered(range(10, 13))
        assert slow_buffers(opt) == u

    run_threads(2, worker)


def test_one_fragment_restart_is_unchanged():
    """fragments=1: back to the outer step's start (the previous one's with its average in
    flight), as before streaming."""

    def worker(comm):
        model, opt = make(comm, tau=3, fragments=1, overlap=0)
        for _ in range(5):
            step(model, opt, comm.rank)
        opt.adopt_world("a test")
        assert (opt.num_steps, opt.inner_step, opt.outer_steps) == (3, 0, 1)
        model, opt = make(comm, tau=3, fragments=1, overlap=2)
        for _ in range(4):  # boundary at 3, in flight until 5
            step(model, opt, comm.rank)
        opt.adopt_world("a test")
        assert (opt.num_steps, opt.inner_step, opt.outer_steps) == (0, 0, 0)

    run_threads(2, worker)


def _momentum_restart(comm, buffers):
    """Two base steps into an outer step of SGD(momentum=0.9), then a restart."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()  # the same start on every worker (one seed, in order)
    opt = DistributedOptimizer(
        SGD(model.parameters(), lr=0.1, momentum=0.9),
        communicator=comm,
        named_parameters=model.named_parameters(),
        tau=4,
        buffers=buffers,
    )
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.full_like(p, comm.rank + 1.0)
        opt.step()
    before = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()}
    opt.adopt_world("a test")
    return model, opt, before


def test_restart_with_reset_buffers_clears_the_momentum_of_the_dropped_steps():
    """buffers='reset', SGD(momentum=0.9): a restart two steps into an outer step drops those
    steps' momentum with them (the base optimizer's state is empty), so the next step starts its
    momentum afresh (buffer == gradient), from the anchor."""

    def worker(comm):
        model, opt, before = _momentum_restart(comm, "reset")
        assert all(b.abs().sum() > 0 for b in before.values())  # there was momentum to drop
        assert (opt.num_steps, opt.inner_step) == (0, 0)
        assert all(p not in opt.optimizer.state for p in model.parameters())
        anchor = [a.clone() for a in anchor_of(opt)]
        for p, a in zip(model.parameters(), anchor):
            assert torch.equal(p.detach(), a)
        for p in model.parameters():
            p.grad = torch.full_like(p, 5.0)
        opt.step()
        for p, a in zip(model.parameters(), anchor):
            assert torch.equal(opt.state[p]["momentum_buffer"], torch.full_like(p, 5.0))
            torch.testing.assert_close(p.detach(), a - 0.1 * 5.0, rtol=0, atol=1e-15)

    run_threads(2, worker)


def test_restart_with_maintained_buffers_keeps_the_momentum():
    """A test of the test above: buffers='maintain' keeps each worker's momentum through the
    restart (only the parameters go back to the anchor)."""

    def worker(comm):
        model, opt, before = _momentum_restart(comm, "maintain")
        for n, p in model.named_parameters():
            assert torch.equal(opt.state[p]["momentum_buffer"], before[n])

    run_threads(2, worker)
