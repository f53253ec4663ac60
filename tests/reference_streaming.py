"""Hand-written single-process reference of streaming SlowMo (fragments) and eager updates.

Every worker is simulated in one process, by hand, with plain tensors (nothing here uses
hvd_slowmo). ``m`` workers, ``tau`` base steps per period, ``P`` fragments, delay ``d``
(``0 <= d < tau``). The parameters are grouped into layers (name up to the last ``.``), layers
numbered in order of appearance, layer ``l`` in fragment ``l mod P``. Fragment ``k`` starts its
outer step at the global steps ``n >= b_k`` with ``n = b_k (mod tau)``, ``b_k = (k+1) tau // P``,
and lands it at ``n + d``. Model buffers travel with fragment ``P - 1``. For one fragment, with
``x0``, ``u`` its anchor and slow buffer and ``gamma`` the lr at its boundary::

    boundary n:  s_i = x_i ;  avg = mean_i s_i (in flight; or ``average``'s, e.g. compressed)
                 eager:  g_i = (x0 - s_i) / gamma ;  G^_i = c_i + g_i / m   (eager=True)
                                                     G^_i = g_i             (eager="local")
                         u^ = beta u + G^_i ;  x^0_i = x0 - alpha gamma u^
                         (Nesterov: x^0_i = x0 - alpha gamma (G^_i + beta u^))
                         x_i <- x^0_i ;  base_i = x^0_i ;  c_i <- -g_i / m  (eager=True)
                 else:   base_i = s_i
    landing n+d: eager=True:  c_i <- c_i + (x0 - avg) / gamma
                 u <- beta u + (x0 - avg) / gamma ;  x0 <- x0 - alpha gamma u  (Nesterov likewise)
                 x_i <- x0 + (x_i - base_i) + mix (base_i - x0)
                       (= mix x_i + (1 - mix) (x0 + (x_i - base_i)): Streaming DiLoCo's mixing
                       of the worker's fragment with the landed one; mix = 0: no mixing)
                 buffers="reset": the fragment's optimizer state goes

The float operations are spelled in the order a fused implementation would use (``avg - x0``
scaled by ``-1/gamma``; ``torch.add(..., alpha=...)``), so the library can be compared bit
for bit; the arithmetic is the recurrence above.
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from reference import loss_at, make_model

#: ``(members, snapshots, anchor) -> average``: a fragment's exact average (see below).
Average = Callable[[list[int], list[list[torch.Tensor]], list[torch.Tensor]], list[torch.Tensor]]


def strided_fragments(names: list[str], fragments: int) -> list[int]:
    """Each parameter's fragment: layer (name up to the last '.') number modulo ``fragments``."""
    layers: list[str] = []
    out = []
    for name in names:
        layer = name.rsplit(".", 1)[0]
        if layer not in layers:
            layers.append(layer)
        out.append(layers.index(layer) % fragments)
    assert sorted(set(out)) == list(range(fragments)), "a fragment would be empty"
    return out


