"""Gossip bases (SGP, OSGP, D-PSGD) on in-process thread workers, against a matrix reference.

The reference is the paper's matrix form (arXiv 1910.00643, Appendix C):
``X_{k+1} = (X_k - lr G_k) P_k^T`` with ``G_k`` the gradients at the de-biased ``Z_k = X_k / w_k``,
replayed by hand in one process with the mixing matrices of :mod:`hvd_slowmo.bases.topology`.
"""

from collections.abc import Callable

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.bases.topology import GossipGraph
from hvd_slowmo.comm.local import run_threads

from helpers import SlowArrivals
from reference_gossip import DIM, LR, centre, curvature, initial, reference


def train(
    m: int,
    steps: int,
    base: str,
    zero_grad: bool = False,
    tau: int = 1000,
    hook: Callable | None = None,
    same_start: bool = False,
    wrap: Callable | None = None,
    **kwargs,
):
    """Run ``steps`` steps of ``base`` on ``m`` thread workers; per rank, the params after each
    step."""

    def worker(comm):
        if wrap:
            comm = wrap(comm)
        p = torch.nn.Parameter(initial(0 if same_start else comm.rank).clone())
        opt = DistributedOptimizer(
            torch.optim.SGD([p], lr=LR),
            named_parameters=[("p", p)],
            base=base,
            tau=tau,
            communicator=comm,
            **{"slow_lr": 1.0, "slow_momentum": 0.0, **kwargs},
        )
        snaps = []
        for k in range(steps):
            opt.zero_grad()
            loss = 0.5 * curvature(comm.rank) * ((p - centre(comm.rank)) ** 2).sum()
            (loss * 0 if zero_grad else loss).backward()
            opt.step()
            snaps.append(p.detach().clone())
            if hook:
                hook(comm, opt, k)
        return snaps, opt

    return run_threads(m, worker)


def star_then_ring(rank: int, size: int, step: int) -> list[int]:
    """A custom time-varying graph with uneven in-degrees (rank 0 hears everyone on even steps),
    so push-sum weights move. (On the circulant exponential and ring graphs every in-degree
    equals every out-degree, so weights stay exactly 1 for any peers_per_step.)"""
    return [(rank + 1) % size] if step % 2 else [0 if rank else 1]


def assert_matches(results, ref, tol=1e-12):
    for k, (z, _, _) in enumerate(ref):
        for rank, (snaps, _) in enumerate(results):
            err = (snaps[k] - z[:, rank]).abs().max().item()
            assert err <= tol, (
                f"rank {rank} step {k}: differs from the matrix reference by {err:.3g}"
            )


@pytest.mark.parametrize("m", range(2, 9), ids=lambda m: f"m{m}")
def test_sgp_matches_matrix_reference(m):
    assert_matches(train(m, 7, "sgp"), reference(m, 7))


@pytest.mark.parametrize("m,p", [(3, 2), (5, 2), (8, 3)], ids=lambda v: str(v))
def test_sgp_with_several_peers_matches_matrix_reference(m, p):
    results = train(m, 7, "sgp", peers_per_step=p)
    assert_matches(results, reference(m, 7, peers_per_step=p))


def test_sgp_on_custom_topology_matches_matrix_reference():
    # Uneven in-degrees: push-sum weights move and de-biasing matters.
    results = train(4, 6, "sgp", topology=star_then_ring)
    assert any(opt.base.ps_weight != 1.0 for _, opt in results)
    assert_matches(results, reference(4, 6, topology=star_then_ring))


@pytest.mark.parametrize(
    "m,topology,p",
    [
        (2, "ring", 1),
        (3, "ring", 1),
        (5, "ring", 1),
        (6, "exponential", 1),
        (8, "exponential", 2),
        (5, "ring", 2),
    ],
    ids=lambda v: str(v),
)
def test_dpsgd_matches_matrix_reference(m, topology, p):
    assert_matches(
        train(m, 7, "dpsgd", topology=topology, peers_per_step=p),
        reference(m, 7, topology=topology, peers_per_step=p, undirected=True),
    )


