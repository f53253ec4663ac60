"""Worker of the fault matrix (tests/test_fault_matrix.py): two ranks train the tiny reference
model with one configuration, rank 1 suffers one fault (tests/fault_injection.py), rank 0
saves an atomic checkpoint every 4 steps.

Usage: matrix_worker.py OUT_DIR ENGINE CONFIG FAULT
  ENGINE: horovod (under horovodrun, Gloo or MPI) or torchdist (under torchrun, Gloo).
  CONFIG: plain | overlap2 | frag4 | int8 | samples | seconds | quorum (see CONFIGS; each has
          the phase it is faulted in). samples and seconds (issue 37) report unequal samples per
          step (2 + rank); seconds and quorum run OUTER outer steps (of unequal step counts;
          under the quorum a late rank skips outer steps) and save after each; quorum
          (straggler=Quorum(1)) ends with opt.finish(), where rank 0 settles with a late rank.
  FAULT:  kill | freeze | raise | late_join | link_down | slow.
In an emulated host (``slowmo_lab.netns``, the link_down cells) there is no launcher: Horovod's
variables come from the namespace's worker environment, and torch.distributed takes its rank and
world size from them.
Each rank writes OUT_DIR/result.RANK.json: {"error": type or None, "message": str with the
notes, "num_steps", "anchor": the anchor's values}; rank 1 writes OUT_DIR/fault.json when the
fault fires. A rank that caught an error ends with os._exit(1) (a collective may still be in
flight underneath: a normal exit could wait for the dead or frozen peer).
"""

import datetime
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo
from hvd_slowmo.checkpoint import save_checkpoint

from fault_injection import Fault
from helpers import anchor_of
from reference import loss_at

STEPS = 16
FAULT_STEP = 5
FAULTY = 1
#: options and the phase in which the fault is injected
CONFIGS = {
    "plain": ({"tau": 4}, "before_start"),
    "overlap2": ({"tau": 4, "overlap": 2}, "in_flight"),
    "frag4": ({"tau": 8, "fragments": 4, "overlap": 1, "eager": "local"}, "landing"),
    "int8": ({"tau": 4, "compression": "int8", "error_feedback": True}, "compressed"),
    "samples": ({"tau": 4, "merge": "samples"}, "before_start"),
    # A step of the tiny model takes about a millisecond: 0.2 s periods hold a hundred or more,
    # and the slowed rank (0.05 s per step) a few.
    "seconds": ({"tau": 4, "period_seconds": "200ms"}, "before_start"),
    # Two ranks, a quorum of one: rank 0 goes on alone while rank 1 is late or gone.
    "quorum": ({"tau": 4, "straggler": hvd_slowmo.Quorum(1, grace=0.5)}, "before_start"),
}
OUTER = STEPS // 4  # outer steps of every configuration (tau 4; the first period of "seconds")
TIMEOUT = float(os.environ.get("FAULT_MATRIX_ENGINE_TIMEOUT", "10"))


def make_model() -> nn.Module:
    """Four layers (fragments=4 needs one per fragment), seeded: the same on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(),
                         nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))  # fmt: skip


def init(engine: str, delay: float) -> tuple[int, int]:
    time.sleep(delay)  # a late joiner: the others wait in the rendezvous
    if engine == "horovod":
        import horovod.torch as hvd

        hvd.init()
        return hvd.rank(), hvd.size()
    import torch.distributed as dist

    if "RANK" not in os.environ:  # an emulated host: no torchrun, the cluster's variables
        os.environ["RANK"], os.environ["WORLD_SIZE"] = (
            os.environ["HOROVOD_RANK"], os.environ["HOROVOD_SIZE"])  # fmt: skip
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    return dist.get_rank(), dist.get_world_size()


def train(out: str, rank: int, config: str, fault: Fault, communicator: Any = None) -> dict:
    """Train one rank; returns its steps and anchor.

    Args:
        out: the folder of the checkpoints.
        rank: this rank.
        config: a key of :data:`CONFIGS`.
        fault: the fault (armed on rank :data:`FAULTY`).
        communicator: the optimizer's communicator (thread workers: their own; None: the
            launcher's engine).
    """
    options, _ = CONFIGS[config]
    model = make_model()
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        **{"slow_momentum": 0.5, **options},
        **({} if communicator is None else {"communicator": communicator}),
    )
    fault.arm(opt, rank, FAULTY)
    samples = float(2 + rank) if config in ("samples", "seconds") else None
    timed = config in ("seconds", "quorum")
    k = 0
    # STEPS steps saved every 4 (one outer period of tau 4); under period_seconds the ranks take
    # unequal step counts: OUTER outer steps, saved after each (all ranks end each together).
    while opt.outer_steps < OUTER if timed else k < STEPS:
        fault.before_step(opt)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        before = opt.outer_steps
        opt.step(samples=samples)
        k += 1
        if opt.outer_steps > before if timed else k % 4 == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}  # collective
            if rank == 0:
                save_checkpoint(state, os.path.join(out, "ckpt.pt"))
    opt.flush()
    if config == "quorum":
        opt.finish()  # rank 0 waits for a late rank's last message, up to the deadline
    return {"num_steps": opt.num_steps, "anchor": [a.tolist() for a in anchor_of(opt)]}


def main() -> None:
    out, engine, config, action = sys.argv[1:5]
    fault = Fault(action, step=FAULT_STEP, phase=CONFIGS[config][1],
                  record=os.path.join(out, "fault.json"))  # fmt: skip
    env_rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")))
    rank, _ = init(engine, fault.join_delay(env_rank, FAULTY))
    result: dict = {"error": None, "message": ""}
    try:
        result.update(train(out, rank, config, fault))
    except Exception as e:  # every fault surfaces as some exception type: record it
        result = {"error": type(e).__name__,
                  "message": "\n".join([str(e), *getattr(e, "__notes__", [])])}  # fmt: skip
    result["t"] = time.time()
    with open(os.path.join(out, f"result.{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    if result["error"] is not None:
        os._exit(1)


if __name__ == "__main__":
    main()
