"""Checkpoint files that are written atomically and fail to load with an error naming the file.

``torch.save`` straight to the final path leaves a truncated file when the job dies while
saving (a lost node, a full disk, a preemption); ``torch.load`` then fails with messages such
as "PytorchStreamReader failed reading zip archive: failed finding central directory" that
name neither the file nor what to do. :func:`save_checkpoint` writes to a temporary file in the
same directory, flushes it to disk, and renames it over the target (atomic on POSIX), so a
reader sees the old checkpoint or the new one, never half of one. :func:`load_checkpoint`
turns every read failure into a :class:`CheckpointError` naming the file and its size.

Paper: arXiv 1910.00643 (SlowMo); the optimizer's state layout is
:meth:`hvd_slowmo.DistributedOptimizer.state_dict`.
"""

import os
import tempfile
from typing import Any, Union

import torch

from .optimizer import DistributedOptimizer

__all__ = ["CheckpointError", "broadcast_optimizer_state", "load_checkpoint", "save_checkpoint"]

PathLike = Union[str, "os.PathLike[str]"]


class CheckpointError(ValueError):
    """A checkpoint file that exists but cannot be read (truncated, corrupted, not a checkpoint)."""


def save_checkpoint(obj: Any, path: PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically: the file is complete or untouched.

    Args:
        obj: what to save, e.g. ``{"model": model.state_dict(), "opt": opt.state_dict()}``
            (with gossip bases, ``opt.state_dict()`` first finishes messages in flight:
            call it on every rank, then save on one).
        path: the checkpoint file; its directory must exist.

    Raises:
        FileNotFoundError: the directory of ``path`` does not exist.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            f"save_checkpoint: directory {directory!r} of {path!r} does not exist; create it first"
        )
    # The temporary file lives in the target's directory so that os.replace is a rename on one
    # file system (atomic), not a copy.
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """``torch.load(path)`` with errors that name the file and the fix.

    Args:
        path: the checkpoint file.
        map_location: as in ``torch.load`` (default: every tensor on the CPU; move the model
            to its device after loading).
        weights_only: as in ``torch.load``; the optimizer's and model's state dicts load with
            True (no arbitrary code runs on load). Pass False for checkpoints holding other objects.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: the file is empty, truncated, corrupted, or not a torch checkpoint.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint file {path!r}")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(
            f"checkpoint file {path!r} is empty (0 bytes): the job that wrote it probably "
            "died while saving; use an earlier checkpoint (save with hvd_slowmo.save_checkpoint, "
            "which never leaves a partial file)"
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except (
        Exception
    ) as e:  # torch.load raises RuntimeError, EOFError, UnpicklingError, ... by format
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        hint = (
            " If it is intact but holds objects other than tensors and plain containers (the "
            "weights-only unpickler refused it) and you trust it, pass weights_only=False."
            if weights_only and "weights_only" in str(e).lower()
            else ""
        )
        raise CheckpointError(
            f"checkpoint file {path!r} ({size} bytes) cannot be read: it is truncated, corrupted "
            f"or not a torch checkpoint ({type(e).__name__}: {first}). Use an earlier checkpoint; "
            "hvd_slowmo.save_checkpoint writes atomically, so a job that dies while saving keeps "
            "the previous file intact." + hint
        ) from e


def broadcast_optimizer_state(optimizer: DistributedOptimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s full optimizer state (see
    :meth:`DistributedOptimizer.broadcast_state`). Collective.

    Args:
        optimizer: the optimizer on this rank.
        root_rank: the rank whose state is sent.
    """
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError(
            "broadcast_optimizer_state expects a hvd_slowmo.DistributedOptimizer; "
            "use hvd.broadcast_optimizer_state for plain optimizers"
        )
    optimizer.broadcast_state(root_rank)