def test_one_message_per_dtype_carries_every_parameter():
    """float32 and float64 parameters travel as two flat messages (the weight in the float64
    one); both follow the matrix reference, the float32 one to float32 accuracy."""
    m, steps = 4, 5
    ref = reference(m, steps, topology=star_then_ring)

    def worker(comm):
        p64 = torch.nn.Parameter(initial(comm.rank).clone())
        p32 = torch.nn.Parameter(initial(comm.rank).float())
        opt = DistributedOptimizer(
            torch.optim.SGD([p32, p64], lr=LR),
            named_parameters=[("a", p32), ("b", p64)],
            base="sgp",
            tau=1000,
            slow_lr=1.0,
            slow_momentum=0.0,
            communicator=comm,
            topology=star_then_ring,
        )
        before = comm.bytes_sent
        for _ in range(steps):
            opt.zero_grad()
            for p in (p32, p64):
                (
                    0.5 * curvature(comm.rank) * ((p - centre(comm.rank).to(p.dtype)) ** 2).sum()
                ).backward()
            opt.step()
        return p32.detach().clone(), p64.detach().clone(), comm.bytes_sent - before, opt.base.groups

    for rank, (p32, p64, sent, groups) in enumerate(run_threads(m, worker)):
        z = ref[-1][0][:, rank]
        assert (p64 - z).abs().max() < 1e-12 and (p32.double() - z).abs().max() < 1e-5
        assert [(g.params[0].dtype, g.carries_weight) for g in groups] == [
            (torch.float32, False),
            (torch.float64, True),
        ]
        assert sent == steps * (DIM * 4 + (DIM + 1) * 8)  # one peer per step: one message per dtype


def test_reference_catches_a_wrong_mixing():
    # The comparison has teeth: SGP differs from D-PSGD's reference on the same graph.
    with pytest.raises(AssertionError, match="differs from the matrix reference"):
        assert_matches(
            train(4, 3, "sgp", topology="ring"), reference(4, 3, topology="ring", undirected=True)
        )


@pytest.mark.parametrize("p", [1, 2], ids=["one-peer", "two-peers"])
def test_osgp_staleness_zero_is_sgp_bitwise(p):
    """OSGP with staleness 0 mixes every message within the step that sent it, even when no
    message ever looks arrived early (SlowArrivals): the SGP matrix reference, and bitwise the
    trajectory of base='sgp' on an ordinary communicator."""
    osgp = train(5, 6, "osgp", staleness=0, peers_per_step=p, wrap=SlowArrivals)
    assert_matches(osgp, reference(5, 6, peers_per_step=p))
    sgp = train(5, 6, "sgp", peers_per_step=p)
    for (a, _), (b, _) in zip(sgp, osgp):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def osgp_reference(
    m: int, steps: int, staleness: int, topology="exponential"
) -> list[torch.Tensor]:
    """OSGP in matrix form when every message arrives exactly ``staleness`` steps late: with
    ``Y_k = X_k - lr G_k`` and ``P_k = D_k + O_k`` (its diagonal and off-diagonal parts),
    ``X_{k+1} = Y_k D_k^T + Y_{k-s} O_{k-s}^T`` and ``w_{k+1} = w_k D_k^T + w_{k-s} O_{k-s}^T``
    (a message carries the sender's stepped numerator and weight of the step that sent it).
    Returns the de-biased ``Z_{k+1}`` after each step."""
    graph = GossipGraph(topology, m)
    x = torch.stack([initial(i) for i in range(m)], dim=1)
    w = torch.ones(m, dtype=torch.float64)
    sent = []  # (Y_k, w_k, O_k) of every step
    out = []
    for k in range(steps):
        z = x / w
        y = x - LR * torch.stack([curvature(i) * (z[:, i] - centre(i)) for i in range(m)], dim=1)
        p = graph.mixing_matrix(k)
        diag = torch.diag(torch.diagonal(p))
        sent.append((y, w, p - diag))
        x, w = y @ diag.T, w @ diag.T
        if k >= staleness:
            y_old, w_old, off = sent[k - staleness]
            x, w = x + y_old @ off.T, w + w_old @ off.T
        out.append(x / w)
    return out


