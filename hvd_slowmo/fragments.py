"""Streaming SlowMo: the split of the parameters into ``P`` fragments and their schedule.

Pure functions of the parameters' names and the settings: no tensors, no communication, the
same answer on every rank (the names are compared across ranks at construction). The outer
step that uses them is :class:`hvd_slowmo.fragment.Fragment` (one object per fragment).

**Split** (Douillard et al. 2025, "Streaming DiLoCo", arXiv 2501.18512, strided pattern): the
parameters are grouped into *layers* (a parameter's name up to its last ``.``: ``"3.weight"``
and ``"3.bias"`` are layer ``"3"``; an unnamed parameter ``"param7"`` is a layer of its own),
layers numbered in the order of their first parameter in the optimizer, and layer ``l`` goes
to fragment ``l mod P``. Every fragment so holds layers from the whole depth of the model (the
paper found this better than consecutive blocks); sizes are balanced only as far as layers
are alike (the transformer blocks of the paper are; an embedding is not).

**Schedule**: fragment ``k`` (``0 <= k < P``) has its boundary at inner step
``b_k = (k + 1) tau // P`` of each tau period, i.e. at the global steps ``n`` with
``n = b_k (mod tau)``, ``n >= b_k``. ``b_{P-1} = tau``: the last fragment's boundary is the
outer-step boundary of ``fragments=1``, so ``P = 1`` is today's schedule. ``P <= tau`` keeps the
boundaries distinct (consecutive ones are at least ``tau // P`` steps apart). Every
pseudo-gradient of a fragment covers exactly ``tau`` base steps, except its first (``b_k``).
Fragment ``k``'s average is in flight for ``d`` steps (``overlap=d``) and lands at
``b_k + d``. With ``P > 1``, ``d <= tau // P`` (the shortest phase): the landing comes by the
next fragment's boundary, so one fragment is in flight at a time (the overlap copies, snapshot
and tensors in flight, are of one fragment, ``1/P`` of the model, and no two collectives of one
name are ever in flight). The recurrences would allow more (fragments are disjoint, and
``d < tau`` keeps each fragment's landing before its own next boundary), at the cost of more
copies in flight. At a step where one fragment lands and the next starts, the landing comes
first. Model buffers (BatchNorm statistics) travel with the last fragment, at the period's end.

**Compressed exchange** (``codec=<name>``, :class:`hvd_slowmo.exchange.CompressedExchange`): a
fragment's ``avg`` below is ``x0 - mean_c(x0 - s_i)`` over its own parameters and anchor tensors,
``mean_c`` the compressed mean; each fragment's exchange keeps the error-feedback residual of its
own parameters, which its next average adds.

**Recurrences.** ``m`` workers; ``x_i`` worker ``i``'s parameters; for a fragment, ``x0`` and
``u`` its anchor and slow buffer (the fragment's own slow state);
``gamma`` each param group's lr at the fragment's boundary. At the fragment's boundary ``n``::

    s_i   = x_i(n)                           snapshot; avg = mean_i s_i starts in flight
    g_i   = (x0 - s_i) / gamma               this worker's outer gradient (pseudo-gradient)
    G     = (x0 - avg) / gamma = mean_i g_i  the exact one, known at the landing

Overlapped, not eager (``overlap=d``, as :mod:`hvd_slowmo.fragment`): worker ``i`` goes on
from ``s_i``; at ``n + d``::

    u   <- beta u + G ;   x0 <- x0 - alpha gamma u        (Nesterov: x0 - alpha gamma (G + beta u))
    x_i <- x0 + (x_i - s_i)                              keeps its progress since the boundary

Eager (``eager="shares"``; Kale et al. 2025, "Eager updates for overlapped communication and
computation in DiLoCo", arXiv 2502.12996): at the boundary the worker estimates ``G`` with its
own fresh share and the other workers' shares of the previous outer step (``c_i``, zero
before the first landing), and takes a provisional slow step from it::

    G^_i  = c_i + g_i / m                    estimate of G: own share fresh, the others' stale
    u^_i  = beta u + G^_i ;  x^0_i = x0 - alpha gamma u^_i   (Nesterov: G^_i + beta u^_i)
    x_i  <- x^0_i                            the d steps start from the provisional anchor
    c_i  <- -g_i / m

and at ``n + d`` the exact slow step replaces the provisional one::

    c_i <- c_i + G                           = (1/m) sum_{j != i} g_j, for the next boundary
    u   <- beta u + G ;   x0 <- x0 - alpha gamma u        (the same slow step as not eager)
    x_i <- x0 + (x_i - x^0_i)                keeps its progress since the provisional anchor

``eager="local"``: the worker's own fresh outer gradient alone stands in for ``G`` (no stale
shares, nothing kept between outer steps, no ``c_i``)::

    G^_i  = g_i ;  u^_i = beta u + g_i ;  x^0_i = x0 - alpha gamma u^_i  (Nesterov: g_i + beta u^_i)
    x_i  <- x^0_i ;  at n + d: the same exact slow step, x_i <- x0 + (x_i - x^0_i)

What the slow buffer sees: the exact ``G`` of every outer step, eager or not (``u`` and ``x0``
follow the non-eager recurrence on the snapshots of the eager run: the estimate only moves
where the ``d`` in-flight steps start). This is where the paper's variant differs: there the
outer optimizer steps with the estimate itself and the replicas' outer states differ for
good; here they are corrected at each landing. How far replicas differ: as in any local
method, ``x_i`` differ between averages; the provisional anchors differ by
``x^0_i - x^0_j = -alpha gamma (1 [+ beta]) (G^_i - G^_j)`` (with ``"local"``,
``G^_i - G^_j = g_i - g_j``). After each landing ``x0`` and
``u`` are bitwise identical on every worker (one exact average, the same arithmetic), as
without eager; ``x_i`` again equal ``x0`` bitwise only where they have no progress of their
own (``d = 0``, or AR-SGD, whose workers are identical throughout). ``c_i`` is per worker
(one more copy of the parameters, kept across outer steps; none with ``"local"``). With
``alpha = 1, beta = 0``, ``m = 1`` (``"local"``: any ``m``): ``x^0 = s`` (to rounding), eager
changes nothing.

**Mixing factor** (``mix``; Streaming DiLoCo's alpha, arXiv 2501.18512, there ``x_i <- alpha
x_i + (1 - alpha) x0``, which drops ``1 - alpha`` of the progress made while the average was in
flight): here the landed value is the one above, which keeps that progress, and the worker's
fragment is mixed with it. With ``b_i`` the tensor the worker continued from (``s_i``, or
``x^0_i`` with eager updates)::

    x_i <- mix x_i + (1 - mix) (x0 + (x_i - b_i))  =  x0 + (x_i - b_i) + mix (b_i - x0)

so the progress since ``b_i`` is kept whole, and a fraction ``mix`` of the worker's own
difference from the new anchor at the boundary survives the landing (the paper's alpha mixes
both). ``x0`` and ``u`` are untouched (bitwise identical on every worker); the model buffers, and
the base optimizer's with ``buffers="average"``, mix the same way with their average in place of
``x0``. ``mix = 0`` is the landing above, bit for bit; ``d = 0`` has no landing to mix
(refused).

``P = 1`` is the whole model: the recurrences above with one fragment are today's
``overlap=d`` (and with ``d = 0`` the paper's Algorithm 1), bit for bit. Not implemented: the
eager paper's uncorrected outer state.
"""

