"""The configurations ``benchmarks/cluster.py`` measures: hvd_slowmo's algorithms, Horovod's
``DistributedOptimizer`` and PyTorch's peers, and how the report groups them (SlowMo,
arXiv 1910.00643, Table 2)."""

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_BY_KEY",
    "ALGORITHM_SETS",
    "Algorithm",
    "KINDS",
    "OVERLAP_ROWS",
    "PEER_KEYS",
    "PEER_ROWS",
    "TABLE2_ROWS",
    "WARMUP_ITERS",
    "select_algorithms",
]

#: Untimed iterations before each algorithm's timed ones. The timed windows then start two steps
#: after an outer step, so an average started at an outer step and applied up to two steps later
#: (``overlap`` <= 2) falls in the same window as its start: every window holds one of each.
WARMUP_ITERS = 2


@dataclass(frozen=True)
class Algorithm:
    """One measured configuration.

    Args:
        key: short identifier (JSON key, TensorBoard tag).
        label: the row label in the table.
        kind: ``"compute"`` (no communication), ``"horovod"`` (``hvd.DistributedOptimizer``),
            ``"slowmo"`` (``hvd_slowmo.DistributedOptimizer``), or a PyTorch peer over
            ``torch.distributed`` (Gloo): ``"ddp"`` (``DistributedDataParallel``, AR-SGD) or
            ``"postlocal"`` (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager(period=tau)``).
        base: hvd_slowmo base algorithm (``kind == "slowmo"`` only).
        tau: base steps per outer step (the averaging period for ``"postlocal"``).
        options: further ``hvd_slowmo.DistributedOptimizer`` keyword arguments.
        periodic: averages only every ``tau`` steps, so ``compute + AR_comm * payload / tau`` is
            its ideal.
        payload: exact-average volume relative to the parameters (2 when optimizer buffers are
            averaged too).
    """

    key: str
    label: str
    kind: str
    base: str = ""
    tau: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    periodic: bool = False
    payload: float = 1.0

    @property
    def overlap(self) -> int:
        """Inner steps the exact average runs behind (hvd_slowmo's ``overlap`` option; 0: none)."""
        return int(self.options.get("overlap", 0))


KINDS = ("compute", "horovod", "slowmo", "ddp", "postlocal")
_SLOWMO = {"slow_lr": 1.0, "slow_momentum": 0.6}
_PLAIN = {"slow_lr": 1.0, "slow_momentum": 0.0}  # slow update off: the base algorithm alone

