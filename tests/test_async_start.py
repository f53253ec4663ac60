"""Starting a collective never waits for the other workers (issue 26, GPU finding 2).

On CUDA, autograd runs every thread worker's gradient hooks on one device thread, so a hook
that waited inside ``average_start`` for the other workers waited for hooks queued behind it:
AR-SGD hung. The thread transport now hands each collective to a background progress thread and
returns at once; the MPI transport starts non-blocking requests (or hands the average to its
averaging thread). These tests fail (within their timeouts) with a start that blocks.
"""

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import run_threads

from reference import loss_at, make_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "mpi_collectives_worker.py")


def _start(comm, kind):
    """Start one collective of ``kind`` with rank-dependent inputs; returns (handle, finish)."""
    r, m = comm.rank, comm.size
    if kind == "average":
        t = torch.tensor([1.0, 2.0, 3.0]) * (r + 1) / 3
        pending = comm.average_start([t], "late")
        return pending, lambda: (pending.wait(), t)[1]
    if kind == "allgather":
        pending = comm.allgather_flat_start([torch.full((r + 1,), float(r))], "late")
        return pending, lambda: pending.wait()[0]
    sends = [torch.tensor([10.0 * r + dst]) for dst in range(m)]
    pending = comm.alltoall_flat_start(sends, [1] * m, "late")
    return pending, lambda: torch.cat(pending.wait())


@pytest.mark.parametrize("kind", ["average", "allgather", "alltoall"])
def test_thread_start_returns_before_the_other_workers_arrive(kind):
    """Rank 1 starts only once rank 0's start has returned: a blocking start would wait for
    rank 1 forever (here: rank 1 gives up after 5 s and the test fails)."""
    returned = threading.Event()

    def worker(comm):
        if comm.rank == 1 and not returned.wait(5):
            raise AssertionError("rank 0's start did not return while rank 1 was away")
        pending, finish = _start(comm, kind)
        if comm.rank == 0:
            assert not pending.done()
            returned.set()
        return finish()

    got = run_threads(2, worker, timeout=10)
    want = {
        # (1 + 2) / 3 / 2, summed in rank order then divided, as a hand-written reference.
        "average": (torch.tensor([1.0, 2.0, 3.0]) / 3 + torch.tensor([1.0, 2.0, 3.0]) * 2 / 3) / 2,
        "allgather": torch.tensor([0.0, 1.0, 1.0]),
    }
    for rank, out in enumerate(got):
        if kind == "alltoall":
            assert torch.equal(out, torch.tensor([rank, 10.0 + rank]))
        else:
            assert torch.equal(out, want[kind])


def test_every_collective_kind_of_one_worker_can_be_in_flight_at_once():
    """Rank 0 starts an average, an all-gather and an all-to-all before rank 1 starts any: they
    run in the order started, once rank 1 starts the same ones."""
    started = threading.Event()

    def worker(comm):
        if comm.rank == 1 and not started.wait(5):
            raise AssertionError("rank 0 could not start three collectives alone")
        handles = [_start(comm, kind) for kind in ("average", "allgather", "alltoall")]
        if comm.rank == 0:
            started.set()
        return [finish() for _, finish in handles]

    got = run_threads(2, worker, timeout=10)
    assert torch.equal(got[0][0], got[1][0])
    assert torch.equal(got[0][1], torch.tensor([0.0, 1.0, 1.0]))
    assert torch.equal(got[1][2], torch.tensor([1.0, 11.0]))


def _train(comm, model, steps, backward, synchronize=False):
    """AR-SGD + SlowMo on one thread worker; ``backward(rank, loss)`` runs its backward pass;
    ``synchronize``: call ``opt.synchronize()`` before ``step()`` (Horovod's AMP recipe)."""
    opt = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        base="allreduce",
        tau=2,
        communicator=comm,
        bucket_mb=1e-4,  # several buckets: several averages start inside one backward pass
    )
    for k in range(steps):
        opt.zero_grad()
        backward(comm.rank, loss_at(model, comm.rank, k))
        if synchronize:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return [p.detach().clone() for p in model.parameters()], comm.bytes_sent


class SharedBackwardThread:
    """One thread that runs every worker's backward pass, as autograd's CUDA device thread does:
    it collects one loss per worker, then runs their backward passes in rank order."""

    def __init__(self, m: int, steps: int) -> None:
        self.m, self.steps = m, steps
        self.losses: queue.Queue = queue.Queue()
        self.finished = [threading.Event() for _ in range(m)]
        self.errors: list[BaseException] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for _ in range(self.steps):
                batch = dict(self.losses.get(timeout=30) for _ in range(self.m))
                for rank in range(self.m):
                    batch[rank].backward()
                    self.finished[rank].set()
        except BaseException as e:  # the workers time out and the test reports it
            self.errors.append(e)

    def backward(self, rank: int, loss: torch.Tensor) -> None:
        """Worker ``rank``'s backward pass, run on the shared thread."""
        self.losses.put((rank, loss))
        if not self.finished[rank].wait(20):
            raise AssertionError(
                f"rank {rank}'s backward on the shared thread never finished {self.errors}"
            )
        self.finished[rank].clear()


