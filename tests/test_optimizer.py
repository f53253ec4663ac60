"""DistributedOptimizer on in-process thread workers, against hand-written references."""

import io
import warnings

import pytest
import torch

from hvd_slowmo import BaseAlgorithm, DistributedOptimizer, broadcast_optimizer_state
from hvd_slowmo.comm.local import ThreadWorld, run_threads

from helpers import (
    PLAIN_SGD,
    SGD_NESTEROV,
    anchor_of,
    assert_bitwise_equal_across_ranks,
    assert_close_models,
    assert_same_models,
    resume_in_fresh_workers,
    run_slowmo,
    slow_buffer_of,
)
from reference import loss_at, lr_at, make_model, params_of, reference_allreduce, reference_slowmo
from reference_overlap import reference_overlapped

ADAM = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)  # noqa: E731


CASES = {
    "sgd-nesterov-reset": (SGD_NESTEROV, "reset", 0.7, 0.6),
    "sgd-nesterov-maintain": (SGD_NESTEROV, "maintain", 1.0, 0.5),
    "sgd-nesterov-average": (SGD_NESTEROV, "average", 1.0, 0.5),
    "adam-reset": (ADAM, "reset", 1.0, 0.5),
    "adam-maintain": (ADAM, "maintain", 0.5, 0.4),
    "adam-average": (ADAM, "average", 1.0, 0.5),
    "adamw-maintain": (ADAMW, "maintain", 1.0, 0.6),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_general_update_matches_reference(case):
    make_opt, buffers, alpha, beta = CASES[case]
    m, steps, tau = 3, 13, 3
    results = run_slowmo(
        m, steps, make_opt, tau=tau, slow_lr=alpha, slow_momentum=beta, buffers=buffers
    )
    ref = reference_slowmo(m, steps, tau, alpha, beta, make_opt, buffers=buffers)
    assert_bitwise_equal_across_ranks(results)
    for (model, _, _), want in zip(results, ref):
        assert_close_models(model, want)
    assert len(results[0][1]) == steps // tau


def test_buffers_strategies_really_differ():
    """The three strategies must not collapse into one (a test of the tests)."""
    finals = {}
    for buffers in ("reset", "maintain", "average"):
        results = run_slowmo(
            2, 7, SGD_NESTEROV, tau=3, slow_lr=1.0, slow_momentum=0.5, buffers=buffers
        )
        finals[buffers] = params_of(results[0][0])
    assert not torch.equal(finals["reset"][0], finals["maintain"][0])
    assert not torch.equal(finals["maintain"][0], finals["average"][0])


def test_average_touches_floating_per_element_state_only():
    """buffers='average' averages Adam's moments (shaped like their parameter) but never its
    step count: rank 1's counts are made to differ before the outer step, and must survive it."""
    models = [make_model() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            ADAM(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=3,
            buffers="average",
            slow_lr=1.0,
            slow_momentum=0.5,
        )
        before = None
        for k in range(3):
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            if k == 2:  # the outer step follows this step: make the counts differ across ranks
                if comm.rank == 1:
                    for p in opt.params:
                        opt.state[p]["step"] += 10
                comm.allgather_object(None)  # both ranks bumped before either steps
            opt.step()
            if k == 1:
                before = opt.state[opt.params[0]]["exp_avg"].clone()
        return opt, before

    (o0, m0_before), (o1, m1_before) = run_threads(2, worker)
    for opt, count in ((o0, 3.0), (o1, 13.0)):
        assert all(float(opt.state[p]["step"]) == count for p in opt.params)  # counts: not averaged
    s0, s1 = (o.state[o.params[0]]["exp_avg"] for o in (o0, o1))
    assert torch.equal(s0, s1)  # moments: averaged
    # They differed before (so averaging did something)
    assert not torch.equal(m0_before, m1_before)


def test_local_sgd_special_case():
    """beta=0, alpha=1: plain Local SGD (periodic exact average), with no anchor kept."""
    m, steps, tau = 4, 12, 4
    results = run_slowmo(
        m, steps, SGD_NESTEROV, tau=tau, slow_lr=1.0, slow_momentum=0.0, buffers="maintain"
    )
    ref = reference_slowmo(m, steps, tau, 1.0, 0.0, SGD_NESTEROV, buffers="maintain")
    assert_bitwise_equal_across_ranks(results)
    for (model, _, opt), want in zip(results, ref):
        assert_close_models(model, want)
        assert anchor_of(opt) is None and slow_buffer_of(opt) is None


def test_tau_one_is_large_batch_momentum_sgd():
    """tau=1 over plain SGD = momentum SGD (lr, momentum beta) on the worker-averaged gradient."""
    m, steps, beta, lr = 3, 6, 0.8, 0.05
    models = [make_model() for _ in range(m)]
    for mod in models:  # BatchNorm statistics are not part of this identity
        mod[2].track_running_stats = False
    results = run_slowmo(
        m,
        steps,
        PLAIN_SGD,
        schedule=None,
        models=models,
        tau=1,
        slow_lr=1.0,
        slow_momentum=beta,
        buffers="maintain",
    )
    ref = make_model()
    ref[2].track_running_stats = False
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=beta)
    for k in range(steps):
        opt.zero_grad()
        (sum(loss_at(ref, w, k) for w in range(m)) / m).backward()
        opt.step()
    for model, _, _ in results:
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_one_worker_beta_zero_is_lookahead():
    """m=1, beta=0: Lookahead with k=tau steps and slow step size alpha (hand-written)."""
    tau, alpha, steps = 4, 0.5, 12
    got = run_slowmo(
        1, steps, ADAM, schedule=None, tau=tau, slow_lr=alpha, slow_momentum=0.0, buffers="maintain"
    )
    model = make_model()
    fast = torch.optim.Adam(model.parameters(), lr=0.01)
    slow = [p.detach().clone() for p in model.parameters()]
    for k in range(steps):
        fast.zero_grad()
        loss_at(model, 0, k).backward()
        fast.step()
        if (k + 1) % tau == 0:
            with torch.no_grad():
                for s, p in zip(slow, model.parameters()):
                    s.add_(p - s, alpha=alpha)
                    p.copy_(s)
    for a, b in zip(got[0][0].parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_allreduce_base_is_momentum_sgd_on_averaged_gradient():
    m, steps = 2, 5
    results = run_slowmo(
        m,
        steps,
        SGD_NESTEROV,
        schedule=None,
        base="allreduce",
        tau=1,
        slow_lr=1.0,
        slow_momentum=0.0,
        buffers="maintain",
    )
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    for k in range(steps):
        opt.zero_grad()
        (sum(loss_at(ref, w, k) for w in range(m)) / m).backward()
        opt.step()
    for model, _, _ in results:
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(params_of(results[0][0])[0], params_of(results[1][0])[0])


def test_allreduce_base_matches_replay_with_model_buffers():
    """AR-SGD with a learning-rate schedule and BatchNorm statistics, against the replay that the
    horovodrun tier uses too (tests/reference.py): parameters and buffers, every rank."""
    m, steps = 3, 9
    results = run_slowmo(
        m,
        steps,
        SGD_NESTEROV,
        base="allreduce",
        tau=1,
        slow_lr=1.0,
        slow_momentum=0.0,
        buffers="maintain",
    )
    for (model, _, _), want in zip(results, reference_allreduce(m, steps, SGD_NESTEROV)):
        assert_close_models(model, want)
    assert_bitwise_equal_across_ranks(results)


def _train_to(opt, model, rank, start, stop):
    for k in range(start, stop):
        for g in opt.param_groups:
            g["lr"] = lr_at(k)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()


def test_resume_mid_inner_loop_equals_uninterrupted():
    m, steps, stop, tau = 2, 11, 5, 3
    kwargs = dict(tau=tau, slow_lr=0.8, slow_momentum=0.6, buffers="maintain")
    full = run_slowmo(m, steps, SGD_NESTEROV, **kwargs)

    def build(comm, model):
        return DistributedOptimizer(
            SGD_NESTEROV(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            **kwargs,
        )

    def check(opt):
        assert opt.inner_step == stop % tau

    resumed = resume_in_fresh_workers(m, build, _train_to, stop, steps, check)
    assert_same_models(resumed, [model for model, _, _ in full])


def test_broadcast_optimizer_state_copies_rank0():
    """Rank 1 starts from other parameters and takes one step more: after the broadcast its
    anchor, momentum and counters are rank 0's (they all differed before)."""
    models = [make_model(seed=rank) for rank in range(2)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD_NESTEROV(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=4,
        )
        for k in range(1 + comm.rank):
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
        before = io.BytesIO()
        torch.save(opt.state_dict(), before)
        broadcast_optimizer_state(opt, root_rank=0)
        return opt, torch.load(io.BytesIO(before.getvalue()), weights_only=False)

    (o0, before0), (o1, before1) = run_threads(2, worker)
    s0, s1 = o0.state_dict(), o1.state_dict()
    assert not torch.equal(
        before0["slowmo"]["fragments"][0]["slow_state"]["anchor"][0],
        before1["slowmo"]["fragments"][0]["slow_state"]["anchor"][0],
    )
    assert torch.equal(
        s1["slowmo"]["fragments"][0]["slow_state"]["anchor"][0],
        before0["slowmo"]["fragments"][0]["slow_state"]["anchor"][0],
    )
    b0, b1 = (s["base_optimizer"]["state"][0]["momentum_buffer"] for s in (s0, s1))
    assert not torch.equal(before1["base_optimizer"]["state"][0]["momentum_buffer"], b0)
    assert torch.equal(b0, b1)
    assert (o1.num_steps, o1.inner_step) == (o0.num_steps, o0.inner_step) == (1, 1)


def test_per_group_lr_slow_step_matches_reference():
    """Two param groups whose lr follow different schedules: each group's slow step scales its
    pseudo-gradient by its own lr (tests/reference_overlap.py, with no delay)."""
    m, steps, tau, alpha, beta = 2, 9, 3, 0.8, 0.6

    def lrs(k):
        return 0.05 * (1 + k // 4), 0.02 / (1 + k // 3)

    def sgd(params):
        """SGD over two param groups: the first Linear layer (weight, bias), and the rest."""
        params = list(params)
        return torch.optim.SGD(
            [{"params": params[:2]}, {"params": params[2:]}], lr=0.05, momentum=0.9
        )

    def schedule(opt, k):
        for group, lr in zip(opt.param_groups, lrs(k)):
            group["lr"] = lr

    models = [make_model() for _ in range(m)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            sgd(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=tau,
            slow_lr=alpha,
            slow_momentum=beta,
            buffers="maintain",
        )
        for k in range(steps):
            schedule(opt, k)
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            opt.step()
        return params_of(model)

    got = run_threads(m, worker)

    ref_models = reference_overlapped(
        m,
        steps,
        tau,
        0,
        alpha,
        beta,
        sgd,
        buffers="maintain",
        lr_schedule=lrs,
    )
    for params in got:
        for a, b in zip(params, ref_models[0].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_torch_optimizer_surface():
    """LR schedulers, GradScaler, zero_grad(set_to_none), add_param_group see one optimizer."""
    world = ThreadWorld(1)
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DistributedOptimizer(
        base, named_parameters=model.named_parameters(), communicator=world.communicator(0), tau=2
    )
    assert opt.param_groups is base.param_groups and opt.state is base.state
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for k in range(3):
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss_at(model, 0, k)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    assert opt.num_steps == 3 and opt.outer_steps == 1
    assert base.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    extra = torch.nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra], "lr": 0.01})
    extra.grad = torch.ones(3)
    opt.step()  # the new parameter joins the outer step (anchor extended)
    assert len(anchor_of(opt)) == len(opt.params) == len(list(model.parameters())) + 1


def test_model_buffers_are_averaged():
    results = run_slowmo(2, 3, SGD_NESTEROV, tau=3)
    b0 = results[0][0][2].running_mean
    b1 = results[1][0][2].running_mean
    assert torch.equal(b0, b1)


def test_model_buffers_not_averaged_when_not_given():
    models = [make_model() for _ in range(2)]

    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            SGD_NESTEROV(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=1,
        )
        opt.zero_grad()
        loss_at(model, comm.rank, 0).backward()
        opt.step()
        return model[2].running_mean.clone()

    r0, r1 = run_threads(2, worker)
    assert not torch.equal(r0, r1)


def test_zero_lr_outer_step_warns_and_averages():
    models = [make_model() for _ in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_slowmo(
            2, 2, PLAIN_SGD, schedule=lambda k: 0.0 if k == 1 else 0.05, models=models, tau=2
        )
    assert any("lr=0" in str(w.message) for w in caught)
    assert torch.equal(params_of(results[0][0])[0], params_of(results[1][0])[0])


def _poison_rank1(models, nonfinite, poison=True):
    def worker(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            PLAIN_SGD(model.parameters()),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=2,
            slow_lr=1.0,
            slow_momentum=0.5,
            nonfinite=nonfinite,
        )
        for k in range(2):
            opt.zero_grad()
            loss_at(model, comm.rank, k).backward()
            if poison and comm.rank == 1 and k == 1:
                model[0].weight.grad[0, 0] = float("nan")
            try:
                opt.step()
            except FloatingPointError as e:
                return str(e), params_of(model), opt
        return "", params_of(model), opt

    return run_threads(2, worker)


def test_nonfinite_raises_on_every_rank_before_averaging():
    models = [make_model() for _ in range(2)]
    results = _poison_rank1(models, "raise")
    for msg, _, _ in results:
        assert "rank(s) [1] after step 2" in msg, msg
    assert torch.isfinite(results[0][1][0]).all(), "rank 0 must not receive rank 1's NaN"


def test_nonfinite_skip_restarts_from_anchor():
    models = [make_model() for _ in range(2)]
    start = params_of(models[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = _poison_rank1(models, "skip")
    assert any("outer step skipped" in str(w.message) for w in caught)
    for msg, params, opt in results:
        assert msg == "" and opt.outer_steps == 1 and opt.inner_step == 0
        for a, b in zip(params, start):
            assert torch.equal(a, b)


def test_nonfinite_ignore_skips_the_check_and_its_collective():
    """nonfinite='ignore': no check, no error, no warning: rank 1's NaN is averaged into every
    worker; the one collective the check costs (a 4-float64 allreduce, 32 bytes at m=2) is not
    sent."""
    clean = _poison_rank1([make_model() for _ in range(2)], "raise", poison=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = _poison_rank1([make_model() for _ in range(2)], "ignore")
    for (msg, params, opt), (_, _, clean_opt) in zip(results, clean):
        assert msg == "" and opt.outer_steps == 1
        assert torch.isnan(params[0]).any(), "the average must carry rank 1's NaN to every rank"
        assert clean_opt.comm.bytes_sent - opt.comm.bytes_sent == 32


def test_nesterov_outer_optimizer_matches_reference():
    m, steps, tau, alpha, beta = 2, 8, 4, 1.0, 0.6
    results = run_slowmo(
        m,
        steps,
        SGD_NESTEROV,
        schedule=None,
        tau=tau,
        slow_lr=alpha,
        slow_momentum=beta,
        outer_optimizer="nesterov",
        buffers="maintain",
    )
    ref = reference_slowmo(
        m,
        steps,
        tau,
        alpha,
        beta,
        SGD_NESTEROV,
        buffers="maintain",
        lr_schedule=None,
        outer_nesterov=True,
    )
    assert_bitwise_equal_across_ranks(results)
    for (model, _, _), want in zip(results, ref):
        assert_close_models(model, want)


def test_custom_outer_optimizer_on_unscaled_pseudo_gradient():
    """DiLoCo-style: SGD(lr=0.7, momentum=0.9, nesterov) on x0 - x_avg, replayed by hand."""
    m, steps, tau = 2, 9, 3
    outer = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    results = run_slowmo(m, steps, ADAM, tau=tau, outer_optimizer=outer, buffers="maintain")
    models = [make_model() for _ in range(m)]
    opts = [ADAM(mod.parameters()) for mod in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    u = [torch.zeros_like(a) for a in anchor]
    for k in range(steps):
        for w in range(m):
            for g in opts[w].param_groups:
                g["lr"] = lr_at(k)
            opts[w].zero_grad()
            loss_at(models[w], w, k).backward()
            opts[w].step()
        if (k + 1) % tau == 0:
            with torch.no_grad():
                plist = [list(mod.parameters()) for mod in models]
                for i, a in enumerate(anchor):
                    g = a - sum(plist[w][i] for w in range(m)) / m
                    u[i] = g.clone() if k + 1 == tau else 0.9 * u[i] + g
                    a -= 0.7 * (g + 0.9 * u[i])
                    for w in range(m):
                        plist[w][i].copy_(a)
    for model, _, _ in results:
        for a, b in zip(model.parameters(), models[0].parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    sd = results[0][2].state_dict()["slowmo"]["fragments"][0]["slow_state"]["outer_optimizer"]
    assert sd["state"][0]["momentum_buffer"].shape == anchor[0].shape


def test_custom_outer_optimizer_state_survives_resume():
    outer = lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)  # noqa: E731
    full = run_slowmo(1, 8, SGD_NESTEROV, tau=2, outer_optimizer=outer)

    def build(comm, model):
        return DistributedOptimizer(
            SGD_NESTEROV(model.parameters()),
            named_parameters=model.named_parameters(),
            model_buffers=model.buffers(),
            communicator=comm,
            tau=2,
            outer_optimizer=outer,
        )

    def check(opt):
        assert opt.slow_states[0].outer_optimizer.state  # the outer momentum came from the file

    resumed = resume_in_fresh_workers(1, build, _train_to, 5, 8, check)
    assert_same_models(resumed, [full[0][0]])


def test_add_param_group_joins_custom_outer_optimizer():
    world = ThreadWorld(1)
    model = make_model()
    opt = DistributedOptimizer(
        PLAIN_SGD(model.parameters()),
        named_parameters=model.named_parameters(),
        communicator=world.communicator(0),
        tau=1,
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0),
    )
    opt.zero_grad()
    loss_at(model, 0, 0).backward()
    opt.step()
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra], "lr": 0.1})
    extra.grad = torch.ones(3)
    opt.step()  # outer SGD(lr=1) on x0 - x = 0.1: the new parameter must reach -0.1, not 0
    assert torch.allclose(extra.detach(), torch.full((3,), -0.1))


class StepLog(BaseAlgorithm):
    """A user's base algorithm (not registered): Local SGD that records the hooks it received."""

    OPTIONS = ("tag",)

    def __init__(self, comm, tag="log"):
        super().__init__(comm)
        self.tag, self.calls = tag, []

    def pre_step(self):
        self.calls.append("pre")

    def post_step(self, step):
        self.calls.append(step)

    def after_average(self, averaged):
        self.calls.append(f"average={averaged}")


def test_base_accepts_a_user_subclass():
    """base= takes a BaseAlgorithm subclass: its hooks run in the documented order, its options
    pass through, its name is its class name, and with no communication of its own the run is
    bitwise Local SGD's."""
    kwargs = dict(tau=3, slow_lr=0.8, slow_momentum=0.6)
    custom = run_slowmo(2, 6, SGD_NESTEROV, base=StepLog, tag="mine", **kwargs)
    plain = run_slowmo(2, 6, SGD_NESTEROV, base="localsgd", **kwargs)
    for (model, _, opt), (want, _, _) in zip(custom, plain):
        assert isinstance(opt.base, StepLog) and opt.base.tag == "mine"
        outer = ["pre", 0, "pre", 1, "pre", 2, "average=True"]
        assert opt.base.calls == outer + ["pre", 3, "pre", 4, "pre", 5, "average=True"]
        assert (
            opt.base_name == "StepLog" and opt.state_dict()["slowmo"]["config"]["base"] == "StepLog"
        )
        assert_same_models([model], [want])
    with pytest.raises(TypeError, match=r"unknown argument\(s\) \['topology'\] .*base='StepLog'"):
        run_slowmo(1, 1, SGD_NESTEROV, base=StepLog, topology="ring")