def reference_streaming(
    m: int,
    steps: int,
    tau: int,
    delay: int,
    fragments: int,
    eager: bool | str,
    slow_lr: float,
    slow_momentum: float,
    make_opt: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    buffers: str = "reset",
    lr_schedule: Callable[[int], float] | None = None,
    nesterov: bool = False,
    model_fn: Callable[[], nn.Module] = make_model,
    average: Average | None = None,
    mix: float = 0.0,
    outer_sgd: tuple[float, float] | None = None,
    spreads: list[list[float]] | None = None,
) -> tuple[list[nn.Module], list[list[torch.Tensor]]]:
    """Replay streaming (and eager) SlowMo over Local SGD for ``m`` workers.

    ``average(members, snapshots, anchor)``, if given, replaces the plain mean of a fragment's
    snapshots: ``members`` are the fragment's parameter indices, ``snapshots[i]`` worker ``i``'s
    parameters at the boundary and ``anchor`` the anchor, both in ``members``' order; it returns
    the average every worker receives, in the same order (the model buffers keep the plain mean).

    ``eager``: False, True (the estimate with the other workers' previous shares ``c_i``) or
    ``"local"`` (the worker's own outer gradient alone). ``mix``: the mixing factor at each
    landing (the model buffers mix the same way, with their average in place of ``x0``).
    ``outer_sgd=(lr, momentum)``: the slow update is a custom outer optimizer, torch's SGD over
    the fragment's anchor with the unscaled pseudo-gradient ``x0 - avg`` (``buf <- momentum buf +
    g`` after a first ``buf = g``; ``x0 <- x0 - lr buf``), stepped for the landing fragment alone.
    ``spreads``, if given, receives at every landing each worker's RMS distance of its snapshot
    ``s_i`` from ``avg`` over the fragment's elements (``opt.replica_spread``).

    Returns:
        Each worker's model, and the anchor (all parameters) after every landing, in order.
    """
    assert 0 <= delay < tau and 1 <= fragments <= tau and buffers in ("reset", "maintain")
    assert eager in (False, True, "local") and (not eager or delay > 0)
    models = [model_fn() for _ in range(m)]
    opts = [make_opt(mod.parameters()) for mod in models]
    names = [n for n, _ in models[0].named_parameters()]
    frag = strided_fragments(names, fragments)
    members = [[j for j in range(len(names)) if frag[j] == k] for k in range(fragments)]
    starts = [(k + 1) * tau // fragments for k in range(fragments)]
    params = [list(mod.parameters()) for mod in models]
    bufs = [[b for b in mod.buffers() if b.is_floating_point()] for mod in models]
    anchor = [p.detach().clone() for p in params[0]]
    slow = [torch.zeros_like(p) for p in params[0]]
    others = [[torch.zeros_like(p) for p in params[0]] for _ in range(m)]  # c_i (eager)
    plain = (slow_lr, slow_momentum) == (1.0, 0.0)  # no slow update: the anchor is the average
    pending: dict[int, tuple] = {}  # fragment -> (lands at, gamma, avg, bases, buffer avg, snaps)
    anchors = []

    sgd_bufs: dict[int, torch.Tensor] = {}

    def land(f: int) -> None:
        _, gamma, avg, bases, avg_b, snap_b, raw = pending.pop(f)
        if spreads is not None:
            count = sum(avg[j].numel() for j in members[f])
            spreads.append(
                [
                    (
                        sum(float((r[j] - avg[j]).double().square().sum()) for j in members[f])
                        / count
                    )
                    ** 0.5
                    for r in raw
                ]
            )
        for j in members[f]:
            if eager is True:
                for c in others:
                    c[j] = c[j] + (anchor[j] - avg[j]) * (1.0 / gamma)
            diff = avg[j] - anchor[j]
            if outer_sgd is not None:
                lr, momentum = outer_sgd
                g = anchor[j] - avg[j]
                sgd_bufs[j] = g.clone() if j not in sgd_bufs else sgd_bufs[j] * momentum + g
                anchor[j] = torch.add(anchor[j], sgd_bufs[j], alpha=-lr)
            elif plain:
                anchor[j] = avg[j].clone()
            else:
                slow[j] = torch.add(slow[j] * slow_momentum, diff, alpha=-1.0 / gamma)
                if nesterov:
                    a = torch.add(anchor[j], slow[j], alpha=-slow_lr * gamma * slow_momentum)
                    anchor[j] = torch.add(a, diff, alpha=slow_lr)
                else:
                    anchor[j] = torch.add(anchor[j], slow[j], alpha=-slow_lr * gamma)
            for i in range(m):
                landed = (params[i][j] - bases[i][j]) + anchor[j]
                if mix:
                    landed = torch.add(landed, bases[i][j] - anchor[j], alpha=mix)
                params[i][j].copy_(landed)
                if buffers == "reset":
                    opts[i].state.pop(params[i][j], None)
        if avg_b is not None:
            for i in range(m):
                for j, b in enumerate(bufs[i]):
                    landed = (b - snap_b[i][j]) + avg_b[j]
                    if mix:
                        landed = torch.add(landed, snap_b[i][j] - avg_b[j], alpha=mix)
                    b.copy_(landed)
        anchors.append([a.clone() for a in anchor])

    def start(f: int, n: int) -> None:
        gamma = opts[0].param_groups[0]["lr"]
        if average is None:
            avg = {j: sum(params[i][j].detach().clone() for i in range(m)) / m for j in members[f]}
        else:
            snaps = [[params[i][j].detach().clone() for j in members[f]] for i in range(m)]
            got = average(members[f], snaps, [anchor[j] for j in members[f]])
            avg = dict(zip(members[f], got))
        bases = [{j: params[i][j].detach().clone() for j in members[f]} for i in range(m)]
        raw = [dict(b) for b in bases]  # the snapshots, before eager moves the bases
        snap_b, avg_b = None, None
        if f == fragments - 1:  # the model buffers travel with the last fragment
            snap_b = [[b.clone() for b in bufs[i]] for i in range(m)]
            avg_b = [sum(bs[j] for bs in snap_b) / m for j in range(len(bufs[0]))]
        if eager:
            for i in range(m):
                for j in members[f]:
                    if eager == "local":  # G^_i = g_i: nothing kept for the next boundary
                        est = (anchor[j] - bases[i][j]) * (1.0 / gamma)
                    else:
                        own = (anchor[j] - bases[i][j]) * (1.0 / (gamma * m))
                        est = others[i][j] + own
                        others[i][j] = -own
                    u_hat = slow[j] * slow_momentum + est
                    step = torch.add(est, u_hat, alpha=slow_momentum) if nesterov else u_hat
                    bases[i][j] = torch.add(anchor[j], step, alpha=-slow_lr * gamma)
                    params[i][j].copy_(bases[i][j])
        pending[f] = (n + delay, gamma, avg, bases, avg_b, snap_b, raw)

    for k in range(steps):
        if lr_schedule is not None:
            for opt in opts:
                for g in opt.param_groups:
                    g["lr"] = lr_schedule(k)
        for i in range(m):
            opts[i].zero_grad()
            loss_at(models[i], i, k).backward()
            opts[i].step()
        n = k + 1
        with torch.no_grad():
            for f in range(fragments):  # landings first, then the boundaries
                if f in pending and pending[f][0] == n:
                    land(f)
            for f in range(fragments):
                if n >= starts[f] and (n - starts[f]) % tau == 0:
                    start(f, n)
                    if delay == 0:
                        land(f)
    return models, anchors
