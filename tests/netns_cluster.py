"""A Ray cluster of several "hosts" on one machine: one Linux network namespace per
host, joined by a bridge, each host a Ray node with its own address and resources.

Each host is a network namespace ``rlxmh<tag>-<name>`` with its own loopback and an
``eth0`` (a veth pair) plugged into a bridge that lives in a namespace of its own
(``rlxmh<tag>-switch``), so nothing of the machine's own network is touched: the hosts
reach each other over ``10.<a>.<b>.0/24`` and nothing else. The first host runs Ray's
head (GCS and a raylet); every other host runs a Ray worker node that joins it, each
bound to its namespace's address (``--node-ip-address``), so Ray's object transfers,
``jax.distributed``'s coordinator and gloo's collectives between hosts go over the
virtual network. ``/etc/netns/<namespace>/hosts`` maps this machine's host name to the
namespace's address (``ip netns exec`` mounts it over ``/etc/hosts``), so a process
that asks "what is my address" (gloo does) gets the host's, not ``127.0.0.1``.

Every process a host runs (Ray's node, the actors it starts, a driver started with
:meth:`NetnsCluster.popen`) lives in its namespace, so :meth:`NetnsCluster.kill_host`
ends all of them (``ip netns pids``): that is node loss, not one actor's death.
:meth:`NetnsCluster.close` kills every process of every namespace, deletes the
namespaces (their veth links go with them) and the files under ``/etc/netns``, even
after a failure half-way through :meth:`NetnsCluster.start`.

Ray's session files go to a short temporary directory of the cluster's own (``--temp-dir``
on every node), so a concurrent local Ray cluster (``/tmp/ray``, the root namespace's
ports) never meets this one. ``/dev/shm`` is the machine's: each node's object store
is its own file there, and a transfer between nodes still goes through the nodes'
object managers over the network.

Run alone, it starts a three-host cluster, prints its nodes and tears it down::

    sudo RAY_AUTH_MODE=disabled .venv/bin/python tests/netns_cluster.py
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"
REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
HEAD_PORT = 6379  # in the head's namespace: no other cluster can hold it there
NETNS_ETC = Path("/etc/netns")
RUN_NETNS = Path("/run/netns")  # where ``ip netns add`` mounts each namespace
START_ATTEMPTS = 2  # ``ray start`` of one node
NODE_REGISTER_S = 180  # how long a new node's raylet may take to register with the GCS
# ``ray start`` gives a new node's raylet 30 s to register with the GCS (a constant in
# ``ray._private.node``), which a loaded 2-core machine misses: its Python agents take
# that long to start. This runs ``ray start`` with the GCS lookup it polls retried for
# up to ``NODE_REGISTER_S`` instead.
PATIENT_RAY_START = f"""
import sys, time
from ray._private import services
lookup = services.get_node
def get_node(*args, **kwargs):
    deadline = time.monotonic() + {NODE_REGISTER_S}
    while True:
        try:
            return lookup(*args, **kwargs)
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
services.get_node = get_node
from ray.scripts.scripts import main
sys.argv[0] = "ray"
sys.exit(main())
"""
# Node loss is found by the GCS's health checks: every 0.5 s, dead after 4 misses.
SYSTEM_CONFIG = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 4,
    "free_objects_period_milliseconds": 0,  # as rlaxkit.param_server.ray_store's clusters
}


def unavailable_reason() -> str | None:
    """Why this machine cannot host the cluster (``None``: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(IP):
        return "no `ip` command (iproute2)"
    if importlib.util.find_spec("ray") is None:
        return "Ray is not installed"
    probe = f"rlxprobe{os.getpid()}"
    made = subprocess.run([IP, "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run([IP, "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Host:
    """One namespace, one Ray node."""

    name: str
    namespace: str
    address: str
    resources: dict[str, float]
    num_cpus: int
    up: bool = False
    starts: int = 0  # Ray nodes started in it (a restart after a loss adds one)


@dataclass
class NetnsCluster:
    """Hosts ``name -> Ray custom resources``; the first is the head.

    Args:
        hosts: each host's name (a short word) and the custom resources its node offers.
        num_cpus: logical CPUs each node offers.
        object_store_bytes: each node's object store.
        env: extra environment for every process started in a host.
    """

    hosts: dict[str, dict[str, float]]
    num_cpus: int = 2
    object_store_bytes: int = 200 * 1024**2
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tag = secrets.token_hex(2)
        prefix = f"rlxmh{self.tag}"
        subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250)}"
        self.switch = f"{prefix}-switch"
        self.nodes = {
            name: Host(name, f"{prefix}-{name}", f"{subnet}.{i + 2}", dict(res), self.num_cpus)
            for i, (name, res) in enumerate(self.hosts.items())
        }
        self.head = next(iter(self.nodes.values()))
        self.temp_dir = Path(tempfile.mkdtemp(prefix=f"rlx{self.tag}", dir="/tmp"))
        self._namespaces: list[str] = []

    python = PYTHON

    @property
    def address(self) -> str:
        """The GCS address (``ray.address`` of a run on this cluster)."""
        return f"{self.head.address}:{HEAD_PORT}"

    # -- the network -------------------------------------------------------------------
    def _ip(self, *args: str) -> None:
        subprocess.run([IP, *args], check=True, capture_output=True, text=True)

    def _add_namespace(self, namespace: str) -> None:
        self._ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        self._ip("-n", namespace, "link", "set", "lo", "up")

    def _network(self) -> None:
        self._add_namespace(self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.nodes.values()):
            self._add_namespace(host.namespace)
            port = f"port{i}"
            self._ip(
                "-n", self.switch, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", host.namespace,
            )  # fmt: skip
            self._ip("-n", self.switch, "link", "set", port, "master", "br0")
            self._ip("-n", self.switch, "link", "set", port, "up")
            self._ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            self._ip("-n", host.namespace, "link", "set", "eth0", "up")
            etc = NETNS_ETC / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n{host.address} {socket.gethostname()} {host.name}\n"
            )

    # -- processes ---------------------------------------------------------------------
    def environment(self) -> dict[str, str]:
        """The environment of a process in a host: this one's, Ray quiet and private."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
        env |= {
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
            **self.env,
        }
        return env

    def command(self, host: str, argv: list[str]) -> list[str]:
        return [IP, "netns", "exec", self.nodes[host].namespace, *argv]

    def run(self, host: str, argv: list[str], timeout_s: float = 120.0) -> str:
        """Runs ``argv`` in ``host`` to its end; returns its output (raises on failure)."""
        done = subprocess.run(
            self.command(host, argv),
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=REPO,
        )
        if done.returncode:
            raise RuntimeError(
                f"{' '.join(argv[:3])[:200]} in {host} exited {done.returncode}:\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{self.log_tails()}"
            )
        return done.stdout

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of the newest Ray node logs (raylets, GCS), for an error."""
        logs = sorted(self.temp_dir.glob("session_*/logs/*.out"), key=lambda p: p.stat().st_mtime)
        tails = []
        for path in [p for p in logs if p.name.startswith(("raylet", "gcs_server"))][-4:]:
            text = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"== {path.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def popen(self, host: str, argv: list[str], log: Path, **kwargs) -> subprocess.Popen:
        """Starts ``argv`` in ``host`` (a driver); its output goes to ``log``."""
        out = open(log, "ab")  # noqa: SIM115 - the child holds it; closed when it exits
        try:
            return subprocess.Popen(
                self.command(host, argv),
                env=self.environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                **kwargs,
            )
        finally:
            out.close()

    def start_node(self, name: str) -> None:
        """Starts ``name``'s Ray node (the head's first): its address, its resources."""
        host = self.nodes[name]
        argv = [
            PYTHON,
            "-c",
            PATIENT_RAY_START,
            "start",
            f"--node-ip-address={host.address}",
            f"--num-cpus={host.num_cpus}",
            f"--resources={json.dumps(host.resources)}",
            f"--object-store-memory={self.object_store_bytes}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
        ]
        if host is self.head:
            argv += [
                "--head",
                f"--port={HEAD_PORT}",
                "--include-dashboard=false",
                f"--system-config={json.dumps(SYSTEM_CONFIG)}",
            ]
        else:
            argv.append(f"--address={self.address}")
        for attempt in range(START_ATTEMPTS):
            try:
                self.run(name, argv, timeout_s=NODE_REGISTER_S + 120.0)
                break
            except (RuntimeError, subprocess.TimeoutExpired):
                # Clear the half-started node and try again.
                self.kill_host(name)
                if attempt + 1 == START_ATTEMPTS:
                    raise
        host.up, host.starts = True, host.starts + 1

    def start(self) -> NetnsCluster:
        """The network, then every host's Ray node; waits until all have joined."""
        try:
            self._network()
            for name in self.nodes:
                self.start_node(name)
            self.wait_for_nodes(len(self.nodes))
        except BaseException:
            self.close()
            raise
        return self

    def alive_nodes(self) -> list[dict]:
        """The cluster's live nodes as the GCS sees them (address, resources, id)."""
        code = (
            "import json, ray\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            "print('rlx:', json.dumps([{'address': n['NodeManagerAddress'], 'id': n['NodeID'],"
            " 'resources': n['Resources']} for n in ray.nodes() if n['Alive']]))\n"
        )
        return _printed(self.run(self.head.name, [PYTHON, "-c", code]))

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> list[dict]:
        """Waits until ``count`` nodes are alive; returns them."""
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = self.alive_nodes()
            if len(nodes) == count or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        if len(nodes) != count:
            raise RuntimeError(f"{len(nodes)} Ray nodes alive after {timeout_s} s, not {count}")
        return nodes

    def actor_placements(self) -> list[dict]:
        """Every actor the GCS knows of, dead ones included: class, state, node address.

        Ray's public state API (``ray.util.state``) needs the dashboard, which this
        cluster does not run; the GCS's actor table has the same facts.
        """
        code = (
            "import json, ray\n"
            "from ray._private import state\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            "print('rlx:', json.dumps([{'class': a['ActorClassName'], 'state': a['State'],"
            " 'job': a['JobID'], 'address': a['Address']['IPAddress']}"
            " for a in state.actors().values()]))\n"
        )
        return _printed(self.run(self.head.name, [PYTHON, "-c", code]))

    def pids(self, name: str) -> list[int]:
        """Every process in ``name``'s namespace (as ``ip netns pids``, without
        starting a process: a test that must kill within milliseconds calls it)."""
        try:
            namespace = os.stat(RUN_NETNS / self.nodes[name].namespace).st_ino
        except FileNotFoundError:
            return []
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry.name}/ns/net").st_ino == namespace:
                        found.append(int(entry.name))
        return found

    def processes(self, name: str, title: str) -> list[int]:
        """Processes in ``name``'s namespace whose command line starts with ``title``
        (Ray names an actor's process ``ray::<Class>``)."""
        found = []
        for pid in self.pids(name):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title.encode()):
                    found.append(pid)
        return found

    def kill_host(self, name: str) -> int:
        """Node loss: SIGKILL every process in ``name``'s namespace (its Ray node, the
        actors on it, a driver started there) until none is left; returns how many."""
        killed: set[int] = set()
        for _ in range(50):
            pids = self.pids(name)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            time.sleep(0.1)
        self.nodes[name].up = False
        return len(killed)

    def partition(self, name: str) -> None:
        """Cuts ``name`` off the network with its processes alive: its ``eth0`` goes
        down, so nothing reaches it and it reaches nothing (its loopback stays up)."""
        self._ip("-n", self.nodes[name].namespace, "link", "set", "eth0", "down")

    def heal(self, name: str) -> None:
        """Ends ``partition(name)``: ``eth0`` up again, with its address and route."""
        self._ip("-n", self.nodes[name].namespace, "link", "set", "eth0", "up")

    def close(self) -> None:
        """Kills every process of every host, deletes the namespaces (and their veth
        links) and the cluster's files."""
        for name in reversed(list(self.nodes)):
            if self.nodes[name].namespace in self._namespaces:
                self.kill_host(name)
        for namespace in reversed(self._namespaces):
            subprocess.run([IP, "netns", "del", namespace], capture_output=True)
        self._namespaces = []
        for host in self.nodes.values():
            shutil.rmtree(NETNS_ETC / host.namespace, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only if no one else keeps files there
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _printed(output: str) -> list[dict]:
    """The JSON a probe printed after ``rlx:`` (Ray may print warnings around it, e.g.
    of a node that missed its health checks)."""
    lines = [line for line in output.splitlines() if line.startswith("rlx: ")]
    if not lines:
        raise RuntimeError(f"the probe printed no `rlx:` line:\n{output[-2000:]}")
    return json.loads(lines[-1].removeprefix("rlx: "))


def leftovers() -> list[str]:
    """Namespaces of clusters of this module that still exist."""
    listed = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith("rlxmh")]


if __name__ == "__main__":
    reason = unavailable_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    hosts = {"a": {"host_a": 1}, "b": {"host_b": 1}, "c": {"host_c": 1}}
    with NetnsCluster(hosts) as cluster:
        for node in cluster.alive_nodes():
            print(node["address"], {k: v for k, v in node["resources"].items() if "host" in k})
