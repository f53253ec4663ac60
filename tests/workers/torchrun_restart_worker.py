"""Worker for tests/test_torchrun_restart.py: training that survives ``torchrun --max-restarts``.

Usage: torchrun_restart_worker.py OUT_DIR KILL_AT CONFIG [ENGINE [KILL_RANK]]
  Each rank saves its full state (model, DistributedOptimizer: anchor, slow buffer, outer step in
  flight, error-feedback residuals, counters) with the atomic save after every step, as
  OUT_DIR/ckpt.RANK.STEP.pt. At start, the group resumes from the last step that every rank has
  a checkpoint of (the files are complete or absent: the save is atomic). With KILL_AT >= 0,
  rank 1 SIGKILLs itself once, before step KILL_AT (a marker file makes it happen once); torchrun
  then restarts the whole group. Rank 0 writes OUT_DIR/final.pt (the parameters) at the end.
  CONFIG: "frag2-int8-d1" (fragments=2, int8 with error feedback, overlap=1) or "plain".
  ENGINE: torchdist (default; under torchrun) or horovod (under horovodrun, restarted by
  scripts/chaos.py); KILL_RANK: the rank that dies (default 1).
"""

import datetime
import faulthandler
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
CONFIGS = {
    "frag2-int8-d1": {
        "tau": 4, "fragments": 2, "overlap": 1, "compression": "int8", "error_feedback": True,
    },
    "plain": {"tau": 4},
}  # fmt: skip


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 2))


def last_common_step(out: str, size: int) -> int:
    """The last step every rank has a checkpoint of (0: none)."""
    steps = None
    for r in range(size):
        # ckpt.R.S.pt only: a rank killed inside a save leaves its temporary file
        # (ckpt.R.S.pt.XXXX.tmp), never a partial ckpt.R.S.pt.
        names = [n.split(".") for n in os.listdir(out)]
        mine = {int(p[2]) for p in names if len(p) == 4 and p[:2] == ["ckpt", str(r)]}
        steps = mine if steps is None else steps & mine
    return max(steps or {0})


class Engine:
    """The little this worker needs of torch.distributed or Horovod."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "horovod":
            import horovod.torch as hvd

            hvd.init()
            self.rank, self.size, self._hvd = hvd.rank(), hvd.size(), hvd
        else:
            # torchrun keeps its store across restarts, and the process group's keys (the Gloo
            # addresses) are the same in every attempt: a restarted rank can read its peer's
            # stale address and fail or hang connecting. A prefix per attempt keeps them apart.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  size, is_master=False)  # fmt: skip
            # A bounded wait: a lost peer ends the launch instead of torch's 30-minute default.
            dist.init_process_group(
                "gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                world_size=size, timeout=datetime.timedelta(seconds=60),
            )  # fmt: skip
            self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def barrier(self) -> None:
        if self.name == "horovod":
            self._hvd.allreduce(torch.zeros(1), name="restart_worker.barrier")
        else:
            dist.barrier()

    def close(self) -> None:
        if self.name == "horovod":
            self._hvd.shutdown()
        else:
            dist.destroy_process_group()


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 PID prints every thread's stack
    out, kill_at, config = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    engine = Engine(sys.argv[4] if len(sys.argv) > 4 else "torchdist")
    kill_rank = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    rank, size = engine.rank, engine.size
    model = make_model()
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        **{"slow_momentum": 0.5, **CONFIGS[config]},
    )
    start = last_common_step(out, size)
    engine.barrier()  # every rank chose its start before anyone writes a new checkpoint
    if start:
        state = load_checkpoint(os.path.join(out, f"ckpt.{rank}.{start}.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        assert opt.num_steps == start, (opt.num_steps, start)
        print(f"rank {rank}: resumed at step {start}", flush=True)
    marker = os.path.join(out, "killed")
    for k in range(start, STEPS):
        if k == kill_at and rank == kill_rank and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss_at(model, rank, k).backward()
        opt.step()
        state = {"model": model.state_dict(), "opt": opt.state_dict()}
        save_checkpoint(state, os.path.join(out, f"ckpt.{rank}.{k + 1}.pt"))
    opt.flush()
    if rank == 0:
        save_checkpoint([p.detach() for p in model.parameters()], os.path.join(out, "final.pt"))
    engine.barrier()
    engine.close()


if __name__ == "__main__":
    main()
    end_process()