@pytest.mark.parametrize("staleness", [1, 2], ids=["staleness1", "staleness2"])
def test_osgp_trajectory_matches_delayed_matrix_reference(staleness):
    """With messages that never look arrived early (SlowArrivals), OSGP mixes each one exactly
    ``staleness`` steps after it was sent: every step's parameters follow the delayed matrix
    reference, and the push-sum weights really move."""
    m, steps = 5, 9
    results = train(m, steps, "osgp", staleness=staleness, wrap=SlowArrivals)
    ref = osgp_reference(m, steps, staleness)
    for k, z in enumerate(ref):
        for rank, (snaps, _) in enumerate(results):
            err = (snaps[k] - z[:, rank]).abs().max().item()
            assert err <= 1e-12, (
                f"rank {rank} step {k}: differs from the delayed reference by {err:.3g}"
            )
    assert any(opt.base.ps_weight != 1.0 for _, opt in results)


def _mass_cases():
    for m in range(2, 9):
        yield m, "osgp", {"staleness": 1}
        yield m, "osgp", {"staleness": 2}
        if m >= 3:
            yield m, "sgp", {"topology": star_then_ring}


@pytest.mark.parametrize("m,base,opts", list(_mass_cases()), ids=lambda v: str(v))
def test_push_sum_conserves_mass_every_step(m, base, opts):
    """Sum of weights (on workers and in flight) stays m; the numerators' sum moves by -lr * sum of
    gradients exactly as the average of the updates. In-flight messages sit in the thread world's
    mailbox until their receiver mixes them (which it does right after taking them out)."""
    log = []

    def hook(comm, opt, k):
        w = opt.base.ps_weight
        x = opt.base.params[0].detach() * w
        grad = opt.base.params[0].grad.detach().clone()
        # Lockstep: all sends of step k are posted
        everyone = comm.allgather_object((x.clone(), w, grad))
        if comm.rank == 0:
            mail = list(comm.world._mail.values())
            log.append((everyone, [t.clone() for t in mail]))
        comm.allgather_object(None)  # nobody starts step k+1 before rank 0 has read the mailbox

    results = train(m, 8, base, hook=hook, **opts)
    total = sum(initial(i) for i in range(m))
    moved = False
    for k, (everyone, mail) in enumerate(log):
        weights = sum(w for _, w, _ in everyone) + sum(float(t[-1]) for t in mail)
        assert abs(weights - m) < 1e-12, f"step {k}: total push-sum weight {weights} != {m}"
        total = total - LR * sum(g for _, _, g in everyone)
        mass = sum(x for x, _, _ in everyone) + sum(
            (t[:-1] for t in mail), torch.zeros(DIM, dtype=torch.float64)
        )
        assert torch.allclose(mass, total, atol=1e-11, rtol=0), (
            f"step {k}: numerator mass {mass} != {total}"
        )
        moved |= any(w != 1.0 for _, w, _ in everyone)
    assert moved, "the weights never moved: this case does not test de-biasing"
    assert all(not opt.base._inflight or base == "osgp" for _, opt in results)


@pytest.mark.parametrize(
    "base,opts",
    [
        ("sgp", {}),
        ("sgp", {"peers_per_step": 2}),
        ("osgp", {"staleness": 1}),
        ("dpsgd", {"topology": "ring"}),
        ("dpsgd", {}),
    ],
    ids=lambda v: str(v),
)
def test_zero_gradients_converge_to_the_initial_average(base, opts):
    m, steps = 5, 60
    results = train(m, steps, base, zero_grad=True, **opts)
    for _, opt in results:
        opt.base.flush()
    target = sum(initial(i) for i in range(m)) / m
    dev = [
        max((snaps[k] - target).abs().max().item() for snaps, _ in results) for k in range(steps)
    ]
    # Geometric: a fixed contraction factor over every 6-step window (>= a period of each graph).
    for k in range(0, steps - 12, 6):
        assert dev[k + 6] <= 0.7 * dev[k] or dev[k + 6] < 1e-13, (
            f"{base}: deviation {dev[k]} -> {dev[k + 6]}"
        )
    assert dev[-1] < 1e-9
    for _, opt in results:
        assert torch.allclose(opt.base.params[0].detach(), target, atol=1e-9, rtol=0)


