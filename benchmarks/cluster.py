"""Time per iteration of SlowMo and its bases on an emulated multi-host cluster (arXiv 1910.00643).

Builds N emulated hosts on this machine (one network namespace each, a veth to a Linux bridge in a
switch namespace, every link limited with ``tc tbf`` in both directions), runs one Horovod (Gloo)
worker per host, and measures in the same processes: compute only (the limit), Horovod's own
``hvd.DistributedOptimizer`` (AR-SGD), the peers PyTorch ships (DDP's AR-SGD and post-local SGD,
over ``torch.distributed`` with Gloo), and hvd_slowmo's algorithms. Prints a table shaped like the
paper's Table 2 (original vs with SlowMo), one of the peers beside hvd_slowmo's rows, writes the
raw numbers as JSON and TensorBoard scalars.

Needs root and ``ip netns``. Example (4 hosts, 1 Gbit/s links, synthetic 1M-parameter model)::

    sudo .venv/bin/python benchmarks/cluster.py --hosts 4 --rate 1gbit --workload synthetic \\
        --params 1M --compute-ms 190 --iters 24 --windows 2 --repeats 2 --nice -10 \\
        --out runs/cluster

(``--compute-ms`` sets the regime: there AR-SGD spends about a third of its time communicating.)
The peers against hvd_slowmo, 10M parameters and 1 s of compute, at 1 Gbit/s and 100 Mbit/s::

    sudo .venv/bin/python benchmarks/cluster.py --hosts 4 --rate 1gbit --rate 100mbit \\
        --params 10M --compute-ms 1000 --iters 12 --windows 2 --algorithms peers

The namespaces, links and ``/etc/netns`` files are removed afterwards, also on Ctrl-C / SIGTERM,
and stale ones from a crashed run with the same ``--prefix`` are removed before starting.
Only ratios measured within one run mean anything: all hosts share this machine's CPU cores.
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the cluster_* modules beside it

from cluster_algorithms import ALGORITHM_SETS, ALGORITHMS, select_algorithms
from cluster_report import (
    human,
    load_warning,
    plot_sweep,
    render_markdown,
    sweep_markdown,
    write_tensorboard,
)
from cluster_stats import summarize

__all__ = [
    "Host",
    "ClusterPlan",
    "parse_rate",
    "parse_count",
    "tbf_args",
    "plan_cluster",
    "setup_commands",
    "shaping_commands",
    "teardown_commands",
    "stale_namespaces",
    "hosts_file",
    "main",
]

NETNS_DIR = "/etc/netns"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_worker.py")


# --- parsing --------------------------------------------------------------------------------------
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(rate: str) -> int:
    """Bits per second of a ``tc`` rate such as ``"1gbit"`` or ``"100mbit"``.

    Args:
        rate: a number followed by ``bit``, ``kbit``, ``mbit``, ``gbit`` or ``tbit``.

    Raises:
        ValueError: anything else (``tc``'s byte units such as ``mbps`` are refused to avoid an 8x
            mistake).
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?bit)", str(rate).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"--rate must look like 1gbit, 100mbit or 500kbit (bits per second), got {rate!r}"
        )
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2)])


