"""A Horovod training script ported to hvd_slowmo (docs/guide/port-horovod.md).

    horovodrun -np 4 python docs/snippets/train_horovod.py --checkpoint ckpt.pt

Run it again with the same --checkpoint and it resumes where it stopped.
"""

import argparse
import os

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hvd_slowmo

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", default="ckpt.pt")
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--worker", choices=["process", "node"], default="process")
args = parser.parse_args()

hvd.init(process_sets="dynamic" if args.worker == "node" else None)  # node: a set per node
device = (
    torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
)
torch.manual_seed(0)  # the same data and initial model on every rank
x = torch.randn(2048, 10)
data = TensorDataset(x, x.sum(1, keepdim=True))
# Each rank its own shard, and every rank the same number of batches: SlowMo's outer steps
# are counted in steps, so a rank with one batch more would wait for an outer step alone.
sampler = DistributedSampler(data, num_replicas=hvd.size(), rank=hvd.rank(), drop_last=True)
loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)

model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model.to(device)
base = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9, nesterov=True)
# Before: opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
opt = hvd_slowmo.DistributedOptimizer(
    base,
    named_parameters=model.named_parameters(),
    base="localsgd",  # each worker steps alone; "allreduce" averages gradients as Horovod does
    tau=12,  # base steps between two exact averages of the parameters
    slow_lr=1.0,
    slow_momentum=0.7,
    worker=args.worker,  # "node": a whole host is one SlowMo worker (docs/guide/cluster.md)
)
scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # unchanged
scaler = torch.amp.GradScaler(device.type)  # unchanged

start_epoch = 0
if hvd.rank() == 0 and os.path.exists(args.checkpoint):  # resume: rank 0 reads the file
    state = hvd_slowmo.load_checkpoint(args.checkpoint)  # before: torch.load
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    start_epoch = state["epoch"]
hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # unchanged
hvd_slowmo.broadcast_optimizer_state(opt, root_rank=0)  # before: hvd.broadcast_optimizer_state
# The rest of rank 0's state, for the other ranks (unchanged from a Horovod script).
start_epoch, sched_state, scaler_state = hvd.broadcast_object(
    (start_epoch, scheduler.state_dict(), scaler.state_dict()), root_rank=0
)
scheduler.load_state_dict(sched_state)
scaler.load_state_dict(scaler_state)

for epoch in range(start_epoch, args.epochs):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        opt.zero_grad()
        with torch.autocast(device.type, enabled=device.type == "cuda"):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(opt)  # an overflow on any worker skips the step on every worker
        scaler.update()
    scheduler.step()
    with opt.use_consensus(), torch.no_grad():  # the workers' averaged model (collective)
        inputs, targets = x[:512].to(device), data.tensors[1][:512].to(device)
        avg_loss = torch.nn.functional.mse_loss(model(inputs), targets).item()
    # state_dict() on every rank (it finishes what is in flight), the file from rank 0.
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1}
    state.update(scheduler=scheduler.state_dict(), scaler=scaler.state_dict())
    if hvd.rank() == 0:
        hvd_slowmo.save_checkpoint(state, args.checkpoint)  # before: torch.save (atomic now)
        print(f"epoch {epoch}: loss of the averaged model {avg_loss:.4f}")
