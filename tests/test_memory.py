"""hvd_slowmo.memory.held_bytes: each part of a running optimizer, each storage counted once,
against the sizes the parts must have (and the planner's kept parts)."""

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import encoded_nbytes
from hvd_slowmo.memory import PARTS, held_bytes
from hvd_slowmo.plan import Cluster, Setting, memory_parts

N = 100 * 100 + 100  # a Linear(100, 100)


def run(steps: int, **options):
    def fn(comm):
        torch.manual_seed(0)
        model = torch.nn.Linear(100, 100)
        opt = DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=4,
            slow_momentum=0.5,
            **options,
        )
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 100)).sum().backward()
            opt.step()
        return held_bytes(opt)

    return run_threads(2, fn)[0]


def test_each_part_of_an_int8_run_with_an_average_in_flight():
    # Step 9 of tau=4 with overlap=2: the average started at step 8 is in flight (sent and
    # snapshot copies); Adam's two moments, an anchor, a slow buffer, a residual, and the kept
    # pseudo-gradient buffer, each one copy of the model, and the kept packets (both workers'
    # chunks and the reduced one).
    held = run(9, codec="int8", error_feedback=True, overlap=2)
    assert list(held) == list(PARTS)
    copy = 4 * N
    assert held["parameters"] == held["gradients"] == held["anchor"] == copy
    assert held["slow buffer"] == held["residual"] == copy
    chunk = encoded_nbytes(N // 2, "int8")  # N is even: two equal chunks
    assert held["codec scratch"] == copy + 3 * chunk
    assert 2 * copy <= held["optimizer state"] <= 2 * copy + 16  # the moments and step counters
    assert held["in flight"] == 2 * copy
    planned = memory_parts(Setting("int8", overlap=2), N, Cluster(2))
    for part in PARTS:
        if part != "optimizer state":
            assert held[part] == planned[part], part


def test_without_overlap_nothing_is_counted_twice():
    # overlap=0: the outer step averages the parameters themselves; no codec, no residual.
    held = run(8)
    assert held["in flight"] == held["residual"] == held["codec scratch"] == 0
    assert held["parameters"] == held["anchor"] == 4 * N


@pytest.mark.parametrize("codec", ["int8", "sparse"])
def test_the_fragments_share_one_scratch_buffer(codec):
    # Four fragments of 930 parameters, each averaged three times: one buffer (the
    # pseudo-gradient, then the mean; sparse: padded to a whole chunk, the sum's length) serves
    # them all, the same storage every outer step, where each fragment kept its own
    # pseudo-gradient buffer and, sparse, its sum buffer before (four or eight times the bytes).
    # int8 keeps its packets too: two more buffers (the chunks sent, the reduced one), shared.
    fragment = 30 * 30 + 30

    def fn(comm):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(30, 30) for _ in range(4)])
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            communicator=comm,
            tau=8,
            fragments=4,
            overlap=1,
            codec=codec,
            error_feedback=True,
        )
        pointers = []
        for step in range(1, 25):
            opt.zero_grad()
            model(torch.randn(4, 30)).square().mean().backward()
            opt.step()
            if step % 8 == 0:
                scratch = {
                    t.data_ptr() for f in opt.outer.fragments for t in f.exchange.average.scratch
                }
                pointers.append(scratch)
        return held_bytes(opt), pointers

    held, pointers = run_threads(2, fn)[0]
    assert len(pointers[0]) == (1 if codec == "sparse" else 3)
    assert pointers[0] == pointers[1] == pointers[2]
    packets = 3 * encoded_nbytes(fragment // 2, "int8")  # two chunks sent, one reduced
    assert held["codec scratch"] == (4 * 4096 if codec == "sparse" else 4 * fragment + packets)


_FREED_IN_THE_HEAP = """
import ctypes
from hvd_slowmo.memory import release_free_pages

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096


def touched(size):
    block = libc.malloc(size)
    libc.memset(block, 1, size)
    return block


libc.free(touched(16 << 20))  # a mapped block freed: blocks up to 16 MiB now come from the heap
blocks = []
for _ in range(20):
    blocks += [touched(4 << 20), libc.malloc(64)]  # the small one keeps the next off the top
for block in blocks[0:-2:2]:
    libc.free(block)  # 19 free blocks of 4 MiB inside the heap, still resident
before = resident()
released = release_free_pages()
print(released, before - resident())
"""


def test_release_free_pages_returns_freed_heap_blocks_to_the_system():
    """76 MiB freed inside glibc's heap (blocks below its raised mmap threshold, each followed
    by a live one, so that no trim of the heap's top reaches them) stay resident until
    release_free_pages(), which gives at least half of it back."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FREED_IN_THE_HEAP], capture_output=True, text=True, check=True
    ).stdout.split()
    if out[0] != "True":
        pytest.skip("not glibc: release_free_pages() does nothing here")
    assert int(out[1]) > 38 << 20, f"only {int(out[1]) >> 20} MiB returned of 76"
