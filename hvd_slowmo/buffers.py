"""What happens to the base optimizer's buffers at each outer step (Algorithm 1, line 2).

``reset`` returns them to a freshly constructed optimizer's state (momentum and Adam moments
start again, and so does Adam's bias-correction step count); ``maintain`` keeps each worker's
own; ``average`` replaces each per-element buffer with its exact average over workers
(the double-averaging scheme of Yu et al. 2019 when used with Local SGD).
"""

from collections.abc import Iterable

from torch import Tensor

from .islands import local

__all__ = ["BUFFER_STRATEGIES", "reset_buffers", "averageable_buffers"]

BUFFER_STRATEGIES = ("reset", "maintain", "average")


def reset_buffers(state: dict[Tensor, dict], params: Iterable[Tensor]) -> None:
    """Drop the optimizer state of ``params`` so the next step re-creates it as at construction.

    Args:
        state: the wrapped optimizer's ``state`` mapping (shared, modified in place).
        params: the parameters whose state is dropped.
    """
    for p in params:
        state.pop(p, None)


def averageable_buffers(state: dict[Tensor, dict], params: Iterable[Tensor]) -> list[Tensor]:
    """The per-element floating-point buffers of ``params``' optimizer state, in a stable order.

    Only tensors shaped like their parameter are per-element buffers (momentum, Adam moments);
    scalars such as Adam's ``step`` are counts, identical on every worker, and are never averaged.

    Args:
        state: the wrapped optimizer's ``state`` mapping.
        params: the parameters (the state's keys), in the order used on every rank.

    Returns:
        The buffers' local tensors (a sharded parameter's buffers are sharded like it).
    """
    out: list[Tensor] = []
    for p in params:
        entry = state.get(p)
        if not entry:
            continue
        for key in sorted(entry):
            value = entry[key]
            if isinstance(value, Tensor) and value.is_floating_point() and value.shape == p.shape:
                out.append(local(value))
    return out