from collections.abc import Sequence
from typing import Any

__all__ = ["boundaries", "fragment_of", "layer_of", "resolve_fragments"]

#: ``fragments=[["layers.0", "layers.1"], ["layers.2", "output"]]``: each fragment's modules.
ModuleSplit = tuple[tuple[str, ...], ...]


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its name up to the last ``.`` (the whole name if
    there is none).

    Args:
        name: the parameter's name, as in ``model.named_parameters()``.
    """
    return name.rsplit(".", 1)[0]


def resolve_fragments(fragments: Any) -> tuple[int, ModuleSplit | None]:
    """``(P, modules)`` of ``DistributedOptimizer(fragments=...)``: an int is the strided split
    into ``P`` fragments; a list of lists of module names (torchtitan's
    ``module_fqns_per_model_fragment``) names each fragment's modules.

    Args:
        fragments: an int, or a non-empty list of non-empty lists of module names.

    Raises:
        TypeError: neither form.
    """
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        return fragments, None
    ok = (
        isinstance(fragments, (list, tuple))
        and len(fragments) > 0
        and all(
            isinstance(f, (list, tuple)) and f and all(isinstance(m, str) for m in f)
            for f in fragments
        )
    )
    if not ok:
        raise TypeError(
            f"fragments must be an int (the strided split into that many fragments) or a list "
            f"of lists of module names, one list per fragment, e.g. [['layers.0', 'layers.1'], "
            f"['layers.2', 'output']]; got {fragments!r}"
        )
    return len(fragments), tuple(tuple(f) for f in fragments)


def _owners(modules: ModuleSplit) -> dict[str, int]:
    """Each named module's fragment; a module named in two fragments is refused."""
    owner: dict[str, int] = {}
    for k, mods in enumerate(modules):
        for mod in mods:
            if owner.setdefault(mod, k) != k:
                raise ValueError(
                    f"fragments names module {mod!r} in fragments {owner[mod]} and {k}; name each "
                    "module in one fragment"
                )
    return owner


