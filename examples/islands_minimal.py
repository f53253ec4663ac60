"""SlowMo between islands, in one page (docs/islands.md): 2 islands, each sharding the model over
its ranks with FSDP2; Local AdamW inside, an outer step between the islands every 4 steps; every
rank saves its own state and a new launch resumes from it.

    torchrun --nproc-per-node 4 examples/islands_minimal.py CKPT_DIR STEPS
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import hvd_slowmo


def main(folder: str, steps: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank, world = dist.get_rank(), dist.get_world_size()

    # Islands x ranks per island = world size; SlowMo runs across "islands", FSDP2 inside.
    mesh = init_device_mesh(device, (2, world // 2), mesh_dim_names=("islands", "shard"))

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])  # the root last: every parameter is sharded

    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        named_parameters=model.named_parameters(),
        worker=hvd_slowmo.Islands(mesh, across="islands"),
        base="localsgd",
        tau=4,
        slow_momentum=0.5,
    )

    # One file per rank: each holds its own shard of the model and of the outer state.
    ckpt = os.path.join(folder, f"ckpt.rank{rank}.pt")
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        if rank == 0:
            print(f"resumed at step {opt.num_steps}", flush=True)

    target = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).to(device) / 8
    island, inner = mesh.get_local_rank("islands"), mesh.get_local_rank("shard")
    for step in range(opt.num_steps, steps):
        # Every rank its own batch: data parallel inside the island, other data across islands.
        g = torch.Generator().manual_seed(1000 * step + 10 * island + inner)
        x = torch.randn(16, 64, generator=g).to(device)
        loss = (model(x) - x @ target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and opt.inner_step == 0:  # an outer step has just run
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)

    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    torch.save(state, ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
