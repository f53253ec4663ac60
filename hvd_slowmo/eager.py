"""Eager updates of the overlapped outer step (Kale et al. 2025, arXiv 2502.12996, over SlowMo,
arXiv 1910.00643): while a fragment's exact average is in flight, each worker continues from a
provisional slow step taken with an estimate of the average outer gradient. The estimate is a
strategy with one interface (:class:`EagerEstimate`): none (:class:`NoEager`), the paper's own
fresh share plus the other workers' previous shares (:class:`SharesEstimate`, ``"shares"``), or
the worker's own outer gradient alone (:class:`LocalEstimate`, ``"local"``). Each fragment owns
one, over its own slow state; the recurrences are in :mod:`hvd_slowmo.fragments`, the arithmetic in
:mod:`hvd_slowmo.slowmo`.
"""

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .comm.base import Communicator
from .config import SlowMoConfig
from .slow_state import SlowState
from .slowmo import eager_anchor_, eager_landed_, local_anchor_, local_gradient

__all__ = [
    "ESTIMATES",
    "EagerEstimate",
    "LocalEstimate",
    "NoEager",
    "SharesEstimate",
    "make_estimate",
]

#: A param group's slice of a fragment: its lr at the boundary and the positions (in the
#: fragment) of its parameters.
GroupSlice = tuple[float, list[int]]


class EagerEstimate:
    """The provisional slow step of one fragment, and what it keeps between outer steps.

    Args:
        config: the optimizer's configuration (``slow_lr``, ``slow_momentum``, Nesterov).
        comm: the workers (their number ``m`` scales the shares).
        slow_state: the fragment's slow state (its anchor and slow buffer are read).

    Attributes:
        kind: the normalised ``eager`` value (None, ``"shares"``, ``"local"``).
    """

    kind: ClassVar[str | None] = None

    def __init__(self, config: SlowMoConfig, comm: Communicator, slow_state: SlowState) -> None:
        self.config, self.comm, self.slow_state = config, comm, slow_state

    def _anchor(self) -> list[Tensor]:
        """The fragment's anchor (captured: an eager estimate needs the full layout)."""
        anchor = self.slow_state.anchor
        assert anchor is not None, "the anchor is captured at the first step"
        return anchor

    def provisional_(self, snapshot: list[Tensor], groups: Sequence[GroupSlice]) -> bool:
        """At the boundary: turn ``snapshot`` (``s_i``) into the provisional anchor ``x^0_i``.

        Args:
            snapshot: the fragment's parameters at the boundary, one per anchor tensor.
            groups: each param group's lr at the boundary and positions in the fragment (a
                group at lr <= 0 takes no provisional step).

        Returns:
            Whether ``snapshot`` changed (the worker then continues from it); by default no
            provisional step is taken.
        """
        return False

    def landed_(
        self,
        snapshot: list[Tensor],
        sent: list[Tensor],
        groups: Sequence[GroupSlice],
        spread: list[Tensor],
    ) -> None:
        """At the landing, before the slow step: update what is kept for the next boundary, and
        turn ``spread`` (``snapshot - avg`` on entry) into this worker's ``s_i - avg`` where the
        snapshot held the provisional anchor.

        Args:
            snapshot: the provisional anchor (or ``s_i`` where no provisional step was taken).
            sent: the exact average.
            groups: as for :meth:`provisional_`.
            spread: per tensor, changed in place.
        """
        return None  # nothing kept by default

    @property
    def shares(self) -> list[Tensor] | None:
        """``c_i`` per parameter of the fragment (:class:`SharesEstimate`), else None."""
        return None

    def reset(self) -> None:
        """Forget what is kept between outer steps (a restart, a skipped outer step)."""
        return None  # nothing kept by default

    def load(self, shares: list[Tensor] | None) -> None:
        """Install saved shares (checked by the caller), or none.

        Args:
            shares: ``c_i`` per parameter of the fragment, or None.
        """
        return None  # nothing kept by default

    def extend(self, new: list[Tensor]) -> None:
        """Parameters added to the fragment (``add_param_group``): their shares start at zero.

        Args:
            new: the new parameters.
        """
        return None  # nothing kept by default


class NoEager(EagerEstimate):
    """No eager update: the worker continues from its own snapshot."""


class ProvisionalEstimate(EagerEstimate, abc.ABC):
    """An estimate that takes a provisional slow step, one param group at a time.

    Args: as for :class:`EagerEstimate`.
    """

    def provisional_(self, snapshot: list[Tensor], groups: Sequence[GroupSlice]) -> bool:
        """At the boundary: turn ``snapshot`` (``s_i``) into the provisional anchor ``x^0_i``.

        Args:
            snapshot: the fragment's parameters at the boundary, one per anchor tensor.
            groups: each param group's lr at the boundary and positions in the fragment (a
                group at lr <= 0 takes no provisional step).

        Returns:
            True: the snapshot now holds the provisional anchor.
        """
        anchor, slow = self._anchor(), self.slow_state.slow_buffer
        for lr, pos in groups:
            if lr <= 0:  # no slow step at lr = 0 (the landing keeps the average)
                continue
            self._group_anchor_(
                [snapshot[k] for k in pos],
                [anchor[k] for k in pos],
                None if slow is None else [slow[k] for k in pos],
                pos,
                lr,
            )
        return True

    @abc.abstractmethod
    def _group_anchor_(
        self,
        snapshot: list[Tensor],
        anchor: list[Tensor],
        slow: list[Tensor] | None,
        pos: list[int],
        lr: float,
    ) -> None:
        """One param group's provisional anchor, in place of its ``snapshot`` slice.

        Args:
            snapshot: the group's snapshot tensors.
            anchor: the group's anchor tensors.
            slow: the group's slow buffers (None where beta = 0 keeps none).
            pos: the group's positions in the fragment.
            lr: the group's lr at the boundary (> 0).
        """


