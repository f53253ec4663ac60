"""Plan a SlowMo run before renting the cluster: a cost model of one outer period.

SlowMo (arXiv 1910.00643) spends ``tau`` base steps computing, then one exact average of the
parameters (or ``fragments`` averages, each of a share, with streaming); ``overlap=d`` keeps an
average in flight for ``d`` steps, behind the compute. This module predicts, for each way of
sending that average, the time per iteration, the compute utilization, the bytes per worker per
outer step and the memory per GPU, and recommends one::

    python -m hvd_slowmo.plan --params 1.3e9 --step-time 1.2 --workers 64 --per-node 8 \\
        --link 10gbit --latency 20ms

The model (docs/planner.md), per exchange of ``n`` float32 values among ``P`` workers, ``G`` per
node, ``M = P / G`` nodes; a byte count is what the communicator counts
(:attr:`hvd_slowmo.comm.base.Communicator.bytes_sent`), from the codecs' real packet sizes:

* ``fp32``: a ring allreduce, ``2 (P-1)/P * 4n`` bytes, ``2 (P-1)`` rounds;
* a dense codec (``int8``, ...): an all-to-all of the encoded chunks (``(P-1)/P`` of the encoded
  vector, ``P-1`` rounds) and a ring all-gather of the reduced chunks (the same again);
* ``sparse`` (the all-gather exchange, :mod:`hvd_slowmo.compression.sparse_exchange`): ``(P-1)``
  packets, ``P-1`` rounds;
* ``sparse-owners`` (``SparseCodec(exchange="owners")``,
  :mod:`hvd_slowmo.compression.sparse_owners`): an all-to-all of each owner's region packet and
  an all-gather of the reduced ones, as a dense codec;
* ``hierarchical``: an exact fp32 reduce-scatter inside the node, the codec's average of this
  rank's ``n/G`` shard among the ``M`` ranks of its local rank across nodes, an fp32 all-gather
  inside the node (``DistributedOptimizer(hierarchical=True)``,
  :mod:`hvd_slowmo.exchange.hierarchical`; with ``fragments=1`` only).

Time: a phase on the slow link takes ``egress / bandwidth + rounds * latency`` (an
all-to-all's ``egress / bandwidth`` times its slowdown, below), where ``egress``
is what leaves one node (a ring over node-ordered ranks sends one rank's share across each node
boundary; an all-to-all sends every rank's messages to other nodes; the ``G`` shards of a
hierarchical exchange share the node's link); a phase inside the node takes the rank's bytes
over the intra-node link. The codec's arithmetic costs ``codec_ms_per_mb`` per MB (2^20 bytes)
of float32 it encodes (a measured constant: :data:`CODEC_MS_PER_MB`). An average of the
period's ``W`` seconds (wire, latency, codec) is hidden behind the compute: with ``F``
fragments each in flight ``d`` steps of ``step_time``, the exposed time is ``F max(0, W/F - d
step_time)``; the time per iteration is ``step_time + exposed / tau``.

A ring runs at the link's nominal rate in this model (on the emulated cluster it did, within
about 7%: what TCP's headers and acknowledgements take). An all-to-all across ``M`` nodes takes
``1 + ALLTOALL_CONTENTION * (M-2)/(M-1)`` times its bytes' nominal time
(:func:`alltoall_slowdown`): a ring's one flow into a node arrives already paced to the rate by
its sender's link, where the all-to-all's ``M - 1`` senders each split their paced stream
among ``M - 1`` destinations, so what arrives at a node's link is bursty (the index of
dispersion of ``M - 1`` paced streams, each split as if at random among ``M - 1``
destinations, merged at one: ``(M-2)/(M-1)``, 0 for two nodes, towards 1, Poisson-like, for
many), and a link with a finite queue loses throughput to bursts. One constant, fitted on one
emulated-cluster row and checked on the others (docs/planner.md, Calibration). A prediction
whose all-to-all crosses more nodes than the calibration had, on a link loaded above
:data:`ALLTOALL_LOAD_LIMIT`, carries a warning: there the slowdown's form decides the time.
"""

import argparse
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ALLTOALL_CALIBRATED_NODES",
    "ALLTOALL_CONTENTION",
    "ALLTOALL_LOAD_LIMIT",
    "CODEC_MS_PER_MB",
    "Cluster",
    "Measured",
    "Phase",
    "Prediction",
    "Setting",
    "Traffic",
    "alltoall_slowdown",
    "calibration_rows",
    "default_settings",
    "exchange_traffic",
    "memory_parts",
    "outer_traffic",
    "parse_count",
    "parse_duration",
    "parse_rate",
    "predict",
    "print_calibration",
    "recommend",
]

