"""One code path for both launchers: the examples run under ``torchrun`` (torch.distributed) and
under ``horovodrun`` (Horovod), and tell which from the environment each sets.

    torchrun --nproc-per-node 4 examples/mnist1d_cnn.py --algo localsgd --slowmo
    horovodrun -np 4 --gloo python examples/mnist1d_cnn.py --algo localsgd --slowmo

:func:`init_job` initializes the engine the launcher implies and returns a :class:`Job`: this
process's place in the job and the few collectives the examples make themselves, with the names
``horovod.torch`` gives them, so the training scripts read the same under either launcher. The
optimizer picks the same engine by itself (``DistributedOptimizer(engine="auto")``).
"""

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hvd_slowmo.comm.base import Communicator
from hvd_slowmo.comm.factory import default_communicator

__all__ = ["LAUNCHERS", "Job", "ThreadJob", "detect_launcher", "init_job", "run_in_threads"]

#: What :func:`detect_launcher` can answer.
LAUNCHERS = ("horovodrun", "torchrun", "none")


def detect_launcher(environ: Mapping[str, str] | None = None) -> str:
    """Which launcher started this process: ``"horovodrun"`` (it sets ``HOROVOD_RANK``; under
    ``--mpi`` or ``mpirun`` Open MPI sets ``OMPI_COMM_WORLD_RANK``), ``"torchrun"`` (it sets
    ``TORCHELASTIC_RUN_ID``; any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``
    for ``init_process_group`` counts too), or ``"none"`` (a plain ``python script.py``).

    Args:
        environ: the environment (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    if "HOROVOD_RANK" in env or "OMPI_COMM_WORLD_RANK" in env:
        return "horovodrun"
    if "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= env.keys():
        return "torchrun"
    return "none"


class Job:
    """This process in the job, over one engine (``"horovod"`` or ``"torch"``).

    Args:
        engine: ``"horovod"`` (``hvd.init()`` has run) or ``"torch"`` (a default process group
            exists).

    Attributes:
        engine: the engine.
        comm: the library's communicator over every rank (what the optimizer uses by default).
        Sum: the reduction :meth:`allreduce` takes (as ``hvd.Sum``).
    """

    Sum = "sum"

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.comm: Communicator = default_communicator(None, None, engine)
        self._hvd: Any = None
        if engine == "horovod":
            import horovod.torch as hvd

            self._hvd = hvd

    def rank(self) -> int:
        return self.comm.rank

    def size(self) -> int:
        return self.comm.size

    def local_rank(self) -> int:
        if self._hvd is not None:
            return self._hvd.local_rank()
        return int(os.environ.get("LOCAL_RANK", "0"))

    def local_size(self) -> int:
        if self._hvd is not None:
            return self._hvd.local_size()
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def barrier(self) -> None:
        """Wait until every rank has arrived."""
        self.comm.allgather_object(None)

    def broadcast_parameters(self, state: Mapping[str, torch.Tensor], root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s ``state`` (a ``state_dict()``), in place.

        Args:
            state: the tensors, the same names and shapes on every rank.
            root_rank: the rank whose values are sent.
        """
        if self._hvd is not None:
            self._hvd.broadcast_parameters(state, root_rank=root_rank)
            return
        from hvd_slowmo.comm.torchdist import broadcast_parameters

        broadcast_parameters(state, root_rank=root_rank)

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
        """``root_rank``'s ``obj`` on every rank (``name``: as Horovod's, unused here)."""
        return self.comm.broadcast_object(obj, root_rank)

    def allreduce(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        """The sum of ``tensor`` over all ranks (a new tensor).

        The library's communicators average; a sum of counts must stay exact, so this is the
        engine's own sum: Horovod's allreduce (the arithmetic of the examples before there was a
        second engine) or ``torch.distributed.all_reduce``.

        Args:
            tensor: this rank's tensor.
            op: :attr:`Sum` (the only reduction the examples use).
            name: a name unique to this collective (Horovod matches collectives by it).
        """
        if op != self.Sum:
            raise ValueError(f"Job.allreduce: op must be Job.Sum, got {op!r}")
        if self._hvd is not None:
            return self._hvd.allreduce(tensor, op=self._hvd.Sum, name=name)
        import torch.distributed as dist

        out = tensor.clone()
        dist.all_reduce(out)
        return out


class ThreadJob(Job):
    """One worker of an in-process job: ``size`` threads of this process over the library's
    thread communicator (:func:`run_in_threads`; the examples' ``--threads M``). No launcher, no
    sockets: the cheapest way to train many small runs on one machine (sweeps, the regime map).

    PyTorch's default generator is shared by the threads, so whatever a worker draws from it
    between :meth:`seed_turn` and its first :meth:`broadcast_parameters` (the model's
    initialization) is drawn with the job's turnstile held: one worker at a time, in rank order,
    each after its own ``manual_seed``; a run is then reproducible bit for bit.

    Args:
        comm: this worker's thread communicator.
        turnstile: shared by the job's workers (from :func:`run_in_threads`).
    """

    def __init__(self, comm: Communicator, turnstile: "_Turnstile") -> None:
        self.engine = "threads"
        self.comm = comm
        self._hvd = None
        self._turnstile = turnstile
        self._holding = False

    def local_rank(self) -> int:
        return 0  # one device for the whole process (threads share it)

    def local_size(self) -> int:
        return self.comm.size  # the threads share the cores

    def seed_turn(self) -> None:
        """Wait for this worker's turn (rank order) to use the shared generator."""
        if not self._holding:
            self._turnstile.enter(self.comm.rank)
            self._holding = True

    def end_turn(self) -> None:
        """Let the next worker (rank order) use the shared generator."""
        if self._holding:
            self._holding = False
            self._turnstile.leave(self.comm.rank)

    def broadcast_parameters(self, state: Mapping[str, torch.Tensor], root_rank: int = 0) -> None:
        self.end_turn()  # before the collective: the next worker can build its model
        sent = None
        if self.comm.rank == root_rank:
            sent = {k: v.detach().clone() for k, v in state.items()}
        received = self.comm.broadcast_object(sent, root_rank)
        with torch.no_grad():
            for k, v in state.items():
                v.copy_(received[k])

    def allreduce(self, tensor: torch.Tensor, op: str, name: str) -> torch.Tensor:
        if op != self.Sum:
            raise ValueError(f"Job.allreduce: op must be Job.Sum, got {op!r}")
        parts = self.comm.allgather_object(tensor.detach().clone())
        total = parts[0].clone()
        for t in parts[1:]:  # rank order on every worker: the same bits everywhere
            total += t
        return total


class _Turnstile:
    """Lets the workers of a :class:`ThreadJob` through one at a time, in rank order."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._next = 0

    def enter(self, rank: int) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._next == rank)

    def leave(self, rank: int) -> None:
        with self._cv:
            self._next = rank + 1
            self._cv.notify_all()


_THREAD = threading.local()


def run_in_threads(size: int, fn: Callable[[], Any], timeout: float = 3600.0) -> list[Any]:
    """Run ``fn()`` on ``size`` thread workers of this process; inside, :func:`init_job` returns
    each thread's :class:`ThreadJob`. Returns the workers' results in rank order.

    Args:
        size: the number of workers (>= 1).
        fn: the training run (e.g. an example's ``main`` with its arguments bound).
        timeout: seconds a worker waits in a collective before the run fails (a loaded machine
            is slow: generous by default).
    """
    from hvd_slowmo.comm.local import run_threads

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"threads must be an integer >= 1, got {size!r}")
    turnstile = _Turnstile()

    def worker(comm: Communicator) -> Any:
        _THREAD.job = ThreadJob(comm, turnstile)
        try:
            return fn()
        finally:
            _THREAD.job.end_turn()  # a run that failed before its broadcast lets the rest on
            _THREAD.job = None

    return run_threads(size, worker, timeout=timeout)


def init_job() -> Job:
    """Initialize the engine of this process's launcher and return the :class:`Job`
    (inside :func:`run_in_threads`: this thread's :class:`ThreadJob`).

    Under ``torchrun``: ``init_process_group`` with Gloo for CPU tensors and NCCL for CUDA
    tensors (when a GPU is present). Under ``horovodrun``: ``hvd.init()``. Without a launcher:
    Horovod where it is installed (as before there was a second engine), else a one-process
    torch.distributed group.
    """
    job = getattr(_THREAD, "job", None)
    if job is not None:
        return job
    launcher = detect_launcher()
    if launcher == "none":
        try:
            import horovod.torch  # noqa: F401
        except ImportError:
            launcher = "torchrun"
            _init_torch(single=True)
        else:
            launcher = "horovodrun"
    elif launcher == "torchrun":
        _init_torch(single=False)
    if launcher == "horovodrun":
        import horovod.torch as hvd

        hvd.init()
        return Job("horovod")
    return Job("torch")


def _init_torch(single: bool) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if single:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
