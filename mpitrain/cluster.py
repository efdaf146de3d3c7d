"""A cluster on one machine: emulated nodes and network links for real MPI runs.

On one node an MPI allreduce is memory copies done by the cores that compute, so it
shows neither what a network costs nor how much of it overlap can hide. This module
builds a small cluster out of the Linux kernel's own parts and runs any command on it
under the real MPICH:

* **nodes**: one network namespace per node (``ip netns add``), named
  ``mpitrain-<pid>-node<k>``. The ranks of a node run in its namespace and meet over
  shared memory, as on a real node.
* **links**: a veth pair between two nodes; with more nodes each node's veth goes to a
  bridge in a namespace of its own (``...-switch``), a switch. Node ``k`` has the address
  ``10.231.0.<k+1>/24`` on its interface ``vnet0``. Those addresses exist only inside
  these namespaces, so no traffic can leave them.
* **bandwidth**: every link is shaped on egress, in both directions, with ``tc`` htb at
  ``rate`` (``1gbit``, ``10gbit``, ...). The burst is 256 KiB: a 64 KiB one cut the
  throughput to 0.64-0.78 Gbit/s here. The MTU is set with ``mtu``.
* **launch**: ``mpiexec`` runs in node 0's namespace with Hydra's ssh launcher. A small
  script stands in for ssh and starts each node's proxy inside that node's namespace.
  MPICH's network module is told the interface to use (``FI_TCP_IFACE`` /
  ``UCX_NET_DEVICES``). Without that a rank may advertise an address other nodes cannot
  reach, and UCX without ``UCX_TLS=tcp,self`` takes the other namespace for the same
  host and uses shared memory.

After the command, each node's link shows the bytes it sent and received. Teardown
(``ip netns del``, which removes the links with them) always runs, also after an error
or Ctrl-C. A later cluster also deletes the namespaces of one whose process was killed
outright.

**Limits** (an emulation, not a network): the kernels here have no ``netem``, so no
latency is added, and veth's is microseconds. Above about 2.5 Gbit/s the 2-core
machine's TCP stack, not the link, limits the throughput (10 Gbit/s gave 1.19 GB/s and
cost 0.6 of a core per rank). Each node runs on its own share of the machine's cores
(``taskset``): with 2 cores and 2 nodes, one core each, so a node's ranks split its
cores for their BLAS threads as on a real node (unpinned, each rank took both cores
and two ranks ran 10x slower); with fewer cores than nodes, nodes share cores. Figures: ``../shared/MEASURED.md`` on the developers'
machines, section "Emulated cluster".

Command line: ``mpitrain cluster --nodes 2 --ranks 2 --rate 1gbit -- mpitrain bench ddp``.
It needs root and iproute2 (``ip``, ``tc``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpitrain.runtime import process_alive

PREFIX = "mpitrain-"  # every namespace this module makes: mpitrain-<pid>-node<k>, mpitrain-<pid>-switch
IFACE = "vnet0"  # each node's interface
NETMODS = {  # how MPICH's ch4 reaches the other nodes over IFACE
    "ofi": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": IFACE},
    "ucx": {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": IFACE},
}
_RATE = re.compile(r"[1-9][0-9]*(\.[0-9]+)?[kmg]bit")

# stands in for ssh: Hydra calls it as "SCRIPT [options] HOST COMMAND..."; HOST is node<k>,
# whose proxy (and ranks) run in node k's namespace on node k's cores
_LAUNCHER = """#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
esac
exec ip netns exec "{prefix}$host" {pin} /bin/sh -c "$*"
"""


class ClusterError(Exception):
    """The emulated cluster cannot be set up here: one line, saying why."""


@dataclass
class Cluster:
    """``nodes`` namespaces with ``ranks`` MPI ranks each, linked at ``rate``.
    A context manager: set up on entry, always torn down on exit."""

    nodes: int = 2
    ranks: int = 1
    rate: str = "1gbit"
    mtu: int = 1500
    netmod: str = "ofi"
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-")
    _made: list = field(default_factory=list, repr=False)
    _dir: Path | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.nodes < 2 or self.ranks < 1:
            raise ClusterError(f"a cluster needs at least 2 nodes of at least 1 rank, got {self.nodes} x {self.ranks}")
        if not _RATE.fullmatch(self.rate):
            raise ClusterError(f"rate {self.rate!r}: expected a tc rate such as 100mbit, 1gbit or 10gbit")
        if not 576 <= self.mtu <= 65535:
            raise ClusterError(f"mtu {self.mtu}: expected 576 to 65535")
        if self.netmod not in NETMODS:
            raise ClusterError(f"netmod {self.netmod!r}: expected one of {', '.join(NETMODS)}")

    # -------------------------------------------------------------- set up, tear down
    def __enter__(self) -> Cluster:
        check_tools()
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def cores(self) -> list[list[int]]:
        """Each node's cores: this process's cores split into ``nodes`` equal runs, so a
        node's ranks divide its cores among them (BLAS threads) as on a real node, and
        nodes do not compete for a core; with fewer cores than nodes, nodes share them."""
        mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if len(mine) < self.nodes:
            return [[mine[k % len(mine)]] for k in range(self.nodes)]
        return [mine[len(mine) * k // self.nodes : len(mine) * (k + 1) // self.nodes] for k in range(self.nodes)]

    def node(self, k: int) -> str:
        return f"{self.prefix}node{k}"

    def address(self, k: int) -> str:
        return f"10.231.0.{k + 1}"

    def _build(self) -> None:
        for k in range(self.nodes):
            self._netns(self.node(k))
        if self.nodes == 2:  # one cable between the two
            _ip("-n", self.node(0), "link", "add", IFACE, "type", "veth", "peer", "name", IFACE,
                "netns", self.node(1))
            ends = [(self.node(0), IFACE), (self.node(1), IFACE)]
        else:  # each node to a port of a bridge (the switch), in a namespace of its own
            switch = f"{self.prefix}switch"
            self._netns(switch)
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            ends = []
            for k in range(self.nodes):
                port = f"port{k}"
                _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", self.node(k))
                _ip("-n", switch, "link", "set", port, "master", "br0", "mtu", str(self.mtu), "up")
                ends += [(switch, port), (self.node(k), IFACE)]
            _ip("-n", switch, "link", "set", "br0", "mtu", str(self.mtu), "up")
        for k in range(self.nodes):
            ns = self.node(k)
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "mtu", str(self.mtu), "up")
        for ns, dev in ends:  # each direction of each link: egress shaping where the bytes leave
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10",
                  "r2q", "1000"])
            _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate",
                  self.rate, "ceil", self.rate, "burst", "256k"])
        self._wait_until_up(ends)
        self._dir = Path(tempfile.mkdtemp(prefix="mpitrain-cluster-"))
        launcher = self._dir / "ssh"
        cases = "\n".join(f"  node{k}) cpus={','.join(map(str, cpus))} ;;" for k, cpus in enumerate(self.cores()))
        pin = 'taskset -c "$cpus"' if shutil.which("taskset") else ""
        launcher.write_text(_LAUNCHER.format(prefix=self.prefix, cases=cases, pin=pin))
        launcher.chmod(0o755)

    def _wait_until_up(self, ends: list[tuple[str, str]], timeout: float = 10.0) -> None:
        """Until every interface is operationally up: the kernel reports a new link's
        carrier up to a second late (its link watch), and a rank started before that
        failed in MPI_Init (libfabric's tcp provider found no usable interface: "OFI
        call ep_enable failed"), then hung the job."""
        deadline = time.monotonic() + timeout
        while True:
            states = {(ns, dev): json.loads(_ip("-n", ns, "-j", "link", "show", dev))[0].get("operstate")
                      for ns, dev in ends}
            if all(state == "UP" for state in states.values()):
                return
            if time.monotonic() > deadline:
                down = ", ".join(f"{dev} in {ns}: {state}" for (ns, dev), state in states.items() if state != "UP")
                raise ClusterError(f"the emulated links did not come up within {timeout:.0f} s ({down})")
            time.sleep(0.05)

    def _netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        # no duplicate address detection, which keeps an interface's IPv6 address
        # "tentative" for a second or two after the link comes up
        no_dad = "echo 0 > /proc/sys/net/ipv6/conf/all/accept_dad && echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad"
        _run(["ip", "netns", "exec", name, "sh", "-c", no_dad])
        _ip("-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        """Delete every namespace made (their links go with them) and the launcher."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._made.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -------------------------------------------------------------- run
    def command(self, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` under mpiexec on every rank of the cluster."""
        hosts = ",".join(f"node{k}:{self.ranks}" for k in range(self.nodes))
        env = [f"{k}={v}" for k, v in NETMODS[self.netmod].items()] + [f"MPITRAIN_LINK_RATE={self.rate}"]
        return ["ip", "netns", "exec", self.node(0), "env", *env, _mpiexec(), "-launcher", "ssh",
                "-launcher-exec", str(self._dir / "ssh"), "-localhost", self.address(0), "-hosts", hosts,
                "-n", str(self.nodes * self.ranks), *argv]

    def run(self, argv: list[str]) -> int:
        """Run ``argv`` on the cluster; its exit status. Ctrl-C reaches mpiexec (in this
        process group, from the terminal) and the ranks stop as they do on a real
        cluster; this process waits for them and then tears down."""
        proc = subprocess.Popen(self.command(argv))
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is mpiexec's
        forward = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        try:
            return proc.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, forward)
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def counters(self) -> list[tuple[str, int, int]]:
        """(node, bytes sent, bytes received) of each node's link."""
        rows = []
        for k in range(self.nodes):
            out = _run(["ip", "-n", self.node(k), "-s", "-j", "link", "show", IFACE])
            stats = json.loads(out)[0]["stats64"]
            rows.append((f"node{k}", stats["tx"]["bytes"], stats["rx"]["bytes"]))
        return rows


def check_tools() -> None:
    """Root and iproute2, or one ClusterError saying which is missing."""
    if os.geteuid() != 0:
        raise ClusterError("an emulated cluster needs root (network namespaces and tc)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"an emulated cluster needs iproute2 ({' and '.join(missing)} not found: "
                           "apt-get install iproute2)")


def remove_stale() -> list[str]:
    """Delete the namespaces of clusters whose process is gone (killed outright, so its
    teardown never ran); their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    gone = []
    for line in listed.splitlines():
        m = re.match(re.escape(PREFIX) + r"(\d+)-\S+", line)
        if m and not process_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True, check=False)
            gone.append(m.group(0))
    return gone


def _mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ClusterError(f"{shlex.join(cmd)}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


def describe(cluster: Cluster) -> str:
    cores = "; ".join(f"node{k} cores {','.join(map(str, c))}" for k, c in enumerate(cluster.cores()))
    pinned = "" if shutil.which("taskset") else " (not pinned: no taskset)"
    return (f"emulated cluster: {cluster.nodes} nodes x {cluster.ranks} rank(s), links {cluster.rate} "
            f"(htb), MTU {cluster.mtu}, MPICH netmod {cluster.netmod} over {IFACE}; {cores}{pinned}")


def counters_table(rows: list[tuple[str, int, int]]) -> str:
    lines = ["link bytes: node |        sent MB |    received MB"]
    lines += [f"            {name:>4} | {tx / 1e6:14.2f} | {rx / 1e6:14.2f}" for name, tx, rx in rows]
    return "\n".join(lines)