# --- SlowMo over gossip --------------------------------------------------------------------
@pytest.mark.parametrize(
    "base,opts",
    [("sgp", {}), ("osgp", {"staleness": 2, "peers_per_step": 2}), ("dpsgd", {})],
    ids=["sgp", "osgp-moving-weights", "dpsgd"],
)
def test_slowmo_average_makes_workers_bitwise_identical_and_keeps_mass(base, opts):
    """With zero gradients and the slow update off, each outer step's exact average must equal
    the initial average: mass in flight or mis-weighted numerators would move it."""
    m, tau = 5, 3
    target = sum(initial(i) for i in range(m)) / m
    results = train(m, 9, base, zero_grad=True, tau=tau, **opts)
    for k in (tau - 1, 2 * tau - 1, 3 * tau - 1):
        ps = [snaps[k] for snaps, _ in results]
        assert all(torch.equal(ps[0], q) for q in ps[1:]), (
            f"step {k}: workers differ after the exact average"
        )
        assert torch.allclose(ps[0], target, atol=1e-12, rtol=0)
    for _, opt in results:
        assert opt.base.ps_weight == 1.0 and not opt.base._inflight


def slowmo_over_sgp_reference(m, steps, tau, alpha, beta, average, topology):
    """SGP in matrix form with SlowMo's outer step by hand every ``tau`` steps, per worker:
    ``u = beta u + (anchor - x_avg) / lr``, ``anchor -= alpha lr u``. With the exact average,
    ``x_avg`` is the mean of the numerators X (the push-sum consensus value) and weights reset
    to 1; without it (noaverage), each worker's own de-biased z, and weights are kept.
    Returns ``(Z after each step, final weights)``."""
    graph = GossipGraph(topology, m)
    x = torch.stack([initial(0) for _ in range(m)], dim=1)
    w = torch.ones(m, dtype=torch.float64)
    anchor = [initial(0) for _ in range(m)]
    u = [torch.zeros(DIM, dtype=torch.float64) for _ in range(m)]
    out = []
    for k in range(steps):
        z = x / w
        g = torch.stack([curvature(i) * (z[:, i] - centre(i)) for i in range(m)], dim=1)
        p = graph.mixing_matrix(k)
        x, w = (x - LR * g) @ p.T, w @ p.T
        if (k + 1) % tau == 0:
            targets = [x.mean(1) if average else x[:, i] / w[i] for i in range(m)]
            for i in range(m):
                u[i] = beta * u[i] + (anchor[i] - targets[i]) / LR
                anchor[i] = anchor[i] - alpha * LR * u[i]
            if average:
                w = torch.ones(m, dtype=torch.float64)
            x = torch.stack([anchor[i] * w[i] for i in range(m)], dim=1)
        out.append(x / w)
    return out, w


@pytest.mark.parametrize("average", [True, False], ids=["average", "noaverage"])
def test_slowmo_over_sgp_matches_reference_with_slow_momentum(average):
    """SGP-SlowMo and SGP-SlowMo-noaverage over three outer steps (so the slow momentum carries
    over from one outer step to the next) against the matrix reference with the slow update by
    hand, at every step. Uneven in-degrees make the weights move, so the exact average of the
    numerators and the average of the de-biased models differ."""
    m, tau, alpha, beta, steps = 4, 3, 0.8, 0.6, 9
    results = train(
        m,
        steps,
        "sgp",
        tau=tau,
        slow_lr=alpha,
        slow_momentum=beta,
        average=average,
        topology=star_then_ring,
        same_start=True,
    )
    ref, w = slowmo_over_sgp_reference(m, steps, tau, alpha, beta, average, star_then_ring)
    z, x, _ = reference(m, tau, topology=star_then_ring, same_start=True)[-1]
    assert not torch.allclose(x.mean(1), z.mean(1))  # weights moved: the two averages differ
    for k, zk in enumerate(ref):
        for rank, (snaps, _) in enumerate(results):
            err = (snaps[k] - zk[:, rank]).abs().max().item()
            assert err <= 1e-12, f"average={average} rank {rank} step {k}: off by {err:.3g}"
    for rank, (_, opt) in enumerate(results):
        assert opt.base.ps_weight == pytest.approx(w[rank].item(), abs=1e-15)
    if average:
        for k in (tau - 1, 2 * tau - 1, steps - 1):
            assert all(torch.equal(snaps[k], results[0][0][k]) for snaps, _ in results)