@pytest.mark.parametrize("synchronize", [False, True], ids=["step", "synchronize-step"])
def test_ar_sgd_hooks_of_every_worker_on_one_shared_thread_complete(synchronize):
    """The structure of the CUDA hang, on the CPU: both workers' backward passes (and so their
    gradient hooks, which start the averages, and the end of each backward pass) run on one
    shared thread, rank 0's then rank 1's, as autograd's CUDA device thread runs them. A start,
    or an end of backward, that waited there for rank 1 would never let rank 1's backward run.
    The result equals a run where every worker runs its own backward pass, bit for bit (three
    workers: averaging the gradients twice would change their bits)."""
    m, steps = 3, 5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = [make_model() for _ in range(m)]
        device = SharedBackwardThread(m, steps)
        shared = run_threads(
            m, lambda c: _train(c, models[c.rank], steps, device.backward, synchronize), 30
        )
        assert not device.errors, device.errors
        models = [make_model() for _ in range(m)]
        own = run_threads(
            m, lambda c: _train(c, models[c.rank], steps, lambda r, loss: loss.backward()), 30
        )
    for rank in range(m):
        for a, b in zip(shared[rank][0], own[rank][0]):
            assert torch.equal(a, b)
        # The same averages, each once (a gradient averaged twice keeps its bits, mostly).
        assert shared[rank][1] == own[rank][1]
    for a, b in zip(shared[0][0], shared[1][0]):
        assert torch.equal(a, b)


def _mpirun():
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (scripts/setup_env.sh installs OpenMPI)")
    pytest.importorskip("mpi4py")
    return ["mpirun", "--allow-run-as-root", "--oversubscribe"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [2, 3])
def test_mpi_starts_return_at_once_and_keep_the_blocking_bits(np_):
    """Under ``mpirun``: every collective equals its blocking MPI form computed in the same run
    (the average bit for bit against MPI_Reduce + MPI_Bcast), and a start returns while rank 1
    is still asleep (1.5 s)."""
    import json

    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [*_mpirun(), "-np", str(np_), sys.executable, WORKER, "check", out],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        reports = []
        for r in range(np_):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                reports.append(json.load(f))
    for r, rep in enumerate(reports):
        assert rep["average_bitwise"], f"rank {r}: the average differs from MPI_Reduce+MPI_Bcast"
        assert rep["average_bits"] == reports[0]["average_bits"]
        assert rep["allgather_object"] == [{"rank": s} for s in range(np_)]
        assert rep["broadcast_object"] == f"from {np_ - 1}"
        assert rep["allgather_flat"] == [
            [v for s in range(np_) for v in (torch.arange(s + 1) + 10 * s).tolist()],
            list(range(np_)),
        ]
        assert rep["alltoall_flat"] == [[100.0 * s + r] * (r + 1) for s in range(np_)]
        assert rep["late_average"] == [sum(range(np_)) / np_] * 4
        if r != 1:
            assert rep["start_seconds"] < 0.5, f"rank {r}'s start waited for rank 1"


def test_a_start_is_cheap_next_to_a_sleeping_peer():
    """The thread transport's start costs microseconds, not a peer's delay: 20 starts while the
    other worker sleeps 1 s take well under that second."""

    def worker(comm):
        if comm.rank == 1:
            time.sleep(1.0)
        began = time.monotonic()
        tensors = [torch.full((8,), float(comm.rank)) for _ in range(20)]
        handles = [comm.average_start([t], f"t{i}") for i, t in enumerate(tensors)]
        took = time.monotonic() - began
        for h in handles:
            h.wait()
        assert all(torch.equal(t, torch.full((8,), 0.5)) for t in tensors)
        return took

    took = run_threads(2, worker, timeout=10)
    assert took[0] < 0.5, took


@pytest.mark.timeout(400)
def test_mpi_training_equals_thread_workers_bitwise():
    """``mpirun -np 2``: AR-SGD (averages started by the gradient hooks) and SlowMo with int8,
    error feedback, two fragments and overlap (an all-gather started by a poll, at a moment that
    differs between the ranks) over MPICommunicator end with the parameters of the same training
    on two thread workers, bit for bit (two terms per sum: every transport rounds alike)."""
    import json

    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [*_mpirun(), "-np", "2", sys.executable, WORKER, "train", out],
            env=env,
            capture_output=True,
            text=True,
            timeout=360,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(os.path.join(out, "rank0.json")) as f:
            report = json.load(f)
    assert report == {
        "allreduce-ranks-equal": True,
        "allreduce-equals-threads": True,
        "int8-fragments-equals-threads": True,
    }