#: One worker's codec arithmetic per MB (2^20 bytes) of float32 input, in ms: its share of a
#: 4-worker mean (encode, decode and sum, re-encode and decode: ``benchmarks/codec_cost.py
#: --mb 64``'s "mean" column, timed from cold caches), the median of eight runs measured alone
#: on 2 cores of an AMD EPYC with AVX-512, torch 2.14.1, 2026-11-29, commit 57dbf27, through
#: the C kernels (:mod:`hvd_slowmo.compression.native`; a plain copy of the same bytes, timed
#: alternating with each mean: 0.048-0.075). The emulated cluster's calibration runs ran the
#: eager path, at its own costs (``benchmarks/plan_calibration.py``). A GPU's cost is far
#: lower: pass your own with ``--codec-cost``.
CODEC_MS_PER_MB: dict[str, float] = {
    "fp32": 0.0,
    "fp16": 0.20,
    "bf16": 0.19,
    "int8": 0.15,
    "fp8": 0.22,
    "sparse": 0.21,
    "sparse-owners": 0.21,  # not measured: the all-gather form's figure
}
#: ``c`` of an all-to-all's slowdown on the slow link, ``1 + c (M-2)/(M-1)`` times its bytes'
#: nominal time across ``M`` nodes (:func:`alltoall_slowdown`). Fitted by
#: ``benchmarks/plan_calibration.py`` on one row of the emulated cluster, int8 streamed on 4
#: hosts at 10 Mbit/s (measured 1594 ms per iteration: 1.699), and held out on its 26 other
#: rows, among them int8 at 8 hosts, 10 Mbit/s, the one other row it changes: 7.6% under
#: (docs/planner.md, Calibration). At 4 hosts the all-to-all takes 2.13x, at 8 hosts 2.46x.
ALLTOALL_CONTENTION = 1.7
#: The most nodes an all-to-all crossed in the calibration of :data:`ALLTOALL_CONTENTION`.
ALLTOALL_CALIBRATED_NODES = 8
#: The link load (a period's bytes on the slow link at its nominal rate, over the period's
#: compute) above which the all-to-all's slowdown decides whether an int8 exchange hides
#: (streamed across ``M`` nodes, one worker each, the all-to-all is half its bytes: at
#: ``1 + c`` times their time the exchange fills the compute from a load of
#: ``2 / (2 + c) = 0.54``). A prediction with an all-to-all across more than
#: :data:`ALLTOALL_CALIBRATED_NODES` nodes on a link loaded above it carries a warning: it
#: rests on the slowdown's form beyond the calibrated nodes.
ALLTOALL_LOAD_LIMIT = 0.5
#: Float32 copies of the model the base optimizer keeps, by name.
OPTIMIZER_COPIES = {"sgd": 0, "momentum": 1, "adam": 2}
_MIB = float(1 << 20)

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"