def _named_split(names: Sequence[str], modules: ModuleSplit) -> list[int]:
    """Each parameter's fragment from the fragments' module names (a parameter belongs to a
    module when its name is the module's name followed by ``.``)."""
    owner = _owners(modules)
    out, used, missing = [], set(), []
    for name in names:
        inside = [m for m in owner if name == m or name.startswith(m + ".")]
        used.update(inside)
        hits = sorted({owner[m] for m in inside})
        if len(hits) > 1:
            raise ValueError(
                f"fragments: parameter {name!r} is inside modules of fragments {hits} (one module "
                "contains another); name disjoint modules"
            )
        if not hits:
            missing.append(name)
        out.append(hits[0] if hits else -1)
    unknown = sorted(set(owner) - used)
    if unknown:
        layers = list(dict.fromkeys(layer_of(n) for n in names))
        raise ValueError(
            f"fragments names modules that hold no parameter of this optimizer: {unknown}; the "
            f"model's modules with parameters are {layers[:8]}{'...' if len(layers) > 8 else ''} "
            "(names as in model.named_parameters())"
        )
    if missing:
        raise ValueError(
            f"fragments leaves parameters {missing[:5]}{'...' if len(missing) > 5 else ''} in no "
            "fragment; add their modules to one of the lists"
        )
    return out


def fragment_of(
    names: Sequence[str], fragments: int, modules: ModuleSplit | None = None
) -> list[int]:
    """Each parameter's fragment: layers numbered by first appearance, layer ``l`` in fragment
    ``l mod fragments`` (strided, so each fragment spans the model's depth); or, with
    ``modules``, the fragment whose modules hold it.

    Args:
        names: the parameters' names, in the optimizer's order (the same on every rank).
        fragments: ``P``, the number of fragments (1 <= P <= the number of layers).
        modules: each fragment's module names (:func:`resolve_fragments`), or None.

    Returns:
        The fragment index of each parameter, in ``names``' order.

    Raises:
        TypeError: ``fragments`` is not an int.
        ValueError: ``fragments`` < 1, or more fragments than layers (a fragment would be empty);
            with ``modules``: a module named twice or holding no parameter, nested modules in
            two fragments, a parameter in no fragment.
    """
    if modules is not None:
        return _named_split(names, modules)
    if isinstance(fragments, bool) or not isinstance(fragments, int):
        raise TypeError(f"fragments must be an int, got {type(fragments).__name__}")
    layers: dict[str, int] = {}
    for name in names:
        layers.setdefault(layer_of(name), len(layers))
    if not 1 <= fragments <= max(len(layers), 1):
        raise ValueError(
            f"fragments must be between 1 and the model's number of layers ({len(layers)}: "
            f"parameters grouped by name up to the last '.'), got fragments={fragments}; "
            "e.g. fragments=1 (the whole model at once)"
        )
    return [layers[layer_of(name)] % fragments for name in names]


def boundaries(tau: int, fragments: int) -> list[int]:
    """The inner step (1..tau) at which each fragment's outer step starts: ``(k + 1) tau // P``.

    Args:
        tau: base steps per period.
        fragments: ``P`` (1 <= P <= tau).
    """
    if not 1 <= fragments <= tau:
        raise ValueError(
            f"fragments must be between 1 and tau={tau} (each fragment needs its own inner "
            f"step of the period), got fragments={fragments}"
        )
    return [(k + 1) * tau // fragments for k in range(fragments)]
