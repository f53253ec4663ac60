"""An emulated multi-host cluster on one Linux machine, for Horovod (Gloo) jobs: one network
namespace per host, a veth from each host to a Linux bridge in a switch namespace, every link
shaped with ``tc`` in both directions, and Horovod's rendezvous server in the root namespace on
an unshaped link. Used by ``benchmarks/cluster.py`` (time per iteration) and
``examples/compare.py --network`` (time to accuracy).

    plan = plan_cluster(4, prefix="hsmn", subnet="10.77.2")
    cluster = Cluster(plan)
    try:
        cluster.clean_stale()
        cluster.build("100mbit")
        cluster.run([sys.executable, "train.py", "--epochs", "3"], timeout_s=600)
    finally:
        cluster.teardown()

Needs root, ``ip`` and ``tc`` (iproute2); :func:`missing_requirements` says what is missing.
A link's rate comes from a token-bucket filter (``tbf``); a delay needs the kernel's ``netem``
queueing discipline (``sch_netem``), which not every kernel has: :func:`netem_available` probes
for it, and nothing emulates a delay without it. All hosts share the machine's CPU cores.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NETNS_DIR",
    "Host",
    "ClusterPlan",
    "parse_rate",
    "parse_network",
    "plan_cluster",
    "setup_commands",
    "tbf_args",
    "shaping_commands",
    "teardown_commands",
    "stale_namespaces",
    "hosts_file",
    "worker_env",
    "missing_requirements",
    "netem_available",
    "Cluster",
]

#: Where ``ip netns exec NAME`` finds files it bind-mounts over ``/etc`` (``NAME/hosts``).
NETNS_DIR = "/etc/netns"

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


def parse_network(spec: str) -> tuple[str, float]:
    """``"100mbit,20ms"`` -> ``("100mbit", 20.0)``; ``"100mbit"`` -> ``("100mbit", 0.0)``.

    Args:
        spec: a link rate (:func:`parse_rate`), optionally followed by a comma and the one-way
            delay between two hosts in ms (``20ms``; the round trip is twice that).

    Raises:
        ValueError: a bad rate or delay.
    """
    parts = [p.strip() for p in str(spec).split(",")]
    if len(parts) not in (1, 2) or not parts[0]:
        raise ValueError(
            f"--network must be RATE or RATE,DELAY, e.g. 100mbit or 100mbit,20ms, got {spec!r}"
        )
    try:
        parse_rate(parts[0])
    except ValueError:
        raise ValueError(
            f"--network: the rate must look like 1gbit, 100mbit or 500kbit (bits per second), "
            f"got {parts[0]!r} in {spec!r}"
        ) from None
    if len(parts) == 1:
        return parts[0].lower(), 0.0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)ms", parts[1].lower())
    if not m:
        raise ValueError(
            f"--network: the delay must be milliseconds such as 20ms, got {parts[1]!r} in {spec!r}"
        )
    return parts[0].lower(), float(m.group(1))


# --- the plan (pure data) -----------------------------------------------------------------------
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


def shaping_commands(plan: ClusterPlan, rate: str, delay_ms: float = 0.0) -> list[list[str]]:
    """Commands that limit each host's link to ``rate`` in both directions, and with
    ``delay_ms`` hold every packet that long between two hosts (``netem`` on each of the two
    links a packet crosses, half the delay on each, the ``tbf`` below it).

    Any earlier limit and delay is replaced.

    Args:
        plan: from :func:`plan_cluster`.
        rate: e.g. ``"1gbit"``.
        delay_ms: one-way delay from host to host (0: none; needs :func:`netem_available`).
    """
    if not (delay_ms >= 0 and delay_ms < 60_000):
        raise ValueError(f"delay_ms must be in [0, 60000) ms, got {delay_ms!r}")
    tbf = tbf_args(rate)
    cmds = []
    for h in plan.hosts:
        # A packet crosses its sender's egress (the upload) and its receiver's switch port's
        # egress (the download): tbf and netem shape egress only, so both are set, and each
        # holds half the delay.
        for ns, dev in ((h.netns, "eth0"), (plan.switch, h.port)):
            tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev]
            if delay_ms > 0:
                cmds.append([*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms / 2:g}ms"])
                cmds.append([*tc, "parent", "1:1", "handle", "10:", *tbf])
            else:
                cmds.append([*tc, "root", *tbf])
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
    return [n for n in names if re.fullmatch(rf"{re.escape(prefix)}-(h\d+|sw|probe)", n)]


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


# --- the machine ---------------------------------------------------------------------------------
def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def missing_requirements() -> str | None:
    """Why no emulated cluster can be built here (None: it can): not root, no ``ip``/``tc``, or
    ``ip netns`` not working."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces and tc); rerun as root or with sudo"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"it needs iproute2's {' and '.join(missing)}, not found on PATH"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip() or probe.returncode}"
    return None