#: Measured in this order, every one in the same worker processes.
ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm("compute", "compute only (no communication)", "compute"),
    Algorithm("horovod_ar", "AR-SGD (hvd.DistributedOptimizer)", "horovod"),
    Algorithm("torch_ddp", "AR-SGD (torch DistributedDataParallel, Gloo)", "ddp"),
    # The slow update off and buffers kept: plain AR-SGD for any tau; tau=12 is the library's
    # default, so the outer step's local NaN/inf check runs every 12 steps, as for a user.
    Algorithm(
        "allreduce",
        "AR-SGD (hvd_slowmo base=allreduce)",
        "slowmo",
        "allreduce",
        12,
        {**_PLAIN, "buffers": "maintain"},
    ),
    # SlowMo over AR-SGD, which the paper also tried (its Table 2's AR-SGD row).
    Algorithm(
        "allreduce_slowmo",
        "AR-SGD + SlowMo",
        "slowmo",
        "allreduce",
        12,
        {**_SLOWMO, "buffers": "reset"},
    ),
    # hvd_slowmo over its torch.distributed engine (Gloo): only the transport differs from the
    # row above; measured beside its PyTorch peers (DDP here, post-local SGD below).
    Algorithm(
        "allreduce_td",
        "AR-SGD (hvd_slowmo base=allreduce, torch.distributed)",
        "slowmo",
        "allreduce",
        12,
        {**_PLAIN, "buffers": "maintain", "engine": "torch"},
    ),
    # The same without the per-outer-step NaN/inf check (one small allgather): what that check
    # costs.
    Algorithm(
        "allreduce_nocheck",
        "AR-SGD (hvd_slowmo base=allreduce, nonfinite='ignore')",
        "slowmo",
        "allreduce",
        12,
        {**_PLAIN, "buffers": "maintain", "nonfinite": "ignore"},
    ),
    Algorithm(
        "torch_postlocal",
        "Local SGD (torch PostLocalSGDOptimizer, Gloo)",
        "postlocal",
        tau=12,
        periodic=True,
    ),
    Algorithm(
        "localsgd",
        "Local SGD",
        "slowmo",
        "localsgd",
        12,
        {**_PLAIN, "buffers": "reset"},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo",
        "Local SGD + SlowMo",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset"},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_td",
        "Local SGD + SlowMo (torch.distributed)",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "engine": "torch"},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_overlap1",
        "Local SGD + SlowMo, overlap=1",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "overlap": 1},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_overlap1_td",
        "Local SGD + SlowMo, overlap=1 (torch.distributed)",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "overlap": 1, "engine": "torch"},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_overlap2",
        "Local SGD + SlowMo, overlap=2",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "overlap": 2},
        periodic=True,
    ),
    # The codecs without overlap: one exact average each tau steps, its wire and its codec's
    # CPU time exposed (the utilization table's rows beside localsgd_slowmo's fp32).
    Algorithm(
        "localsgd_slowmo_int8",
        "Local SGD + SlowMo, int8",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "codec": "int8"},
        periodic=True,
        payload=0.25,
    ),
    Algorithm(
        "localsgd_slowmo_sparse",
        "Local SGD + SlowMo, sparse",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "codec": "sparse", "error_feedback": True},
        periodic=True,
        payload=0.019,
    ),
    # Streaming (fragments=4: a quarter of the model per average, each overlapped by up to
    # tau // 4 = 3 steps; needs a workload of at least 4 layers, so not the one-layer synthetic
    # one) and the compressed exchange (int8 pseudo-gradients, overlap=2).
    Algorithm(
        "localsgd_slowmo_stream4",
        "Local SGD + SlowMo, fragments=4, overlap=3",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "fragments": 4, "overlap": 3},
        periodic=True,
    ),
    # The settings of the accuracy study (docs/overlap-streaming.md, "Hiding without paying"):
    # a shorter delay with the eager estimate, and the same with Streaming DiLoCo's mixing.
    Algorithm(
        "localsgd_slowmo_stream4_o2_local",
        "Local SGD + SlowMo, fragments=4, overlap=2, eager=local",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "fragments": 4, "overlap": 2, "eager": "local"},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_stream4_o2_local_mix",
        "Local SGD + SlowMo, fragments=4, overlap=2, eager=local, mix=0.25",
        "slowmo",
        "localsgd",
        12,
        {
            **_SLOWMO,
            "buffers": "reset",
            "fragments": 4,
            "overlap": 2,
            "eager": "local",
            "mix": 0.25,
        },
        periodic=True,
    ),
    Algorithm(  # both: a quarter of the model per average, int8-coded (issue 21's 10 Mbit/s)
        "localsgd_slowmo_stream4_int8",
        "Local SGD + SlowMo, fragments=4, overlap=3, int8",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "fragments": 4, "overlap": 3, "codec": "int8"},
        periodic=True,
        payload=0.25,
    ),
    Algorithm(
        "localsgd_slowmo_int8_overlap2",
        "Local SGD + SlowMo, int8, overlap=2",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "codec": "int8", "overlap": 2},
        periodic=True,
        payload=0.25,
    ),
    # The sparse codec (docs/sparse.md): 2% of each chunk of 4096 at 2 bits, error feedback.
    # Its all-gather sends m - 1 packets of 0.037 bytes per parameter: at 4 workers 0.11 bytes
    # per parameter against a ring allreduce's 6, a payload of about 0.019.
    Algorithm(
        "localsgd_slowmo_stream4_sparse",
        "Local SGD + SlowMo, fragments=4, overlap=3, sparse",
        "slowmo",
        "localsgd",
        12,
        {
            **_SLOWMO,
            "buffers": "reset",
            "fragments": 4,
            "overlap": 3,
            "codec": "sparse",
            "error_feedback": True,
        },
        periodic=True,
        payload=0.019,
    ),
    Algorithm(
        "localsgd_slowmo_sparse_overlap2",
        "Local SGD + SlowMo, sparse, overlap=2",
        "slowmo",
        "localsgd",
        12,
        {
            **_SLOWMO,
            "buffers": "reset",
            "codec": "sparse",
            "error_feedback": True,
            "overlap": 2,
        },
        periodic=True,
        payload=0.019,
    ),
    Algorithm(
        "localsgd_slowmo_nocheck",
        "Local SGD + SlowMo, nonfinite='ignore'",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "nonfinite": "ignore"},
        periodic=True,
    ),
    Algorithm(
        "double_avg",
        "double averaging (Local SGD, buffers averaged)",
        "slowmo",
        "localsgd",
        12,
        {**_PLAIN, "buffers": "average"},
        periodic=True,
        payload=2.0,
    ),
    Algorithm("sgp", "SGP", "slowmo", "sgp", 48, {**_PLAIN, "buffers": "reset"}),
    Algorithm("sgp_slowmo", "SGP + SlowMo", "slowmo", "sgp", 48, {**_SLOWMO, "buffers": "reset"}),
    Algorithm(
        "sgp_slowmo_noavg",
        "SGP + SlowMo, no exact average",
        "slowmo",
        "sgp",
        48,
        {**_SLOWMO, "buffers": "reset", "average": False},
    ),
    Algorithm("osgp", "OSGP", "slowmo", "osgp", 48, {**_PLAIN, "buffers": "reset"}),
    Algorithm(
        "osgp_slowmo", "OSGP + SlowMo", "slowmo", "osgp", 48, {**_SLOWMO, "buffers": "reset"}
    ),
)
ALGORITHM_BY_KEY = {a.key: a for a in ALGORITHMS}
#: Rows of the paper-shaped table: (label, original, with SlowMo).
TABLE2_ROWS = (
    ("Local SGD", "localsgd", "localsgd_slowmo"),
    ("SGP", "sgp", "sgp_slowmo"),
    ("OSGP", "osgp", "osgp_slowmo"),
)
#: Rows of the peers table: (family, keys shown side by side), PyTorch's and Horovod's first.
PEER_ROWS = (
    ("AR-SGD", ("torch_ddp", "horovod_ar", "allreduce", "allreduce_slowmo", "allreduce_td")),
    (
        "Local SGD (tau=12)",
        (
            "torch_postlocal",
            "localsgd",
            "localsgd_slowmo",
            "localsgd_slowmo_overlap1",
            "localsgd_slowmo_overlap2",
            "localsgd_slowmo_int8",
            "localsgd_slowmo_sparse",
            "localsgd_slowmo_stream4",
            "localsgd_slowmo_stream4_o2_local",
            "localsgd_slowmo_stream4_o2_local_mix",
            "localsgd_slowmo_int8_overlap2",
            "localsgd_slowmo_stream4_int8",
            "localsgd_slowmo_sparse_overlap2",
            "localsgd_slowmo_stream4_sparse",
            "localsgd_slowmo_td",
            "localsgd_slowmo_overlap1_td",
        ),
    ),
)
#: Keys of the rows that come from PyTorch or Horovod rather than hvd_slowmo.
PEER_KEYS = ("torch_ddp", "horovod_ar", "torch_postlocal")
#: Overlapped rows and the row they hide the exact average of (the same run with overlap=0).
OVERLAP_ROWS = (
    ("localsgd_slowmo_overlap1", "localsgd_slowmo"),
    ("localsgd_slowmo_overlap2", "localsgd_slowmo"),
)
#: Names ``--algorithms`` accepts for a list of keys.
ALGORITHM_SETS = {
    "all": tuple(a.key for a in ALGORITHMS),
    "peers": ("compute",) + tuple(k for _, keys in PEER_ROWS for k in keys),
    # What slow links are about: the periodic methods and their overlapped forms.
    "slowlink": (
        "compute",
        "torch_postlocal",
        "localsgd_slowmo",
        "localsgd_slowmo_overlap1",
        "localsgd_slowmo_overlap2",
        "localsgd_slowmo_int8_overlap2",
        "localsgd_slowmo_stream4_int8",
        "localsgd_slowmo_sparse_overlap2",
        "localsgd_slowmo_stream4_sparse",
    ),
    # The utilization table (benchmarks/utilization.py): fp32, int8 and sparse, each without
    # overlap and streamed (fragments=4, overlap=3), beside compute only.
    "utilization": (
        "compute",
        "localsgd_slowmo",
        "localsgd_slowmo_int8",
        "localsgd_slowmo_sparse",
        "localsgd_slowmo_stream4",
        "localsgd_slowmo_stream4_int8",
        "localsgd_slowmo_stream4_sparse",
    ),
    # hvd_slowmo over torch.distributed beside PyTorch's own tools (same Gloo transport).
    "engines": (
        "compute",
        "torch_ddp",
        "allreduce_td",
        "torch_postlocal",
        "localsgd_slowmo_td",
        "localsgd_slowmo_overlap1_td",
    ),
}


def select_algorithms(text: str) -> list[str]:
    """The algorithm keys ``--algorithms`` names, in measuring order, each once.

    Args:
        text: comma-separated keys of :data:`ALGORITHMS` and/or set names (``all``, ``peers``).

    Raises:
        ValueError: an unknown name, or nothing selected.
    """
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    unknown = [n for n in names if n not in ALGORITHM_BY_KEY and n not in ALGORITHM_SETS]
    if unknown:
        raise ValueError(
            f"--algorithms: unknown {unknown}; choose from {sorted(ALGORITHM_SETS)} "
            f"or {[a.key for a in ALGORITHMS]}"
        )
    chosen = {k for n in names for k in ALGORITHM_SETS.get(n, (n,))}
    if not chosen:
        raise ValueError(
            "--algorithms selects nothing; give e.g. 'all', 'peers' or 'compute,localsgd'"
        )
    return [a.key for a in ALGORITHMS if a.key in chosen]
