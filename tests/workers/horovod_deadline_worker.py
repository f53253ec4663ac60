"""Horovod with a frozen peer, for tests/test_deadline.py: ``horovodrun -np 2 python
horovod_deadline_worker.py OUT``. Rank 1 sleeps 60 s before the second average; rank 0's
HorovodCommunicator (HVD_SLOWMO_COLLECTIVE_TIMEOUT=2) must raise within the deadline, write its
message to OUT/rank0.txt and leave with os._exit (a plain exit runs Horovod's shutdown, which
waits for the frozen peer under MPI); the launcher then ends rank 1."""

import os
import sys
import time

import horovod.torch as hvd
import torch

from hvd_slowmo.comm.deadline import CollectiveTimeout
from hvd_slowmo.comm.horovod import HorovodCommunicator

hvd.init()
comm = HorovodCommunicator()
comm.average_([torch.ones(3)], "warm-up")
if hvd.rank() == 1:
    time.sleep(60)
    os._exit(0)
began = time.monotonic()
try:
    comm.average_([torch.ones(3)], "frozen")
except CollectiveTimeout as e:
    with open(os.path.join(sys.argv[1], "rank0.txt"), "w") as f:
        f.write(f"{time.monotonic() - began:.2f}\n{e}\n")
    os._exit(3)
os._exit(0)