def _parse(
    text: object, name: str, units: Mapping[str, float], example: str, per_second: bool = False
) -> float:
    """A non-negative number with a unit of ``units`` (case-insensitive), in base units;
    ``per_second``: the unit may end in ``/s`` or ``ps``."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise TypeError(f"{name} must be a string such as {example!r}, got {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        suffix = r"(/s|ps)?" if per_second else "()"
        match = re.fullmatch(_NUMBER + r"\s*([a-z]*?)" + suffix, text.strip().lower())
        if match is None:
            raise ValueError(
                f"{name}={text!r} is not a non-negative number with a unit; e.g. {example!r}"
            )
        value, unit = float(match.group(1)), match.group(2)
        if match.group(3) == "ps" and unit.endswith("b"):  # "gbps": gigabits per second
            unit += "it"
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"{name}={text!r} must be a finite number >= 0; e.g. {example!r}")
    if unit not in units:
        raise ValueError(
            f"{name}={text!r}: unknown unit {unit!r}; use one of {sorted(units)}, e.g. {example!r}"
        )
    return value * units[unit]


def parse_rate(text: object, name: str = "link") -> float:
    """A link rate in bits per second: ``"10gbit"``, ``"100mbit"``, ``"1.5gbps"``.

    Args:
        text: the rate, a number and one of ``bit, kbit, mbit, gbit, tbit`` (``/s`` or ``ps``
            may follow).
        name: the argument's name, for the message.

    Raises:
        ValueError: an unknown unit, a malformed or non-positive rate.
    """
    rate = _parse(text, name, _RATE_UNITS, "10gbit", per_second=True)
    if rate <= 0:
        raise ValueError(f"{name}={text!r} must be above zero, e.g. '10gbit'")
    return rate


def parse_duration(text: object, name: str = "latency") -> float:
    """A duration in seconds: ``"20ms"``, ``"1.2s"``, ``"5us"``; a bare number is seconds.

    Args:
        text: the duration.
        name: the argument's name, for the message.

    Raises:
        ValueError: an unknown unit or a malformed duration.
    """
    return _parse(text, name, {"": 1.0, **_TIME_UNITS}, "20ms")


def parse_count(text: object, name: str = "params") -> int:
    """A count: ``"1.3e9"``, ``"1.3B"``, ``"350M"``, ``"10k"``.

    Args:
        text: the count.
        name: the argument's name, for the message.

    Raises:
        ValueError: an unknown suffix, a malformed count, or zero.
    """
    count = round(_parse(text, name, _COUNT_UNITS, "1.3e9"))
    if count < 1:
        raise ValueError(f"{name}={text!r} must be at least 1")
    return count


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number above zero, got {value!r}")


@dataclass(frozen=True)
class Cluster:
    """The workers and their links.

    Args:
        workers: ``P``, the workers (GPUs) of the job.
        per_node: ``G``, workers per node (they share the node's link); divides ``workers``.
        link_bits_per_s: the link of one node to the others (the slow one).
        latency_s: one round's latency on it.
        intra_bits_per_s: the link between two workers of one node (NVLink, PCIe).
        intra_latency_s: one round's latency on it.

    Raises:
        ValueError: a count below 1, more workers per node than workers, a node count that is
            not whole, a rate not above zero or a negative latency.
    """

    workers: int
    per_node: int = 1
    link_bits_per_s: float = 10e9
    latency_s: float = 0.0
    intra_bits_per_s: float = 800e9
    intra_latency_s: float = 5e-6

    def __post_init__(self) -> None:
        for name in ("workers", "per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.per_node > self.workers:
            raise ValueError(
                f"per_node={self.per_node} is more workers per node than workers="
                f"{self.workers}; use per_node <= workers"
            )
        if self.workers % self.per_node:
            raise ValueError(
                f"workers={self.workers} is not a whole number of nodes of per_node="
                f"{self.per_node}; use a multiple of per_node"
            )
        _positive("link_bits_per_s", self.link_bits_per_s)
        _positive("intra_bits_per_s", self.intra_bits_per_s)
        for name in ("latency_s", "intra_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def nodes(self) -> int:
        """``M = P / G``."""
        return self.workers // self.per_node


@dataclass(frozen=True)
class Setting:
    """One way to run the outer exchange.

    Args:
        codec: ``"fp32"`` (the plain allreduce), a dense codec name of
            :data:`hvd_slowmo.compression.CODECS`, ``"sparse"`` (the all-gather exchange with
            :class:`~hvd_slowmo.compression.SparseCodec`'s defaults) or ``"sparse-owners"``
            (the same codec reduced at owners, ``exchange="owners"``).
        hierarchical: exact inside a node, the codec across nodes.
        fragments: streaming's ``fragments``.
        overlap: steps each average stays in flight.
    """

    codec: str = "fp32"
    hierarchical: bool = False
    fragments: int = 1
    overlap: int = 0

    @property
    def runnable(self) -> bool:
        """Whether the optimizer runs it: its hierarchical exchange takes the whole model
        (``fragments=1``)."""
        return not (self.hierarchical and self.fragments > 1)

    @property
    def arguments(self) -> str:
        """The optimizer's arguments that ask for it: ``codec="int8", hierarchical=True``."""
        spelled = {"fp32": None, "sparse-owners": 'SparseCodec(exchange="owners")'}.get(
            self.codec, f'"{self.codec}"'
        )
        args = [] if spelled is None else [f"codec={spelled}, error_feedback=True"]
        if self.hierarchical:
            args.append("hierarchical=True")
        if self.fragments > 1:
            args.append(f"fragments={self.fragments}")
        if self.overlap:
            args.append(f"overlap={self.overlap}")
        return ", ".join(args) or "the defaults"

    @property
    def label(self) -> str:
        """A short name: ``"hier int8, fragments=4, overlap=3"``."""
        name = ("hier " if self.hierarchical else "") + self.codec
        tail = "" if self.runnable else " (not an optimizer option yet)"
        if self.fragments == 1 and self.overlap == 0:
            return f"{name}, no overlap{tail}"
        return f"{name}, fragments={self.fragments}, overlap={self.overlap}{tail}"


@dataclass(frozen=True)
class Phase:
    """One collective of an exchange.

    Attributes:
        name: e.g. ``"all-to-all"``.
        link: ``"cross"`` (the nodes' link) or ``"intra"`` (inside a node).
        link_bytes: bytes on that link: what leaves one node (cross), or one rank's (intra).
        rounds: sequential message rounds (each costs the link's latency).
    """

    name: str
    link: str
    link_bytes: float
    rounds: int

    @property
    def all_to_all(self) -> bool:
        """Whether every worker sends to every other at once (an all-to-all)."""
        return self.name.startswith("all-to-all")


@dataclass(frozen=True)
class Traffic:
    """What one exchange (or one outer step's exchanges) moves, per worker.

    Attributes:
        sent: bytes the busiest worker sends (what its ``bytes_sent`` counts).
        received: bytes it receives.
        phases: the collectives, in order.
        encoded_floats: float32 values of this worker's input to the codec (its cost is per MB
            of input: :data:`CODEC_MS_PER_MB`).
    """

    sent: int
    received: int
    phases: tuple[Phase, ...]
    encoded_floats: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(
            self.sent + other.sent,
            self.received + other.received,
            self.phases + other.phases,
            self.encoded_floats + other.encoded_floats,
        )


def _shards(numel: int, parts: int) -> list[int]:
    base, extra = divmod(numel, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _flat_traffic(codec: str, numel: int, workers: int, per_node: int) -> Traffic:
    """One exchange of ``numel`` values among ``workers``, ``per_node`` to a node."""
    from .compression import SparseCodec, encoded_nbytes, packet_nbytes
    from .compression.sparse_owners import owner_sizes

    m = workers
    if m == 1 or numel == 0:
        return Traffic(0, 0, ())
    share = (m - 1) / m
    crossing = per_node < m  # a ring has one edge out of each node, when there are two nodes
    if codec == "fp32":
        sent = int(2 * share * 4 * numel)
        phase = Phase("ring allreduce", "cross" if crossing else "intra", sent, 2 * (m - 1))
        return Traffic(sent, sent, (phase,))
    if codec == "sparse":
        packet = packet_nbytes(numel, SparseCodec())
        sent = int(share * m * packet)  # the counter's expression: (m-1)/m of the gathered bytes
        phase = Phase("ring all-gather", "cross" if crossing else "intra", sent, m - 1)
        return Traffic(sent, sent, (phase,), numel)
    if codec == "sparse-owners":
        owners = SparseCodec(exchange="owners")
        sizes = owner_sizes(numel, owners, m)
        encoded = [packet_nbytes(s, owners) for s in sizes]
    else:
        sizes = _shards(numel, m)
        encoded = [encoded_nbytes(s, codec) for s in sizes]
    gathered = int(share * sum(encoded))
    # The busiest worker: the one whose own chunk (kept, not sent) is smallest.
    mine = min(range(m), key=lambda r: encoded[r])
    to_others = sum(encoded) - encoded[mine]
    received = (m - 1) * encoded[mine] + gathered
    # Every worker of a node sends its messages for the other nodes' workers over its link.
    egress = per_node * sum(encoded) * (m - per_node) / m
    phases = (
        Phase("all-to-all", "cross" if crossing else "intra", egress if crossing else to_others,
              m - 1),
        Phase("ring all-gather", "cross" if crossing else "intra", gathered, m - 1),
    )  # fmt: skip
    return Traffic(to_others + gathered, received, phases, numel)


def exchange_traffic(setting: Setting, numel: int, cluster: Cluster) -> Traffic:
    """What one exchange of ``numel`` float32 values moves (one fragment's average).

    Args:
        setting: the exchange (its ``fragments`` and ``overlap`` are not used here).
        numel: the values averaged.
        cluster: the workers and links.
    """
    if not setting.hierarchical or cluster.per_node == 1:
        return _flat_traffic(setting.codec, numel, cluster.workers, cluster.per_node)
    g, nodes = cluster.per_node, cluster.nodes
    # Exact inside the node: a reduce-scatter and an all-gather of fp32 (the counter's
    # expression each); the codec's average of this rank's shard across nodes in between.
    inside = int((g - 1) / g * 4 * numel)
    shard = max(_shards(numel, g))
    across = _flat_traffic(setting.codec, shard, nodes, 1)
    cross_phases = tuple(
        Phase(p.name + " across nodes", "cross", g * p.link_bytes, p.rounds) for p in across.phases
    )
    phases = (
        Phase("reduce-scatter in node", "intra", inside, g - 1),
        *cross_phases,
        Phase("all-gather in node", "intra", inside, g - 1),
    )
    return Traffic(
        2 * inside + across.sent, 2 * inside + across.received, phases, across.encoded_floats
    )


def outer_traffic(setting: Setting, params: int, cluster: Cluster) -> Traffic:
    """One outer step's exchanges: one per fragment, the fragments of equal size.

    Args:
        setting: the exchange and its fragments.
        params: the model's parameters.
        cluster: the workers and links.
    """
    total = Traffic(0, 0, ())
    for size in _shards(params, setting.fragments):
        total = total + exchange_traffic(setting, size, cluster)
    return total


def alltoall_slowdown(nodes: int, contention: float = ALLTOALL_CONTENTION) -> float:
    """How many times its bytes' nominal time an all-to-all across ``nodes`` takes on the
    slow link: ``1 + contention (M-2)/(M-1)``.

    ``(M-2)/(M-1)`` is the burstiness (index of dispersion) of what reaches one node's link:
    ``M - 1`` senders, each paced to the rate by its own link and splitting its stream among
    ``M - 1`` destinations. Two nodes exchange one paced flow each way, as a ring does: no
    slowdown.

    Args:
        nodes: ``M``, the nodes the all-to-all crosses.
        contention: the throughput a fully bursty arrival (Poisson-like) costs, as a multiple
            of the bytes' nominal time (default :data:`ALLTOALL_CONTENTION`, fitted).

    Raises:
        ValueError: ``nodes`` below 1 or a negative ``contention``.
    """
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    if not contention >= 0:
        raise ValueError(f"contention must be >= 0 (0: no slowdown), got {contention!r}")
    return 1.0 + contention * max(0, nodes - 2) / max(1, nodes - 1)


def exchange_seconds(
    traffic: Traffic,
    cluster: Cluster,
    codec_ms_per_mb: float,
    alltoall_contention: float = ALLTOALL_CONTENTION,
) -> float:
    """Seconds of wire, latency and codec arithmetic of ``traffic``, one after the other; an
    all-to-all on the slow link at :func:`alltoall_slowdown` times its bytes' time.

    Args:
        traffic: from :func:`exchange_traffic` or :func:`outer_traffic`.
        cluster: the links.
        codec_ms_per_mb: the codec's cost per MB of float32 it encodes.
        alltoall_contention: as for :func:`alltoall_slowdown`.
    """
    seconds = codec_ms_per_mb * 1e-3 * 4 * traffic.encoded_floats / _MIB
    slowdown = alltoall_slowdown(cluster.nodes, alltoall_contention)
    for p in traffic.phases:
        if p.link == "cross":
            wire = 8 * p.link_bytes / cluster.link_bits_per_s
            seconds += wire * (slowdown if p.all_to_all else 1.0) + p.rounds * cluster.latency_s
        else:
            seconds += (
                8 * p.link_bytes / cluster.intra_bits_per_s + p.rounds * cluster.intra_latency_s
            )
    return seconds


def memory_parts(
    setting: Setting, params: int, cluster: Cluster, optimizer: str = "adam"
) -> dict[str, int]:
    """Bytes per GPU of each part SlowMo keeps, float32 parameters.

    Parameters, gradients, the base optimizer's state (``optimizer``: ``sgd`` none, ``momentum``
    one copy, ``adam`` two), the anchor and the slow momentum buffer (a copy each), the codec's
    error-feedback residual (a copy, of the node's shard when hierarchical; none for fp32), the
    outer step in flight (with ``overlap``: the sent copy and the snapshot of one fragment), and
    the codec's scratch (``hvd_slowmo.compression.averager``: kept and shared by the fragments,
    one fragment's buffer, its pseudo-gradient and then its mean, and a flat dense codec's
    packets of it).
    :func:`hvd_slowmo.memory.held_bytes` measures the kept parts of a running optimizer.

    Args:
        setting: the exchange.
        params: the model's parameters.
        cluster: the workers (a hierarchical residual covers ``1 / per_node``).
        optimizer: a key of :data:`OPTIMIZER_COPIES`.

    Raises:
        ValueError: an unknown optimizer.
    """
    if optimizer not in OPTIMIZER_COPIES:
        raise ValueError(f"optimizer={optimizer!r}: use one of {sorted(OPTIMIZER_COPIES)}")
    copy = 4 * params
    fragment = 4 * math.ceil(params / setting.fragments)
    compressed = setting.codec != "fp32"
    shard = cluster.per_node if setting.hierarchical else 1
    # Kept across outer steps and shared by the fragments (their averages run one at a time):
    # one fragment's buffer, the pseudo-gradient and then the mean; a flat dense codec's
    # packets too (every chunk's, and the reduced one). The encode's and decode's own
    # temporaries (a few slices, hvd_slowmo.compression.codecs.SLICE) are left out.
    scratch = fragment
    from .compression import CODECS, encoded_nbytes

    if setting.codec in CODECS and compressed and not setting.hierarchical:
        sizes = _shards(fragment // 4, cluster.workers)
        scratch += sum(encoded_nbytes(s, setting.codec) for s in sizes)
        scratch += encoded_nbytes(sizes[0], setting.codec)
    return {
        "parameters": copy,
        "gradients": copy,
        "optimizer state": OPTIMIZER_COPIES[optimizer] * copy,
        "anchor": copy,
        "slow buffer": copy,
        "residual": 4 * math.ceil(params / shard) if compressed else 0,
        "in flight": 2 * fragment if setting.overlap else 0,
        "codec scratch": scratch // shard if compressed else 0,
    }


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one setting.

    Attributes:
        setting: the setting.
        tau: base steps per outer period.
        iteration_s: predicted seconds per iteration.
        utilization: ``step_time / iteration_s``.
        exchange_s: seconds of one period's exchanges (wire, latency, codec), hidden or not.
        traffic: one outer step's traffic.
        memory: :func:`memory_parts`.
        link_load: the period's bytes on the slow link at its nominal rate, over the period's
            compute (``tau * step_time``); above 1 the link cannot carry them in the compute's
            time.
        warning: why the prediction is outside the calibrated regime (an all-to-all across
            more than :data:`ALLTOALL_CALIBRATED_NODES` nodes on a link loaded above
            :data:`ALLTOALL_LOAD_LIMIT`), or empty.
    """

    setting: Setting
    tau: int
    iteration_s: float
    utilization: float
    exchange_s: float
    traffic: Traffic
    memory: dict[str, int] = field(default_factory=dict)
    link_load: float = 0.0
    warning: str = ""


def predict(
    setting: Setting,
    params: int,
    step_time_s: float,
    tau: int,
    cluster: Cluster,
    codec_ms_per_mb: Mapping[str, float] | None = None,
    optimizer: str = "adam",
    codec_hidden: bool = True,
    alltoall_contention: float = ALLTOALL_CONTENTION,
) -> Prediction:
    """The time per iteration, utilization, bytes and memory of one setting.

    Args:
        setting: the exchange.
        params: the model's parameters.
        step_time_s: one base step's compute (forward, backward, optimizer step).
        tau: base steps per outer period.
        cluster: the workers and links.
        codec_ms_per_mb: the codecs' cost (default :data:`CODEC_MS_PER_MB`).
        optimizer: the base optimizer's kind (:func:`memory_parts`).
        codec_hidden: whether overlap hides the codec's arithmetic as it hides the wire (a
            codec on its own thread or stream); False where it takes its time from the
            compute (training on a CPU whose cores the codec shares).
        alltoall_contention: an all-to-all's slowdown on the slow link
            (:func:`alltoall_slowdown`; default :data:`ALLTOALL_CONTENTION`).

    Raises:
        ValueError: a bad tau, fragments or overlap (SlowMo's own limits), a non-positive
            step time or size, a codec without a cost.
    """
    costs = dict(CODEC_MS_PER_MB if codec_ms_per_mb is None else codec_ms_per_mb)
    _positive("step_time_s", step_time_s)
    if isinstance(params, bool) or not isinstance(params, int) or params < 1:
        raise ValueError(f"params must be an integer >= 1, got {params!r}")
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
        raise ValueError(f"tau must be an integer >= 1, got {tau!r}")
    if setting.fragments < 1 or not 0 <= setting.overlap < tau:
        raise ValueError(f"{setting.label}: need fragments >= 1 and 0 <= overlap < tau={tau}")
    if setting.fragments > 1 and setting.overlap > tau // setting.fragments:
        raise ValueError(
            f"{setting.label}: overlap must be <= tau // fragments = {tau // setting.fragments}"
        )
    if setting.codec not in costs:
        raise ValueError(
            f"codec {setting.codec!r} has no cost per MB; pass one (e.g. --codec-cost "
            f"{setting.codec}=1.0), known: {sorted(costs)}"
        )
    traffic = outer_traffic(setting, params, cluster)
    wire = exchange_seconds(traffic, cluster, costs[setting.codec], alltoall_contention)
    codec = exchange_seconds(
        Traffic(0, 0, (), traffic.encoded_floats), cluster, costs[setting.codec]
    )
    f, d = setting.fragments, setting.overlap
    hideable = wire if codec_hidden else wire - codec
    exposed = f * max(0.0, hideable / f - d * step_time_s) + (0.0 if codec_hidden else codec)
    iteration = step_time_s + exposed / tau
    cross = [p for p in traffic.phases if p.link == "cross"]
    load = 8 * sum(p.link_bytes for p in cross) / cluster.link_bits_per_s / (tau * step_time_s)
    warning = ""
    beyond = cluster.nodes > ALLTOALL_CALIBRATED_NODES
    if beyond and load > ALLTOALL_LOAD_LIMIT and any(p.all_to_all for p in cross):
        warning = (
            f"its all-to-all crosses {cluster.nodes} nodes on a slow link loaded to "
            f"{100 * load:.0f}% of the compute's time (above {100 * ALLTOALL_LOAD_LIMIT:.0f}%): "
            "outside the calibrated regime; its slowdown, fitted up to "
            f"{ALLTOALL_CALIBRATED_NODES} nodes, decides the time here and may be off"
        )
    return Prediction(
        setting,
        tau,
        iteration,
        step_time_s / iteration,
        wire,
        traffic,
        memory_parts(setting, params, cluster, optimizer),
        load,
        warning,
    )


def default_settings(
    tau: int,
    per_node: int,
    codecs: Sequence[str] = ("fp32", "int8", "sparse", "sparse-owners"),
) -> list[Setting]:
    """fp32, int8, sparse and sparse-owners (and, with several workers per node, int8 and
    sparse hierarchical),
    each without overlap, with ``overlap=1``, and streamed (``fragments=4, overlap=tau // 4``
    where ``tau >= 4``): the cluster benchmark's rows.

    Args:
        tau: base steps per outer period.
        per_node: workers per node.
        codecs: the flat codecs.
    """
    schedules = [(1, 0)] + ([(1, 1)] if tau > 1 else []) + ([(4, tau // 4)] if tau >= 4 else [])
    kinds = [(c, False) for c in codecs]
    if per_node > 1:
        kinds += [(c, True) for c in codecs if c in ("int8", "sparse")]
    return [Setting(c, h, f, d) for c, h in kinds for f, d in schedules]


#: The order of preference among settings of about the same speed: the least lossy first.
_PREFERENCE = ("fp32", "bf16", "fp16", "int8", "fp8", "sparse", "sparse-owners")


def recommend(predictions: Sequence[Prediction], within: float = 0.02) -> Prediction:
    """The setting to run: among the settings the optimizer runs (not the hierarchical ones
    with fragments, which it cannot run yet) and whose prediction is in the calibrated regime
    (no :attr:`Prediction.warning`), within ``within`` of the best utilization, the least
    lossy codec (fp32, then int8, then sparse), then the fewest fragments and the least
    overlap (the least staleness). Where every runnable setting carries a warning, among them.

    Args:
        predictions: from :func:`predict`.
        within: the utilization margin counted as "the same speed".
    """
    if not predictions:
        raise ValueError("recommend: no predictions")
    # The hierarchical exchange with fragments is predicted, never recommended: the optimizer's
    # hierarchical exchange takes the whole model.
    runnable = [p for p in predictions if p.setting.runnable] or list(predictions)
    # A prediction outside the calibrated regime may be far too fast: not recommended over one
    # inside it.
    runnable = [p for p in runnable if not p.warning] or runnable
    best = max(p.utilization for p in runnable)
    near = [p for p in runnable if p.utilization >= best - within]

    def rank(p: Prediction) -> tuple:
        order = _PREFERENCE.index(p.setting.codec) if p.setting.codec in _PREFERENCE else 99
        s = p.setting
        return (order, s.hierarchical, s.fragments, s.overlap, -p.utilization)

    return min(near, key=rank)


@dataclass(frozen=True)
class Measured:
    """One measured row of the emulated cluster (``benchmarks/cluster.py``).

    Args:
        hosts: workers, one per host.
        rate: the link rate, e.g. ``"100mbit"``.
        codec: ``"fp32"``, ``"int8"`` or ``"sparse"``.
        fragments: streaming's fragments.
        overlap: steps in flight.
        tau: base steps per outer period.
        params: the model's parameters.
        compute_ms: the compute-only row's ms per iteration, same run.
        measured_ms: the row's ms per iteration.
    """

    hosts: int
    rate: str
    codec: str
    fragments: int
    overlap: int
    tau: int
    params: int
    compute_ms: float
    measured_ms: float


def calibration_rows(
    rows: Sequence[Measured],
    codec_ms_per_mb: Mapping[str, float] | None = None,
    latency_s: float = 0.0,
    link_efficiency: float = 1.0,
    codec_hidden: bool = True,
    alltoall_contention: float = ALLTOALL_CONTENTION,
) -> list[tuple[Measured, Prediction]]:
    """Each measured row with the model's prediction, one host per node.

    Args:
        rows: measured rows.
        codec_ms_per_mb: the codecs' cost (default :data:`CODEC_MS_PER_MB`).
        latency_s: the emulated links' latency (the namespace cluster has none).
        link_efficiency: the fraction of the nominal rate the collectives reach (protocol
            overhead, the shaper's bursts): the rate the model is given is ``rate *
            link_efficiency``.
        codec_hidden: as for :func:`predict` (False: the codec shares the compute's cores, as
            on the emulated cluster's CPU).
        alltoall_contention: as for :func:`predict`.
    """
    if not 0 < link_efficiency <= 1:
        raise ValueError(f"link_efficiency must be in (0, 1], got {link_efficiency!r}")
    out = []
    for r in rows:
        rate = parse_rate(r.rate, "rate") * link_efficiency
        cluster = Cluster(r.hosts, 1, rate, latency_s)
        setting = Setting(r.codec, False, r.fragments, r.overlap)
        p = predict(
            setting, r.params, r.compute_ms / 1e3, r.tau, cluster, codec_ms_per_mb,
            codec_hidden=codec_hidden, alltoall_contention=alltoall_contention,
        )  # fmt: skip
        out.append((r, p))
    return out


def print_calibration(
    rows: Sequence[Measured],
    codec_ms_per_mb: Mapping[str, float] | None = None,
    latency_s: float = 0.0,
    link_efficiency: float = 1.0,
    codec_hidden: bool = True,
    alltoall_contention: float = ALLTOALL_CONTENTION,
    file=None,
) -> float:
    """Print predicted against measured ms per iteration as a Markdown table, with each row's
    link load (marked ``(!)`` where the prediction is outside the calibrated regime:
    :attr:`Prediction.warning`); returns the largest relative error over every row.

    Args:
        rows: measured rows.
        codec_ms_per_mb: the codecs' cost (default :data:`CODEC_MS_PER_MB`).
        latency_s: the links' latency.
        link_efficiency: as for :func:`calibration_rows`.
        codec_hidden: as for :func:`predict`.
        alltoall_contention: as for :func:`predict`.
        file: where to print (default stdout).
    """
    out = file or sys.stdout
    print("| hosts | rate | setting | params | compute ms | link load | predicted ms | "
          "measured ms | error |", file=out)  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|", file=out)
    worst = 0.0
    predictions = calibration_rows(
        rows, codec_ms_per_mb, latency_s, link_efficiency, codec_hidden, alltoall_contention
    )
    for r, p in predictions:
        predicted = 1e3 * p.iteration_s
        error = predicted / r.measured_ms - 1
        worst = max(worst, abs(error))
        load = f"{100 * p.link_load:.0f}%" + (" (!)" if p.warning else "")
        print(
            f"| {r.hosts} | {r.rate} | {p.setting.label} | {_human(r.params)} | "
            f"{r.compute_ms:.0f} | {load} | {predicted:.0f} | {r.measured_ms:.0f} | "
            f"{100 * error:+.1f}% |",
            file=out,
        )
    return worst


def _human(n: float, unit: str = "") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {prefix}{unit}".rstrip()
    return f"{n:.3g} {unit}".rstrip()


def _codec_costs(text: str | None) -> dict[str, float]:
    """``--codec-cost int8=0.05,sparse=0.2`` over the defaults, or one number for every codec."""
    costs = dict(CODEC_MS_PER_MB)
    try:  # one number: every codec's cost (e.g. 0 on a GPU, where the codecs hardly show)
        every = float(text or "")
    except ValueError:
        every = None
    if every is not None and every >= 0:
        return {name: every if name != "fp32" else 0.0 for name in costs}
    for item in filter(None, (text or "").split(",")):
        name, _, value = item.partition("=")
        try:
            cost = float(value)
        except ValueError:
            cost = -1.0
        if not name or cost < 0:
            raise ValueError(
                f"--codec-cost: {item!r} is not CODEC=MS_PER_MB with a number >= 0; e.g. "
                "'int8=0.05,sparse=0.2'"
            )
        costs[name.strip()] = cost
    return costs


def report(
    predictions: Sequence[Prediction],
    params: int,
    step_time_s: float,
    cluster: Cluster,
    codec_ms_per_mb: Mapping[str, float] | None = None,
    alltoall_contention: float = ALLTOALL_CONTENTION,
) -> str:
    """The planner's printout: one row per setting, the recommendation and its memory.

    Args:
        predictions: from :func:`predict`.
        params: the model's parameters.
        step_time_s: one base step's compute.
        cluster: the workers and links.
        codec_ms_per_mb: the codecs' cost used (printed; default :data:`CODEC_MS_PER_MB`).
        alltoall_contention: the all-to-all contention used (printed, with its slowdown across
            the cluster's nodes; default :data:`ALLTOALL_CONTENTION`).
    """
    costs = CODEC_MS_PER_MB if codec_ms_per_mb is None else codec_ms_per_mb
    used = ", ".join(f"{k} {v:g}" for k, v in costs.items() if k != "fp32")
    lines = [
        f"{_human(params)} parameters, {step_time_s * 1e3:.0f} ms per step, {cluster.workers} "
        f"workers ({cluster.nodes} nodes of {cluster.per_node}), link "
        f"{_human(cluster.link_bits_per_s, 'bit/s')}, latency {cluster.latency_s * 1e3:g} ms "
        "(predictions of the model in docs/planner.md)",
        f"codec cost, ms per MB of float32: {used}"
        + (
            " (the default: a CPU measurement; on GPUs pass --codec-cost)"
            if costs is CODEC_MS_PER_MB or dict(costs) == CODEC_MS_PER_MB
            else ""
        ),
        f"all-to-all across {cluster.nodes} nodes: "
        f"{alltoall_slowdown(cluster.nodes, alltoall_contention):.2f}x its bytes' time "
        f"(contention {alltoall_contention:g}"
        + (
            ": the default, fitted on the emulated cluster's shaped links; on other links pass "
            "--alltoall-contention)"
            if alltoall_contention == ALLTOALL_CONTENTION
            else ")"
        ),
        "",
        "| setting | tau | ms / iteration | utilization | link load | sent / worker / outer "
        "step | received | node egress | memory / GPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in predictions:
        egress = sum(ph.link_bytes for ph in p.traffic.phases if ph.link == "cross")
        lines.append(
            f"| {p.setting.label} | {p.tau} | {p.iteration_s * 1e3:.0f} | "
            f"{100 * p.utilization:.1f}% | {100 * p.link_load:.0f}%{' (!)' if p.warning else ''} "
            f"| {_human(p.traffic.sent, 'B')} | {_human(p.traffic.received, 'B')} | "
            f"{_human(egress, 'B')} | {_human(sum(p.memory.values()), 'B')} |"
        )
    best = recommend(predictions)
    parts = ", ".join(f"{k} {_human(v, 'B')}" for k, v in best.memory.items() if v)
    lines.append("")
    if any(p.warning for p in predictions):
        lines.append(
            f"(!) Outside the calibrated regime: an all-to-all across more than "
            f"{ALLTOALL_CALIBRATED_NODES} nodes on a link loaded above "
            f"{100 * ALLTOALL_LOAD_LIMIT:.0f}% (link load: the period's bytes on the slow link at "
            "its rate, over the period's compute). The model's all-to-all slowdown was fitted "
            f"on the emulated cluster up to {ALLTOALL_CALIBRATED_NODES} nodes, and here it "
            "decides the time: these rows are recommended only where no other runs."
        )
    lines += [
        f"Recommended: {best.setting.label}, tau={best.tau}: {best.iteration_s * 1e3:.0f} ms per "
        f"iteration, {100 * best.utilization:.1f}% utilization (the least lossy setting within "
        "2 points of the best)." + (f" Warning: {best.warning}." if best.warning else ""),
        f"Its arguments: DistributedOptimizer(..., {best.setting.arguments}, tau={best.tau}).",
        f"Memory per GPU: {parts}.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    """The command line (``python -m hvd_slowmo.plan --help``); prints and returns the report.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(
        prog="python -m hvd_slowmo.plan", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--params", required=True, help="model parameters, e.g. 1.3e9 or 350M")
    parser.add_argument("--step-time", required=True, help="one base step, e.g. 1.2 (s) or 800ms")
    parser.add_argument("--workers", required=True, type=int, help="workers (GPUs)")
    parser.add_argument("--per-node", type=int, default=1, help="workers per node (default 1)")
    parser.add_argument("--link", required=True, help="each node's link, e.g. 10gbit, 100mbit")
    parser.add_argument("--latency", default="0ms", help="per round on the link (default 0ms)")
    parser.add_argument("--intra-link", default="800gbit", help="inside a node (default 800gbit)")
    parser.add_argument("--tau", type=int, nargs="+", default=[12], help="steps per outer period")
    parser.add_argument(
        "--optimizer", default="adam", choices=sorted(OPTIMIZER_COPIES), help="for the memory"
    )
    parser.add_argument(
        "--codec-cost",
        default=None,
        help="ms per MB of float32 per codec, e.g. int8=0.05,sparse=0.2, or one number for "
        "all (default: this project's CPU measurement, hvd_slowmo.plan.CODEC_MS_PER_MB)",
    )
    parser.add_argument(
        "--alltoall-contention",
        type=float,
        default=ALLTOALL_CONTENTION,
        help="an all-to-all across M nodes takes 1 + C (M-2)/(M-1) times its bytes' time; 0: "
        "at the link's rate, as a ring (default: the emulated cluster's fit, "
        f"{ALLTOALL_CONTENTION:g})",
    )
    args = parser.parse_args(argv)
    params = parse_count(args.params, "--params")
    step = parse_duration(args.step_time, "--step-time")
    _positive("--step-time", step)
    if args.per_node > args.workers:  # checked here to name the command line's arguments
        raise ValueError(
            f"--per-node={args.per_node} is more workers per node than --workers="
            f"{args.workers}; use --per-node <= --workers"
        )
    cluster = Cluster(
        args.workers,
        args.per_node,
        parse_rate(args.link, "--link"),
        parse_duration(args.latency, "--latency"),
        parse_rate(args.intra_link, "--intra-link"),
    )
    costs = _codec_costs(args.codec_cost)
    if not args.alltoall_contention >= 0:
        raise ValueError(
            f"--alltoall-contention={args.alltoall_contention} must be >= 0 (0: an all-to-all "
            "at the link's rate)"
        )
    predictions = [
        predict(
            s, params, step, tau, cluster, costs, args.optimizer, True, args.alltoall_contention
        )
        for tau in args.tau
        for s in default_settings(tau, cluster.per_node)
    ]
    text = report(predictions, params, step, cluster, costs, args.alltoall_contention)
    print(text)
    return text


if __name__ == "__main__":
    try:
        main()
    except (ValueError, TypeError) as e:
        sys.exit(f"hvd_slowmo.plan: {e}")
