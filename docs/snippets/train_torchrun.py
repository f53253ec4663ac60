"""A DistributedDataParallel script ported to hvd_slowmo under torchrun, no Horovod
(docs/guide/port-horovod.md).

    torchrun --nproc-per-node 4 docs/snippets/train_torchrun.py --checkpoint ckpt.pt
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvd_slowmo
from hvd_slowmo.comm.torchdist import broadcast_parameters

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", default="ckpt.pt")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--worker", choices=["process", "node"], default="process")
args = parser.parse_args()

dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
rank, size = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ.get("LOCAL_RANK", 0))
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
torch.manual_seed(0)
x = torch.randn(2048, 10)
data = TensorDataset(x, x.sum(1, keepdim=True))
sampler = DistributedSampler(data, num_replicas=size, rank=rank, drop_last=True)
loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model.to(device)  # before: model = DistributedDataParallel(model.to(device))
base = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9, nesterov=True)
opt = hvd_slowmo.DistributedOptimizer(  # before: opt = base
    base,
    named_parameters=model.named_parameters(),
    base="localsgd",
    tau=12,
    slow_momentum=0.7,
    worker=args.worker,  # "node": the node is torchrun's GROUP_RANK
)
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

start_epoch = 0
if os.path.exists(args.checkpoint):  # every rank reads the file (a shared filesystem)
    state = hvd_slowmo.load_checkpoint(args.checkpoint)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    start_epoch = state["epoch"]
broadcast_parameters(model.state_dict(), root_rank=0)  # DDP did this in its constructor

for epoch in range(start_epoch, args.epochs):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
        loss.backward()
        opt.step()
    scheduler.step()
    with opt.use_consensus(), torch.no_grad():
        inputs, targets = x[:512].to(device), data.tensors[1][:512].to(device)
        avg_loss = torch.nn.functional.mse_loss(model(inputs), targets).item()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1}
    state["scheduler"] = scheduler.state_dict()
    if rank == 0:
        hvd_slowmo.save_checkpoint(state, args.checkpoint)
        print(f"epoch {epoch}: loss of the averaged model {avg_loss:.4f}")
    dist.barrier()  # no rank reads a checkpoint that rank 0 is still writing
dist.destroy_process_group()
