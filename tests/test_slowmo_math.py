"""The slow momentum update alone, against torch.optim.SGD replaying it on the pseudo-gradient."""

import pytest
import torch

from hvd_slowmo.slowmo import slow_momentum_step_


@pytest.mark.parametrize(
    "alpha,beta", [(1.0, 0.0), (1.0, 0.7), (0.5, 0.6), (2.0, 0.9)], ids=lambda v: str(v)
)
def test_matches_sgd_replay_with_changing_lr(alpha, beta):
    torch.manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    anchor = [torch.randn(s, dtype=torch.float64) for s in shapes]
    buf = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    ref_anchor = [a.clone().requires_grad_(True) for a in anchor]
    ref = torch.optim.SGD(ref_anchor, lr=1.0, momentum=beta)
    for t, lr in enumerate([0.1, 0.1, 0.03, 0.5]):
        avg = [a + torch.randn_like(a) * 0.01 * (t + 1) for a in anchor]
        for r, x in zip(ref_anchor, avg):
            r.grad = (r.detach() - x) / lr
        ref.param_groups[0]["lr"] = alpha * lr
        ref.step()
        params = [x.clone() for x in avg]
        slow_momentum_step_(params, anchor, buf, lr, alpha, beta)
        for p, a, r in zip(params, anchor, ref_anchor):
            assert torch.equal(p, a), "params must hold the new anchor"
            torch.testing.assert_close(a, r.detach(), rtol=0, atol=1e-12)


def test_lookahead_form():
    """beta=0: x0 <- x0 + alpha * (x - x0), Lookahead's slow-weights update."""
    anchor = [torch.tensor([1.0, 2.0])]
    params = [torch.tensor([3.0, -2.0])]
    slow_momentum_step_(params, anchor, [torch.zeros(2)], lr=0.25, slow_lr=0.5, slow_momentum=0.0)
    assert torch.allclose(anchor[0], torch.tensor([2.0, 0.0]))


def test_zero_lr_is_rejected():
    with pytest.raises(ValueError, match="lr must be > 0"):
        slow_momentum_step_(
            [torch.ones(1)],
            [torch.ones(1)],
            [torch.zeros(1)],
            lr=0.0,
            slow_lr=1.0,
            slow_momentum=0.5,
        )


def test_nesterov_matches_sgd_nesterov_replay():
    torch.manual_seed(1)
    alpha, beta = 0.8, 0.7
    anchor = [torch.randn(6, dtype=torch.float64)]
    buf = [torch.zeros(6, dtype=torch.float64)]
    ref_anchor = [anchor[0].clone().requires_grad_(True)]
    ref = torch.optim.SGD(ref_anchor, lr=1.0, momentum=beta, nesterov=True)
    for lr in [0.1, 0.2, 0.05]:
        avg = [anchor[0] + torch.randn(6, dtype=torch.float64) * 0.1]
        ref_anchor[0].grad = (ref_anchor[0].detach() - avg[0]) / lr
        ref.param_groups[0]["lr"] = alpha * lr
        ref.step()
        params = [avg[0].clone()]
        slow_momentum_step_(params, anchor, buf, lr, alpha, beta, nesterov=True)
        torch.testing.assert_close(anchor[0], ref_anchor[0].detach(), rtol=0, atol=1e-12)
