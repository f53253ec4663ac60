"""The gossip bases' matrix reference (arXiv 1910.00643, Appendix C) and its quadratic problem.

``X_{k+1} = (X_k - lr G_k) P_k^T`` with ``G_k`` the gradients at the de-biased ``Z_k = X_k / w_k``,
replayed by hand in one process with the mixing matrices of :mod:`hvd_slowmo.bases.topology`.
Worker ``i`` minimizes ``0.5 * c_i * ||z - t_i||^2``. Shared by the thread tests
(test_gossip.py) and the horovodrun/torchrun workers.
"""

import torch

from hvd_slowmo.bases.topology import GossipGraph

DIM = 4
LR = 0.3


def centre(rank: int) -> torch.Tensor:
    """Worker ``rank``'s quadratic is ``0.5 * c_i * ||z - t_i||^2``: the target ``t_i``."""
    return torch.arange(DIM, dtype=torch.float64) * (rank + 1) - rank


def curvature(rank: int) -> float:
    return 0.5 + 0.25 * rank


def initial(rank: int) -> torch.Tensor:
    return torch.linspace(-1, 1, DIM, dtype=torch.float64) * (rank + 2)


def reference(
    m: int,
    steps: int,
    topology="exponential",
    peers_per_step: int = 1,
    undirected: bool = False,
    zero_grad: bool = False,
    same_start: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step ``(Z, X, w)``: de-biased parameters and numerators (columns of ``DIM x m``
    matrices) and the push-sum weights."""
    graph = GossipGraph(topology, m, peers_per_step, undirected=undirected)
    x = torch.stack([initial(0 if same_start else i) for i in range(m)], dim=1)
    w = torch.ones(m, dtype=torch.float64)
    out = []
    for k in range(steps):
        z = x / w
        g = (
            torch.zeros_like(x)
            if zero_grad
            else torch.stack([curvature(i) * (z[:, i] - centre(i)) for i in range(m)], dim=1)
        )
        p = graph.mixing_matrix(k)
        x = (x - LR * g) @ p.T
        w = w @ p.T
        out.append((x / w, x, w))
    return out
