"""Write the format-3 saved states of tests/data/state_v3/ (run once, on the version that wrote
format 3: hvd_slowmo at 7a39860, before each fragment owned its outer state).

For each case of :data:`CASES`, three thread workers train the tiny reference model
(tests/reference.py) ``stop`` steps and save ``{"model", "opt"}`` (``{case}-rank{r}.pt``, the
bytes ``torch.save`` wrote); then fresh workers load those files and train on to step 17 with
the same version, and each rank's model state at step 17 is recorded
(``{case}-continued.pt``): the continuation the old code computed from the saved state.

Usage (from the repository root)::

    PYTHONPATH=$PWD:$PWD/tests python tests/data/make_state_v3.py
"""

import io
import os
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the harness

from helpers import resume_in_fresh_workers, save_states  # noqa: E402
from helpers import train_steps as train  # noqa: E402
from streaming_harness import build  # noqa: E402

#: The workers, and the step every continuation trains to.
WORKERS, STEPS = 3, 17


def outer_sgd(params):
    """The custom outer optimizer of the ``outer-sgd`` case."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.6)


#: case -> (settings over ``streaming_harness.build``: tau=6, slow_momentum=0.6; the step
#: to save at). Each saves inside a period; those with overlap have a fragment in flight.
CASES = {
    "p1-d0": (dict(), 8),
    "p3-d2-local": (dict(overlap=2, fragments=3, eager="local"), 11),
    "eager-p2-d3": (dict(overlap=3, fragments=2, eager="shares"), 10),
    "int8-feedback-p2-d3": (
        dict(overlap=3, fragments=2, codec="int8", error_feedback=True),
        10,
    ),
    "sharded-p2-d1": (dict(shard_slow_state=True, fragments=2, overlap=1), 9),
    "outer-sgd-p2-d1": (dict(outer_optimizer=outer_sgd, fragments=2, overlap=1), 9),
}


def path(case: str, rank: int | None = None) -> str:
    """The file of ``case``'s saved state on ``rank`` (None: its recorded continuation)."""
    name = f"{case}-continued.pt" if rank is None else f"{case}-rank{rank}.pt"
    return os.path.join(HERE, "state_v3", name)


def main() -> None:  # pragma: no cover - run once, on the version that wrote format 3
    os.makedirs(os.path.join(HERE, "state_v3"), exist_ok=True)
    torch.set_num_threads(1)
    for case, (kwargs, stop) in CASES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            states = save_states(WORKERS, build(**kwargs), train, stop)
            assert torch.load(io.BytesIO(states[0]), weights_only=False)["opt"]["format"] == 3
            continued = resume_in_fresh_workers(
                WORKERS, build(**kwargs), train, stop, STEPS, saved=states
            )
        for rank, state in enumerate(states):
            with open(path(case, rank), "wb") as f:
                f.write(state)
        torch.save([m.state_dict() for m in continued], path(case))
        print(case, [len(s) for s in states])


if __name__ == "__main__":
    main()