# --- checkpoints ---------------------------------------------------------------------------
def test_state_dict_carries_ps_weight_and_resumes_exactly():
    m, steps, cut = 4, 8, 5
    full = train(m, steps, "sgp", topology=star_then_ring)
    saved = []

    def stop_at_cut(comm, opt, k):
        if k == cut - 1:
            saved.append((comm.rank, opt.state_dict(), opt.base.params[0].detach().clone()))

    train(m, cut, "sgp", topology=star_then_ring, hook=stop_at_cut)
    saved = {r: (s, p) for r, s, p in saved}

    def resumed(comm):
        state, p0 = saved[comm.rank]
        p = torch.nn.Parameter(p0.clone())
        opt = DistributedOptimizer(
            torch.optim.SGD([p], lr=LR),
            named_parameters=[("p", p)],
            base="sgp",
            tau=1000,
            slow_lr=1.0,
            slow_momentum=0.0,
            communicator=comm,
            topology=star_then_ring,
        )
        opt.load_state_dict(state)
        assert opt.base.ps_weight == state["slowmo"]["base_algorithm"]["ps_weight"]
        for _ in range(cut, steps):
            opt.zero_grad()
            (0.5 * curvature(comm.rank) * ((p - centre(comm.rank)) ** 2).sum()).backward()
            opt.step()
        return p.detach().clone()

    for rank, p in enumerate(run_threads(m, resumed)):
        assert torch.equal(p, full[rank][0][-1]), f"rank {rank} diverged after resume"
    assert any(s["slowmo"]["base_algorithm"]["ps_weight"] != 1.0 for s, _ in saved.values())


def test_osgp_state_dict_finishes_messages_in_flight():
    seen = []

    def hook(comm, opt, k):
        if k == 2:
            seen.append(len(opt.base._inflight))  # staleness 2: steps 1 and 2 still in flight
            state = opt.state_dict()
            assert not opt.base._inflight and state["slowmo"]["base_algorithm"]["ps_weight"] > 0
            comm.allgather_object(None)

    results = train(3, 3, "osgp", zero_grad=True, staleness=2, hook=hook, wrap=SlowArrivals)
    assert seen == [2, 2, 2]
    xs = sum(opt.base.params[0].detach() * opt.base.ps_weight for _, opt in results)
    assert torch.allclose(xs, sum(initial(i) for i in range(3)), atol=1e-12, rtol=0)
    assert sum(opt.base.ps_weight for _, opt in results) == pytest.approx(3, abs=1e-14)


@pytest.mark.parametrize(
    "bad",
    [{}, {"ps_weight": 0.0}, {"ps_weight": float("nan")}, {"ps_weight": "1"}],
    ids=["missing", "zero", "nan", "string"],
)
def test_bad_ps_weight_in_state_is_refused(bad):
    def worker(comm):
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        opt = DistributedOptimizer(
            torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)], base="sgp", communicator=comm
        )
        state = opt.state_dict()
        state["slowmo"]["base_algorithm"] = bad
        with pytest.raises(ValueError, match="ps_weight"):
            opt.load_state_dict(state)
        return opt.base.ps_weight

    assert run_threads(2, worker) == [1.0, 1.0]


# --- bad input -----------------------------------------------------------------------------
def _build(m, **kwargs):
    def worker(comm):
        p = torch.nn.Parameter(torch.zeros(2))
        return DistributedOptimizer(
            torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)], communicator=comm, **kwargs
        )

    return run_threads(m, worker)