def parse_count(text: str) -> int:
    """Parameter count from ``"10M"``, ``"1.5M"``, ``"500k"`` or ``"123456"``.

    Args:
        text: the count, with an optional ``k``/``M``/``G`` suffix.
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", str(text).strip())
    if not m:
        raise ValueError(f"--params entries must look like 1M, 10M, 500k or 123456, got {text!r}")
    value = int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()])
    if value < 1:
        raise ValueError(f"--params entries must be at least 1 parameter, got {text!r}")
    return value


# --- the cluster plan -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    """One emulated host.

    Args:
        rank: its Horovod rank.
        netns: its network namespace.
        hostname: the name Horovod knows it by.
        address: its IPv4 address on the bridge (``eth0`` inside the namespace).
        port: its veth end in the switch namespace (shaped for the host's download direction).
        peer: the veth end created in the root namespace, then moved in and renamed ``eth0``.
    """

    rank: int
    netns: str
    hostname: str
    address: str
    port: str
    peer: str


@dataclass(frozen=True)
class ClusterPlan:
    """Every name and address of one emulated cluster (pure data: building it touches nothing).

    Args:
        prefix: the prefix of every namespace, link and ``/etc/netns`` entry it creates.
        hosts: the hosts, in rank order.
        switch: the switch namespace holding the bridge ``br0``.
        control: the root-namespace end of an unshaped link to the bridge (rendezvous traffic).
        control_peer: that link's end on the bridge.
        control_address: the root namespace's address on the bridge (the rendezvous server).
        prefix_len: the subnet's prefix length.
    """

    prefix: str
    hosts: tuple[Host, ...]
    switch: str
    control: str
    control_peer: str
    control_address: str
    prefix_len: int = 24


def plan_cluster(num_hosts: int, prefix: str = "hsmc", subnet: str = "10.77.0") -> ClusterPlan:
    """Names and addresses for ``num_hosts`` hosts.

    Args:
        num_hosts: number of hosts (2 to 250).
        prefix: 1 to 8 lowercase letters or digits, starting with a letter (link names are capped
            at 15 characters by the kernel).
        subnet: the first three octets of a free /24, e.g. ``"10.77.0"``.
    """
    if isinstance(num_hosts, bool) or not isinstance(num_hosts, int) or not 2 <= num_hosts <= 250:
        raise ValueError(f"--hosts must be an integer in [2, 250], got {num_hosts!r}")
    if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
        raise ValueError(
            f"--prefix must be 1-8 lowercase letters/digits starting with a letter, got {prefix!r}"
        )
    if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet) or any(
        int(o) > 255 for o in subnet.split(".")
    ):
        raise ValueError(f"--subnet must be three octets such as 10.77.0, got {subnet!r}")
    hosts = tuple(
        Host(
            rank=i,
            netns=f"{prefix}-h{i}",
            hostname=f"{prefix}h{i}",
            address=f"{subnet}.{i + 1}",
            port=f"{prefix}p{i}",
            peer=f"{prefix}v{i}",
        )
        for i in range(num_hosts)
    )
    return ClusterPlan(
        prefix=prefix,
        hosts=hosts,
        switch=f"{prefix}-sw",
        control=f"{prefix}c0",
        control_peer=f"{prefix}c1",
        control_address=f"{subnet}.254",
    )


def setup_commands(plan: ClusterPlan) -> list[list[str]]:
    """The ``ip`` commands that build the cluster, in order (no shaping yet).

    Args:
        plan: from :func:`plan_cluster`.
    """
    sw = plan.switch
    cmds = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", sw, "link", "set", "br0", "up"],
    ]
    for h in plan.hosts:
        cmds += [
            ["ip", "netns", "add", h.netns],
            ["ip", "-n", h.netns, "link", "set", "lo", "up"],
            ["ip", "link", "add", h.peer, "type", "veth", "peer", "name", h.port],
            ["ip", "link", "set", h.port, "netns", sw],
            ["ip", "-n", sw, "link", "set", h.port, "master", "br0"],
            ["ip", "-n", sw, "link", "set", h.port, "up"],
            ["ip", "link", "set", h.peer, "netns", h.netns],
            # Every host calls its link eth0, so HOROVOD_GLOO_IFACE is the same everywhere.
            ["ip", "-n", h.netns, "link", "set", h.peer, "name", "eth0"],
            ["ip", "-n", h.netns, "addr", "add", f"{h.address}/{plan.prefix_len}", "dev", "eth0"],
            ["ip", "-n", h.netns, "link", "set", "eth0", "up"],
        ]
    # The root namespace joins the bridge on an unshaped link, for the rendezvous server only.
    cmds += [
        ["ip", "link", "add", plan.control, "type", "veth", "peer", "name", plan.control_peer],
        ["ip", "link", "set", plan.control_peer, "netns", sw],
        ["ip", "-n", sw, "link", "set", plan.control_peer, "master", "br0"],
        ["ip", "-n", sw, "link", "set", plan.control_peer, "up"],
        ["ip", "addr", "add", f"{plan.control_address}/{plan.prefix_len}", "dev", plan.control],
        ["ip", "link", "set", plan.control, "up"],
    ]
    return cmds


def tbf_args(rate: str, latency_ms: int = 50) -> list[str]:
    """``tc`` arguments of a token-bucket filter limiting a link to ``rate``.

    The bucket holds 4 ms of traffic (at least 128 KiB): ``tbf`` needs at least ``rate / HZ``
    bytes (HZ up to 250) and more than one 64 KiB GSO packet, or it drops instead of shaping.

    Args:
        rate: e.g. ``"1gbit"`` (validated by :func:`parse_rate`).
        latency_ms: the longest a packet may queue before being dropped.
    """
    bits = parse_rate(rate)
    burst = max(bits // 8 // 250, 128 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", f"{latency_ms}ms"]


def shaping_commands(plan: ClusterPlan, rate: str) -> list[list[str]]:
    """Commands that limit each host's link to ``rate`` in both directions.

    Any earlier limit is replaced.

    Args:
        plan: from :func:`plan_cluster`.
        rate: e.g. ``"1gbit"``.
    """
    tbf = tbf_args(rate)
    cmds = []
    for h in plan.hosts:
        # Host egress is the upload, the switch port's egress the download: tbf shapes egress only.
        cmds.append(
            ["ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", "eth0", "root", *tbf]
        )
        cmds.append(
            [
                "ip",
                "netns",
                "exec",
                plan.switch,
                "tc",
                "qdisc",
                "replace",
                "dev",
                h.port,
                "root",
                *tbf,
            ]
        )
    return cmds


def teardown_commands(plan: ClusterPlan) -> list[list[str]]:
    """Commands that remove everything :func:`setup_commands` built (each may fail if already gone).

    Deleting a namespace deletes the veths in it, and with them their peers.

    Args:
        plan: from :func:`plan_cluster`.
    """
    return [["ip", "netns", "del", h.netns] for h in plan.hosts] + [
        ["ip", "netns", "del", plan.switch],
        ["ip", "link", "del", plan.control],
    ]


def stale_namespaces(netns_list_output: str, prefix: str) -> list[str]:
    """The namespaces in ``ip netns list`` output that a run with ``prefix`` created.

    Args:
        netns_list_output: the text ``ip netns list`` printed (``name`` or ``name (id: N)`` per
            line).
        prefix: the run's prefix.
    """
    names = [line.split()[0] for line in netns_list_output.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(rf"{re.escape(prefix)}-(h\d+|sw)", n)]


def hosts_file(plan: ClusterPlan, host: Host, machine_hostname: str) -> str:
    """Contents of ``/etc/netns/<netns>/hosts`` for ``host``.

    Horovod 0.28.1 builds its Gloo process-set contexts from the machine's host name, ignoring
    ``HOROVOD_GLOO_IFACE``; inside a namespace that name resolves to 127.0.0.1 and peers get
    "connection refused". Mapping it to the host's own bridge address fixes it
    (``ip netns exec`` bind-mounts this file over ``/etc/hosts``).

    Args:
        plan: from :func:`plan_cluster`.
        host: the host whose file this is.
        machine_hostname: ``socket.gethostname()`` (shared by every namespace).
    """
    lines = ["127.0.0.1 localhost", f"{host.address} {machine_hostname} {host.hostname}"]
    lines += [f"{h.address} {h.hostname}" for h in plan.hosts if h is not host]
    return "\n".join(lines) + "\n"


def worker_env(plan: ClusterPlan, host: Host, rendezvous_port: int) -> dict[str, str]:
    """The environment Horovod's own Gloo launcher would give ``host``'s worker, plus where
    ``torch.distributed`` finds its interface and rank 0 (its port is chosen there at run time).

    Args:
        plan: from :func:`plan_cluster`.
        host: the host the worker runs on.
        rendezvous_port: the port of the rendezvous server at ``plan.control_address``.
    """
    n = str(len(plan.hosts))
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": plan.control_address,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "eth0",
        "HOROVOD_HOSTNAME": host.hostname,
        "HOROVOD_RANK": str(host.rank),
        "HOROVOD_SIZE": n,
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": str(host.rank),
        "HOROVOD_CROSS_SIZE": n,
        # torch.distributed (the PyTorch peers): Gloo on the shaped link, its store on rank 0.
        "GLOO_SOCKET_IFNAME": "eth0",
        "MASTER_ADDR": plan.hosts[0].address,
        # One thread per worker: the hosts share the machine's cores.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


# --- running it (root only) -----------------------------------------------------------------------
def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class Cluster:
    """Builds the plan's namespaces and links, and removes them again (also after a crash).

    Args:
        plan: from :func:`plan_cluster`.
    """

    def __init__(self, plan: ClusterPlan) -> None:
        self.plan = plan
        self.workers: list[subprocess.Popen] = []
        self._made_netns_dir = False

    def clean_stale(self) -> list[str]:
        """Remove what an earlier run with the same prefix left behind; returns what was found."""
        found = stale_namespaces(_run(["ip", "netns", "list"]).stdout, self.plan.prefix)
        for ns in found:
            _run(["ip", "netns", "del", ns], check=False)
        if _run(["ip", "link", "show", self.plan.control], check=False).returncode == 0:
            _run(["ip", "link", "del", self.plan.control], check=False)
            found.append(self.plan.control)
        if os.path.isdir(NETNS_DIR):
            for d in os.listdir(NETNS_DIR):
                if re.fullmatch(rf"{re.escape(self.plan.prefix)}-(h\d+|sw)", d):
                    shutil.rmtree(os.path.join(NETNS_DIR, d), ignore_errors=True)
                    found.append(os.path.join(NETNS_DIR, d))
        return found

    def build(self, rate: str) -> None:
        """Create the namespaces, links, addresses and ``/etc/netns`` host files; shape to ``rate``.

        Args:
            rate: the link rate, e.g. ``"1gbit"``.
        """
        for cmd in setup_commands(self.plan):
            self._checked(cmd)
        machine = socket.gethostname()
        self._made_netns_dir = not os.path.isdir(NETNS_DIR)
        for h in self.plan.hosts:
            os.makedirs(os.path.join(NETNS_DIR, h.netns), exist_ok=True)
            with open(os.path.join(NETNS_DIR, h.netns, "hosts"), "w") as f:
                f.write(hosts_file(self.plan, h, machine))
        self.shape(rate)

    def shape(self, rate: str) -> None:
        """Limit every link to ``rate`` in both directions.

        Args:
            rate: e.g. ``"100mbit"``.
        """
        for cmd in shaping_commands(self.plan, rate):
            self._checked(cmd)

    @staticmethod
    def _checked(cmd: list[str]) -> None:
        r = _run(cmd, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")

    def stop_workers(self) -> None:
        """Terminate the worker process groups this object started (then kill what is left)."""
        for p in self.workers:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in self.workers:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.workers = []

    def teardown(self) -> None:
        """Stop the workers, delete the namespaces and links, remove the ``/etc/netns`` files."""
        self.stop_workers()
        for cmd in teardown_commands(self.plan):
            _run(cmd, check=False)
        for h in self.plan.hosts:
            shutil.rmtree(os.path.join(NETNS_DIR, h.netns), ignore_errors=True)
        if self._made_netns_dir and os.path.isdir(NETNS_DIR) and not os.listdir(NETNS_DIR):
            os.rmdir(NETNS_DIR)  # leave the machine as it was


def _terminate(signum: int, frame: Any) -> None:
    # Turn SIGTERM/SIGHUP into an exception so the finally-block teardown runs.
    print(f"signal {signum}: tearing the cluster down", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _launch(cluster: Cluster, worker_args: list[str], timeout_s: float, nice: int) -> None:
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    plan = cluster.plan
    server = RendezvousServer(verbose=0)
    port = server.start()
    try:
        spec = ",".join(f"{h.hostname}:1" for h in plan.hosts)
        server.init(get_host_assignments(parse_hosts(spec), len(plan.hosts)))
        for h in plan.hosts:
            env = {**os.environ, **worker_env(plan, h, port)}
            cmd = [
                "ip",
                "netns",
                "exec",
                h.netns,
                "nice",
                "-n",
                str(nice),
                sys.executable,
                WORKER,
                *worker_args,
            ]
            # Own process group: teardown can end the worker and anything it started, and only that.
            cluster.workers.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in cluster.workers):
            failed = [p for p in cluster.workers if p.returncode not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"a worker exited with code {failed[0].returncode}; see its output above"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers still running after --timeout {timeout_s:.0f} s")
            time.sleep(0.2)
        codes = [p.returncode for p in cluster.workers]
        if any(codes):
            raise RuntimeError(f"worker exit codes {codes}; see their output above")
        cluster.workers = []
    finally:
        server.stop()


def _measure(
    cluster: Cluster,
    args: argparse.Namespace,
    rates: list[str],
    workloads: list[dict[str, Any]],
    algos: list[str],
    command: list[str],
) -> list[dict[str, Any]]:
    """Build ``cluster`` and measure every workload at every rate on it (the caller tears it
    down).

    Args:
        cluster: the emulated cluster (not built yet).
        args: the parsed command line.
        rates: the link rates.
        workloads: the workload specs.
        algos: the algorithm keys.
        command: the command line, for the report.
    """
    hosts = len(cluster.plan.hosts)
    stale = cluster.clean_stale()
    if stale:
        print(f"removed leftovers of an earlier run: {stale}", flush=True)
    cluster.build(rates[0])
    runs = []
    for rate in rates:
        cluster.shape(rate)
        for wl in workloads:
            back = f"_bw{100 * wl.get('backward_fraction', 0):.0f}"
            raw = os.path.join(
                args.out, f"raw_{wl['workload']}_{wl.get('params', 0)}_{rate}{back}_h{hosts}.json"
            )
            spec = {
                **wl,
                "algorithms": algos,
                "iters": args.iters,
                "windows": args.windows,
                "repeats": args.repeats,
                "batch_size": args.batch_size,
                "output": os.path.abspath(raw),
            }
            size = f" {human(wl['params'])}" if "params" in wl else ""
            # Other work on the machine stretches and scatters the times: say how much there was.
            load_before = os.getloadavg()[0]
            print(
                f"== {wl['workload']}{size} at {rate}: {len(algos)} algorithms on {hosts} hosts "
                f"(1-minute load average {load_before:.2f})",
                flush=True,
            )
            if warning := load_warning(load_before, None):
                print(f"!!! {warning}", flush=True)
            _launch(cluster, ["--spec", json.dumps(spec)], args.timeout, args.nice)
            load_after = os.getloadavg()[0]
            print(f"   1-minute load average after: {load_after:.2f}", flush=True)
            if warning := load_warning(load_before, load_after):
                print(f"!!! {warning}", flush=True)
            with open(raw) as f:
                measured = json.load(f)
            header = {
                **measured["header"],
                "hosts": hosts,
                "rate": rate,
                "rate_bits_per_s": parse_rate(rate),
                "tbf": " ".join(tbf_args(rate)),
                "cpu_cores": os.cpu_count(),
                "nice": args.nice,
                "load_avg_1min": [load_before, load_after],
                "command": " ".join(command),
            }
            header["params_human"] = human(header["params"])
            run = {"header": header, "results": measured["results"]}
            run["summary"] = summarize(
                {k: v for k, v in run["results"].items() if v.get("available", True)}
            )
            runs.append(run)
            print(render_markdown(run), flush=True)
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, build the cluster, measure, report, tear down.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--hosts",
        default="4",
        help="emulated hosts, one Horovod worker each; several (2,4,8) sweep them: the same rows "
        "at each count, plotted as ms/iteration vs workers (sweep_*.png, sweep.md)",
    )
    p.add_argument(
        "--rate", action="append", help="link rate, tc syntax (repeatable): 1gbit, 100mbit"
    )
    p.add_argument(
        "--workload", choices=["synthetic", "resnet18", "transformer"], default="synthetic"
    )
    p.add_argument(
        "--params", default="10M", help="synthetic model sizes, comma separated: 1M,10M,50M"
    )
    p.add_argument(
        "--compute-ms",
        default="100",
        help="synthetic compute per iteration (sleep), one value or one per --params entry",
    )
    p.add_argument(
        "--backward-fraction",
        type=float,
        default=0.0,
        help="share of the synthetic compute slept inside the backward pass, between layers, so "
        "gradient-ready hooks fire while it goes on (0: all before a cheap backward)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=48,
        help="timed iterations per algorithm (raised to at least --windows outer periods)",
    )
    p.add_argument(
        "--windows", type=int, default=3, help="minimum timed outer periods per algorithm"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the whole list this often, in alternating order (cancels slow drift)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="batch size of the resnet18/transformer workloads"
    )
    p.add_argument(
        "--algorithms",
        default="all",
        help="comma-separated keys or sets, measured in the order listed here; sets: "
        + ", ".join(ALGORITHM_SETS)
        + "; keys: "
        + ", ".join(a.key for a in ALGORITHMS),
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling priority of the workers (-20..19); negative keeps other load on a shared "
        "machine from queueing their short CPU bursts",
    )
    p.add_argument("--prefix", default="hsmc", help="prefix of every namespace and link created")
    p.add_argument("--subnet", default="10.77.0", help="a free /24 for the emulated hosts")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds before the workers are killed"
    )
    p.add_argument(
        "--out", default="runs/cluster", help="output folder: results.json, table.md, tensorboard/"
    )
    args = p.parse_args(argv)
    command = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)]

    rates = args.rate or ["1gbit"]
    for r in rates:
        parse_rate(r)
    sizes = [parse_count(s) for s in args.params.split(",")]
    compute = [float(c) for c in args.compute_ms.split(",")]
    if len(compute) not in (1, len(sizes)):
        p.error(
            f"--compute-ms needs one value or one per --params entry ({len(sizes)}), "
            f"got {len(compute)}"
        )
    if any(c < 0 for c in compute):
        p.error("--compute-ms must be >= 0")
    compute = compute * len(sizes) if len(compute) == 1 else compute
    try:
        algos = select_algorithms(args.algorithms)
    except ValueError as e:
        p.error(str(e))
    if not -20 <= args.nice <= 19:
        p.error(f"--nice must be in [-20, 19], got {args.nice}")
    if args.iters < 1 or args.windows < 1 or args.repeats < 1:
        p.error("--iters, --windows and --repeats must be >= 1")
    if not 0.0 <= args.backward_fraction < 1.0:
        p.error(f"--backward-fraction must be in [0, 1), got {args.backward_fraction}")
    try:
        host_counts = [int(n) for n in args.hosts.split(",")]
        plans = [plan_cluster(n, args.prefix, args.subnet) for n in host_counts]
    except ValueError as e:
        p.error(f"--hosts: {e}")
    if os.geteuid() != 0:
        print(
            "cluster.py needs root (network namespaces and tc); rerun with sudo.", file=sys.stderr
        )
        return 2
    if shutil.which("ip") is None or shutil.which("tc") is None:
        print("cluster.py needs the `ip` and `tc` tools (iproute2).", file=sys.stderr)
        return 2

    workloads = (
        [
            {"workload": "synthetic", "params": n, "compute_ms": c}
            | {"backward_fraction": args.backward_fraction}
            for n, c in zip(sizes, compute)
        ]
        if args.workload == "synthetic"
        else [{"workload": args.workload, "compute_ms": None}]
    )
    os.makedirs(args.out, exist_ok=True)
    old_handlers = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    runs: list[dict[str, Any]] = []
    try:
        for plan in plans:
            cluster = Cluster(plan)
            try:
                runs += _measure(cluster, args, rates, workloads, algos, command)
            finally:
                cluster.teardown()
    except KeyboardInterrupt:
        print("interrupted: tearing the cluster down", file=sys.stderr)
        return 130
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(runs, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(render_markdown(r) for r in runs))
    write_tensorboard(os.path.join(args.out, "tensorboard"), runs)
    wrote = "results.json, table.md, tensorboard/"
    if len(host_counts) > 1:
        with open(os.path.join(args.out, "sweep.md"), "w") as f:
            f.write(sweep_markdown(runs))
        print(sweep_markdown(runs), flush=True)
        pngs = plot_sweep(runs, args.out)
        wrote += ", sweep.md, " + ", ".join(os.path.basename(p) for p in pngs)
    print(f"wrote {args.out}/: {wrote}", flush=True)
    warnings = [w for r in runs if (w := load_warning(*r["header"]["load_avg_1min"]))]
    if warnings:
        print(
            f"\n!!! {len(warnings)} of {len(runs)} runs on a busy machine: {warnings[0]}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
