"""Worker for tests/test_torchrun_elastic.py: training under torchrun's elastic rendezvous
(c10d, ``--nnodes=1:2``) that survives losing a node and goes on with fewer workers.

Usage: torchrun_elastic_worker.py OUT_DIR KILL_AT
  Each rank saves its full state with the atomic save after every step, as
  OUT_DIR/ckpt.RANK.STEP.pt. At start, the group resumes from the last step that every rank of
  the run that wrote the checkpoints has (their world size is in the state); a rank loads its
  own checkpoint, or rank 0's if it has none. In the first attempt, node 1's worker kills its
  torchrun agent and itself before step KILL_AT (a lost machine). The other agent's worker then
  fails, the rendezvous closes again with one node, and its new worker resumes at world size 1:
  hvd_slowmo's restart rule (every fragment back to its anchor, an average in flight dropped).
  Rank 0 writes OUT_DIR/resume.ATTEMPT.json (the step it resumed at, ``num_steps`` after the
  load, the world size, the parameters after the load) and OUT_DIR/final.json at the end.
"""

import datetime
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import hvd_slowmo
from hvd_slowmo.checkpoint import load_checkpoint, save_checkpoint

from helpers import end_process
from reference import loss_at

STEPS = 14
OPTIONS = {"tau": 4, "fragments": 2, "overlap": 1, "compression": "int8", "error_feedback": True}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))


def last_complete_step(out: str) -> tuple[int, int]:
    """(the last step every rank of the saving run has a checkpoint of, that run's world size);
    (0, 0) without checkpoints. The save is atomic: a file is complete or absent."""
    have: dict[int, set[int]] = {}
    for name in os.listdir(out):
        p = name.split(".")
        if len(p) == 4 and p[0] == "ckpt" and p[3] == "pt":
            have.setdefault(int(p[1]), set()).add(int(p[2]))
    if not have:
        return 0, 0
    anyone = next(iter(have))
    size = load_checkpoint(os.path.join(out, f"ckpt.{anyone}.{max(have[anyone])}.pt"))["size"]
    common = set.intersection(*(have.get(r, set()) for r in range(size)))
    return max(common or {0}), size


def main() -> None:
    out, kill_at = sys.argv[1], int(sys.argv[2])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A prefix per attempt: torchrun keeps its store across restarts (docs/reliability.md).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=False)  # fmt: skip
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store),
                            rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    model = make_model()
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        **{"slow_momentum": 0.5, **OPTIONS},
    )
    start, saved_size = last_complete_step(out)
    dist.barrier()  # every rank chose its start before anyone writes a new checkpoint
    if start:
        mine = rank if rank < saved_size else 0
        state = load_checkpoint(os.path.join(out, f"ckpt.{mine}.{start}.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        if rank == 0:
            params = [p.detach().flatten().tolist() for p in model.parameters()]
            info = {"step": start, "num_steps": opt.num_steps, "size": size,
                    "saved_size": saved_size, "params": params}  # fmt: skip
            with open(os.path.join(out, f"resume.{attempt}.json"), "w") as f:
                json.dump(info, f)
    lost = attempt == "0" and os.environ.get("GROUP_RANK") == "1"
    for k in range(opt.num_steps, STEPS):
        if k == kill_at and lost:
            os.kill(os.getppid(), signal.SIGKILL)  # the node's agent ...
            os.kill(os.getpid(), signal.SIGKILL)  # ... and its worker: the machine is gone
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "size": size}
        save_checkpoint(state, os.path.join(out, f"ckpt.{rank}.{k + 1}.pt"))
    opt.flush()
    if rank == 0:
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        final = {"num_steps": opt.num_steps, "size": size, "attempt": attempt, "finite": finite}
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump(final, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process()