def _islands(rank, size, step):
    return [rank ^ 1]


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        ({"base": "gossip"}, ValueError, "base must be one of"),
        ({"base": "osgp", "staleness": -1}, ValueError, "staleness"),
        ({"base": "osgp", "staleness": 1.5}, TypeError, "staleness"),
        ({"base": "sgp", "staleness": 1}, TypeError, "unknown argument"),
        ({"base": "sgp", "topology": _islands}, ValueError, "not strongly connected"),
        ({"base": "dpsgd", "topology": "torus"}, ValueError, "topology must be"),
        ({"base": "sgp", "peers_per_step": 5}, ValueError, "peers_per_step"),
        ({"base": "sgp", "gossip_transport": "nccl"}, ValueError, "gossip_transport"),
        ({"base": "sgp", "gossip_transport": "horovod"}, ValueError, "Horovod communicator"),
        ({"base": "sgp", "gossip_transport": "mpi"}, ValueError, "MPI launch"),
        ({"base": "sgp", "gossip_timeout": 0}, ValueError, "gossip_timeout"),
    ],
    ids=[
        "unknown-base",
        "negative-staleness",
        "float-staleness",
        "staleness-on-sgp",
        "islands",
        "unknown-topology",
        "too-many-peers",
        "unknown-transport",
        "horovod-transport-without-horovod",
        "mpi-without-mpi",
        "zero-timeout",
    ],
)
def test_bad_gossip_options(kwargs, err, match):
    with pytest.raises(err, match=match):
        _build(4, **kwargs)


@pytest.mark.parametrize("base", ["sgp", "osgp", "dpsgd"])
def test_world_size_one_is_refused(base):
    with pytest.raises(ValueError, match="at least 2 workers"):
        _build(1, base=base)


def test_a_missing_peer_times_out_naming_rank_and_step():
    def worker(comm):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = DistributedOptimizer(
            torch.optim.SGD([p], lr=0.1),
            named_parameters=[("p", p)],
            base="sgp",
            communicator=comm,
            gossip_timeout=0.3,
        )
        if comm.rank == 0:  # rank 1 never steps: rank 0 must fail, not hang
            p.grad = torch.ones(2)
            opt.step()

    with pytest.raises(
        TimeoutError, match=r"rank 0 waited 0s for the step-0 message from rank\(s\) \[1\]"
    ):
        run_threads(2, worker, timeout=10)


# --- double averaging (Yu et al. 2019, Algorithm 5) ------------------------------------------
def test_double_averaging_equals_hand_written_reference():
    """base='localsgd', buffers='average', slow_lr=1, slow_momentum=0: local momentum SGD, and every
    tau steps both the parameters and the momentum buffers are averaged."""
    m, tau, steps, lr, mu = 3, 3, 8, 0.1, 0.9

    def worker(comm):
        p = torch.nn.Parameter(initial(comm.rank).clone())
        opt = DistributedOptimizer(
            torch.optim.SGD([p], lr=lr, momentum=mu),
            named_parameters=[("p", p)],
            base="localsgd",
            tau=tau,
            buffers="average",
            slow_lr=1.0,
            slow_momentum=0.0,
            communicator=comm,
        )
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * curvature(comm.rank) * ((p - centre(comm.rank)) ** 2).sum()).backward()
            opt.step()
        return p.detach().clone()

    got = run_threads(m, worker)
    x = [initial(i) for i in range(m)]
    v = [torch.zeros(DIM, dtype=torch.float64) for _ in range(m)]
    for k in range(steps):
        for i in range(m):
            g = curvature(i) * (x[i] - centre(i))
            v[i] = mu * v[i] + g
            x[i] = x[i] - lr * v[i]
        if (k + 1) % tau == 0:
            xa, va = sum(x) / m, sum(v) / m
            x, v = [xa.clone() for _ in range(m)], [va.clone() for _ in range(m)]
    for i in range(m):
        assert torch.allclose(got[i], x[i], atol=1e-12, rtol=0), f"rank {i}"
    assert not torch.allclose(got[0], got[1])  # 8 % 3 != 0: the last steps were local