class SharesEstimate(ProvisionalEstimate):
    """The paper's estimate: ``G^_i = c_i + g_i / m``, ``c_i`` the other workers' shares of the
    previous outer step (zero before the first landing; one more copy of the fragment).

    Args: as for :class:`EagerEstimate`.
    """

    kind = "shares"

    def __init__(self, config: SlowMoConfig, comm: Communicator, slow_state: SlowState) -> None:
        super().__init__(config, comm, slow_state)
        self._shares: list[Tensor] | None = None

    @property
    def shares(self) -> list[Tensor] | None:
        return self._shares

    def provisional_(self, snapshot: list[Tensor], groups: Sequence[GroupSlice]) -> bool:
        if self._shares is None:  # no previous step: the others' shares are 0
            self._shares = [torch.zeros_like(a) for a in self._anchor()]
        return super().provisional_(snapshot, groups)

    def _group_anchor_(
        self,
        snapshot: list[Tensor],
        anchor: list[Tensor],
        slow: list[Tensor] | None,
        pos: list[int],
        lr: float,
    ) -> None:
        assert self._shares is not None  # set by provisional_
        cfg = self.config
        shares = [self._shares[k] for k in pos]
        eager_anchor_(
            snapshot, anchor, slow, shares, lr, cfg.slow_lr, cfg.slow_momentum, self.comm.size,
            nesterov=cfg.nesterov,
        )  # fmt: skip

    def landed_(
        self,
        snapshot: list[Tensor],
        sent: list[Tensor],
        groups: Sequence[GroupSlice],
        spread: list[Tensor],
    ) -> None:
        shares = self._shares
        if shares is None:  # no provisional step since the state was loaded or restarted
            return
        anchor = self._anchor()
        for lr, pos in groups:
            if lr <= 0:  # no provisional step was taken: the snapshot is s_i
                continue
            for k in pos:  # s_i - avg = (x0 - avg) + lr m c_i
                spread[k] = (anchor[k] - sent[k]).add_(shares[k], alpha=lr * self.comm.size)
            eager_landed_(
                [shares[k] for k in pos], [anchor[k] for k in pos], [sent[k] for k in pos], lr
            )

    def reset(self) -> None:
        self._shares = None

    def load(self, shares: list[Tensor] | None) -> None:
        self._shares = shares

    def extend(self, new: list[Tensor]) -> None:
        if self._shares is not None:
            self._shares.extend(torch.zeros_like(p) for p in new)


class LocalEstimate(ProvisionalEstimate):
    """``eager="local"``: the worker's own fresh outer gradient ``g_i`` stands in for ``G``;
    nothing is kept between outer steps."""

    kind = "local"

    def _group_anchor_(
        self,
        snapshot: list[Tensor],
        anchor: list[Tensor],
        slow: list[Tensor] | None,
        pos: list[int],
        lr: float,
    ) -> None:
        cfg = self.config
        local_anchor_(
            snapshot, anchor, slow, lr, cfg.slow_lr, cfg.slow_momentum, nesterov=cfg.nesterov
        )

    def landed_(
        self,
        snapshot: list[Tensor],
        sent: list[Tensor],
        groups: Sequence[GroupSlice],
        spread: list[Tensor],
    ) -> None:
        cfg, anchor, slow = self.config, self._anchor(), self.slow_state.slow_buffer
        for lr, pos in groups:
            if lr <= 0:  # no provisional step was taken: the snapshot is s_i
                continue
            for k in pos:  # s_i - avg = (x0 - avg) - lr g_i, lr g_i from the provisional anchor
                own = local_gradient(
                    snapshot[k], anchor[k], None if slow is None else slow[k], lr,
                    cfg.slow_lr, cfg.slow_momentum, cfg.nesterov,
                )  # fmt: skip
                spread[k] = (anchor[k] - sent[k]).sub_(own)


#: The estimates by their normalised ``eager`` value (:attr:`SlowMoConfig.estimate`).
ESTIMATES: dict[str | None, type[EagerEstimate]] = {
    None: NoEager,
    "shares": SharesEstimate,
    "local": LocalEstimate,
}


def make_estimate(config: SlowMoConfig, comm: Communicator, slow_state: SlowState) -> EagerEstimate:
    """The estimate ``config.estimate`` names, for the fragment of ``slow_state``.

    Args:
        config: the optimizer's configuration.
        comm: the workers.
        slow_state: the fragment's slow state.
    """
    return ESTIMATES[config.estimate](config, comm, slow_state)


def check_shares(saved: Any, params: Sequence[Tensor], estimate: str | None) -> list[Tensor] | None:
    """Saved eager shares (``"eager_shares"``: ``{param index: tensor}``), checked against this
    model and copied onto its parameters' devices and dtypes; changes nothing.

    Args:
        saved: the saved entry (None: none yet, not eager, or a state written before they
            existed; the estimate then starts from zero shares).
        params: every parameter, in the optimizer's order.
        estimate: the running ``eager`` estimate (only ``"shares"`` keeps any).

    Raises:
        ValueError: they do not match this model.
    """
    if saved is None or estimate != "shares":
        return None
    if (
        not isinstance(saved, dict)
        or set(saved) != set(range(len(params)))
        or any(
            not isinstance(saved[i], Tensor) or saved[i].shape != p.shape
            for i, p in enumerate(params)
        )
    ):
        raise ValueError("load_state_dict: 'eager_shares' does not match this model")
    return [saved[i].detach().to(p.device, p.dtype).clone() for i, p in enumerate(params)]