def netem_available(prefix: str = "hsmc") -> tuple[bool, str]:
    """Whether this kernel has ``netem`` (tried on a scratch namespace's loopback); root only.

    Args:
        prefix: the scratch namespace is ``<prefix>-probe`` (removed again).

    Returns:
        (available, ``tc``'s error message when not).
    """
    ns = f"{prefix}-probe"
    _run(["ip", "netns", "del", ns], check=False)
    made = _run(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        return False, made.stderr.strip()
    try:
        r = _run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem"],
            check=False,
        )
        return r.returncode == 0, r.stderr.strip()
    finally:
        _run(["ip", "netns", "del", ns], check=False)


class Cluster:
    """Builds a plan's namespaces and links, runs one Horovod (Gloo) worker per host, and removes
    everything again (also what a crashed run with the same prefix left).

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

    def build(self, rate: str, delay_ms: float = 0.0) -> None:
        """Create the namespaces, links, addresses and ``/etc/netns`` host files; shape the links.

        Args:
            rate: the link rate, e.g. ``"1gbit"``.
            delay_ms: one-way delay between hosts (see :func:`shaping_commands`).
        """
        for cmd in setup_commands(self.plan):
            self._checked(cmd)
        machine = socket.gethostname()
        self._made_netns_dir = not os.path.isdir(NETNS_DIR)
        for h in self.plan.hosts:
            os.makedirs(os.path.join(NETNS_DIR, h.netns), exist_ok=True)
            with open(os.path.join(NETNS_DIR, h.netns, "hosts"), "w") as f:
                f.write(hosts_file(self.plan, h, machine))
        self.shape(rate, delay_ms)

    def shape(self, rate: str, delay_ms: float = 0.0) -> None:
        """Limit every link to ``rate`` in both directions (and delay it, see
        :func:`shaping_commands`).

        Args:
            rate: e.g. ``"100mbit"``.
            delay_ms: one-way delay between hosts.
        """
        for cmd in shaping_commands(self.plan, rate, delay_ms):
            self._checked(cmd)

    @staticmethod
    def _checked(cmd: list[str]) -> None:
        r = _run(cmd, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")

    @contextmanager
    def rendezvous(self) -> Iterator[int]:
        """Horovod's rendezvous server for one launch, listening in the root namespace; yields
        its port (give it to :meth:`start_workers`)."""
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer

        server = RendezvousServer(verbose=0)
        port = server.start()
        try:
            spec = ",".join(f"{h.hostname}:1" for h in self.plan.hosts)
            server.init(get_host_assignments(parse_hosts(spec), len(self.plan.hosts)))
            yield port
        finally:
            server.stop()

    def start_workers(
        self,
        argv: Sequence[str],
        port: int,
        nice: int = 0,
        popen_kwargs: Callable[[Host], dict[str, Any]] | None = None,
    ) -> list[subprocess.Popen]:
        """Start ``argv`` once per host, inside its namespace, as its Horovod rank.

        Args:
            argv: the worker's command (e.g. ``[sys.executable, "train.py", ...]``).
            port: the rendezvous server's port (:meth:`rendezvous`).
            nice: the workers' scheduling priority (-20..19).
            popen_kwargs: per host, more ``subprocess.Popen`` arguments (e.g. ``stdout``);
                default: the workers share this process's output.
        """
        if not -20 <= nice <= 19:
            raise ValueError(f"nice must be in [-20, 19], got {nice}")
        for h in self.plan.hosts:
            env = {**os.environ, **worker_env(self.plan, h, port)}
            cmd = ["ip", "netns", "exec", h.netns, "nice", "-n", str(nice), *argv]
            extra = popen_kwargs(h) if popen_kwargs else {}
            # Own process group: teardown can end the worker and anything it started, and only that.
            self.workers.append(subprocess.Popen(cmd, env=env, start_new_session=True, **extra))
        return self.workers

    def wait_workers(self, timeout_s: float) -> None:
        """Wait for every worker to exit 0; on the first failure or after ``timeout_s`` seconds,
        stop them all and raise (a worker left alone would wait forever in a collective).

        Args:
            timeout_s: seconds from now.

        Raises:
            RuntimeError: a worker failed, or the time ran out.
        """
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self.workers):
            failed = [p for p in self.workers if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                self.stop_workers()
                raise RuntimeError(f"a worker exited with code {code}; see its output")
            if time.monotonic() > deadline:
                self.stop_workers()
                raise RuntimeError(f"workers still running after {timeout_s:.0f} s: stopped")
            time.sleep(0.2)
        codes = [p.returncode for p in self.workers]
        self.workers = []
        if any(codes):
            raise RuntimeError(f"worker exit codes {codes}; see their output")

    def run(self, argv: Sequence[str], timeout_s: float, nice: int = 0) -> None:
        """Start ``argv`` on every host (:meth:`start_workers`) and wait for all of them
        (:meth:`wait_workers`); their output goes to this process's.

        Args:
            argv: the worker's command.
            timeout_s: seconds before the workers are stopped.
            nice: the workers' scheduling priority.
        """
        with self.rendezvous() as port:
            self.start_workers(argv, port, nice)
            self.wait_workers(timeout_s)

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
