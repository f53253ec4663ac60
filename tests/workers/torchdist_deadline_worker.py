"""torch.distributed (Gloo) with a frozen peer, for tests/test_deadline.py: ``python
torchdist_deadline_worker.py RANK PORT OUT``. Rank 1 sleeps 60 s before the second average; rank
0's TorchDistCommunicator (HVD_SLOWMO_COLLECTIVE_TIMEOUT=2) must raise within the deadline and
write its message to OUT/rank0.txt, then leave with os._exit (a plain exit would wait for the
process group)."""

import os
import sys
import time

import torch
import torch.distributed as dist

from hvd_slowmo.comm.torchdist import TorchDistCommunicator

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
comm = TorchDistCommunicator()
comm.average_([torch.ones(3)], "warm-up")
if rank == 1:
    time.sleep(60)
    os._exit(0)
began = time.monotonic()
try:
    comm.average_([torch.ones(3)], "frozen")
except RuntimeError as e:
    with open(os.path.join(out, "rank0.txt"), "w") as f:
        f.write(f"{time.monotonic() - began:.2f}\n{e}\n")
    os._exit(3)
os._exit(0)
