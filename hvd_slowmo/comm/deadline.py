"""The collective deadline: how long a wait for a collective lasts before it fails.

A peer that freezes inside a collective (a stopped process, a dead link that no socket notices,
an MPI job with a hung rank) would otherwise hold every other rank in its wait forever. The
thread and MPI transports wait with this deadline and then raise :class:`CollectiveTimeout`,
naming the rank, the collective and what to do (docs/timeouts.md). The deadline comes from the
transport's ``timeout`` argument, else from the ``HVD_SLOWMO_COLLECTIVE_TIMEOUT`` environment
variable (seconds; unset, empty or ``none``: no deadline).

SlowMo: arXiv 1910.00643.
"""

import os
import time
from collections.abc import Callable

from ..validation import check_number

__all__ = ["ENV", "CollectiveTimeout", "collective_timeout", "timeout_message", "wait_until"]

#: The environment variable that sets the default deadline, in seconds.
ENV = "HVD_SLOWMO_COLLECTIVE_TIMEOUT"
#: The ``timeout`` value that means "read the environment variable".
FROM_ENV = "env"


class CollectiveTimeout(TimeoutError):
    """A collective did not complete within the deadline (a peer died, froze or runs other
    collectives). A ``TimeoutError``, so code that catches that catches this."""


def collective_timeout(timeout: float | str | None = FROM_ENV) -> float | None:
    """The deadline in seconds (None: wait forever), checked.

    Args:
        timeout: seconds (> 0), None for no deadline, or ``"env"`` to read
            ``HVD_SLOWMO_COLLECTIVE_TIMEOUT`` (unset, empty or ``"none"``: no deadline).

    Raises:
        ValueError: a deadline that is not a positive number, named with where it came from.
    """
    if timeout is None:
        return None
    if isinstance(timeout, str) and timeout == FROM_ENV:
        raw = os.environ.get(ENV, "").strip()
        if raw.lower() in ("", "none"):
            return None
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(
                f"{ENV} must be a number of seconds (or 'none'), got {raw!r}; e.g. {ENV}=600"
            ) from None
        return check_number(ENV, value, low=0.0, low_open=True, fix=f"e.g. {ENV}=600")
    return check_number(
        "timeout", timeout, low=0.0, low_open=True, fix="seconds, e.g. timeout=600, or None"
    )


def wait_until(
    done: Callable[[], bool], timeout: float | None, describe: Callable[[], str]
) -> None:
    """Poll ``done()`` until it is True; past ``timeout`` seconds raise :class:`CollectiveTimeout`.

    The polling backs off from 20 us to 5 ms, so a short collective costs little latency and a
    long one little CPU (``done()`` may drive the transport's progress, as ``MPI_Test`` does).

    Args:
        done: never blocks; True once the collective is complete.
        timeout: seconds, or None to poll forever.
        describe: the error message (called only on a timeout), which names the rank and the
            collective.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.0
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            raise CollectiveTimeout(describe())
        time.sleep(delay)
        delay = min(max(2 * delay, 2e-5), 5e-3)


def timeout_message(rank: int, what: str, timeout: float, missing: str = "") -> str:
    """The text of a :class:`CollectiveTimeout`: who waited, for what, how long, what to do.

    Args:
        rank: the waiting rank.
        what: the collective, e.g. ``"average 'grads.0' (collective #12)"``.
        timeout: the deadline that passed, in seconds.
        missing: what is known about the missing peers (e.g. ``"rank(s) [1] never started it"``).
    """
    why = f": {missing}" if missing else ""
    return (
        f"hvd_slowmo: rank {rank} waited {timeout:g} s for {what} without it completing{why}. "
        "A peer has died, frozen, or runs different collectives (check every rank's log); "
        f"end the job (os._exit(1) or MPI.COMM_WORLD.Abort(1)). If the peers are only slow, "
        f"raise the deadline ({ENV} or the communicator's timeout=)."
    )
