"""A cluster on one machine: emulated nodes and network links for real MPI runs.

Any command runs under the real MPICH on nodes and links built from the Linux kernel's
own parts. An emulation, not a network: no latency is added (these kernels have no
``netem``), and at high rates a small machine's TCP stack, not the link, is the limit.
Why, and how to use it: ``jobs/README.md``, "A cluster on one machine"; figures:
``mpitrain/bench/README.md``, the same section.

* **nodes**: one network namespace per node, whose ranks meet over shared memory, as on a
  real node. Node ``k``'s address, ``10.231.0.<k+1>/24`` on ``vnet0``, exists only inside
  these namespaces, so no traffic can leave them.
* **links**: a veth pair between two nodes; with more nodes each node's veth goes to a
  bridge in a namespace of its own (``...-switch``), a switch. Every link is shaped on
  egress, both ways, with ``tc`` htb at ``rate``; the burst is 256 KiB, as a 64 KiB one
  kept the throughput well below the rate. Delayed ACKs are off on the links (the route's
  ``quickack``): with them MPICH's allreduce of long messages (its reduce-scatter and
  allgather) stalled for Linux's delayed-ACK timer in some calls once compute came
  between the calls, which an RDMA fabric does not do (measured: the bench README);
  ``delayed_acks=True`` keeps the kernel's default.
* **launch**: ``mpiexec`` runs in node 0's namespace with Hydra's ssh launcher; a small
  script stands in for ssh and starts each node's proxy inside that node's namespace
  (``nsenter --net``), on that node's share of the cores (``taskset``: unpinned, each rank
  took every core for its BLAS threads and ran many times slower). MPICH's network
  module is told the interface (``FI_TCP_IFACE`` / ``UCX_NET_DEVICES``): without it a rank
  may advertise an address other nodes cannot reach, and UCX without
  ``UCX_TLS=tcp,self`` takes the other namespace for the same host and uses shared memory.
* **teardown** (``ip netns del``, which removes the links too) always runs, also after an
  error or Ctrl-C; a later cluster deletes the namespaces of one whose process was killed.

**Time dilation** (Gupta et al., "To Infinity and Beyond: Time-Warped Network
Emulation", NSDI 2006): with more ranks than cores compute slows while the links do not,
which flatters communication; ``dilation=D`` slows both alike (what it does not slow:
``jobs/README.md``). Links run at ``rate / D``; each node is held to ``ranks / D`` cores
by a cgroup's CPU bandwidth control (``cpu.cfs_quota_us`` or ``cpu.max``, in periods of
``PERIOD_US``, short beside a training step), so a rank computes at ``1 / D`` of a core
however its neighbours spin. The trainer records ``D`` (``$MPITRAIN_CLUSTER``,
:func:`mpitrain.runtime.emulated_cluster`) and ``mpitrain report`` divides by it.
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

from mpitrain.runtime import CLUSTER_ENV, my_cores, process_alive

PREFIX = "mpitrain-"  # every namespace this module makes: mpitrain-<pid>-node<k>, mpitrain-<pid>-switch
IFACE = "vnet0"  # each node's interface
# where ip netns keeps its namespaces; processes enter one with nsenter --net, which
# (unlike ip netns exec) leaves /sys as it is, cgroups included (time dilation)
NETNS_DIR = "/run/netns"
NETMODS = {  # how MPICH's ch4 reaches the other nodes over IFACE
    "ofi": {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": IFACE},
    "ucx": {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": IFACE},
}
_RATE = re.compile(r"([1-9][0-9]*(?:\.[0-9]+)?)([kmg])bit")  # a tc rate: 100mbit, 2.5gbit

# stands in for ssh (launch, above): Hydra calls it as "SCRIPT [options] HOST COMMAND...", HOST being node<k>
_LAUNCHER = """#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
esac
{enter}exec nsenter --net="{netns}/{prefix}$host" {pin} /bin/sh -c "$*"
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
    delayed_acks: bool = False  # True: the kernel's delayed ACKs (stalls, above); False: quickack routes
    dilation: float | str = 1.0  # time dilation D >= 1, or "auto" (ranks / cores when above 1)
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-")
    _made: list = field(default_factory=list, repr=False)
    _groups: list = field(default_factory=list, repr=False)
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
        if self.dilation == "auto":
            self.dilation = max(1.0, self.nodes * self.ranks / len(my_cores()))
        if not (isinstance(self.dilation, (int, float)) and 1 <= self.dilation <= 64):
            raise ClusterError(f"dilation {self.dilation!r}: expected a number from 1 to 64, or auto")
        self.dilation = float(self.dilation)

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
        mine = my_cores()
        if len(mine) < self.nodes:
            return [[mine[k % len(mine)]] for k in range(self.nodes)]
        return [mine[len(mine) * k // self.nodes : len(mine) * (k + 1) // self.nodes] for k in range(self.nodes)]

    @property
    def link_rate(self) -> str:
        """What tc shapes each link to: ``rate``, slowed by the dilation."""
        return self.rate if self.dilation == 1 else f"{bits_per_second(self.rate) / self.dilation / 1e3:.0f}kbit"

    def environment(self) -> dict[str, str]:
        """What every rank is told: MPICH's network settings, the shaped rate, and the
        cluster as the trainer records it."""
        what = {"nodes": self.nodes, "ranks_per_node": self.ranks, "rate": self.rate, "dilation": self.dilation}
        return {**NETMODS[self.netmod], "MPITRAIN_LINK_RATE": self.link_rate, CLUSTER_ENV: json.dumps(what)}

    def node(self, k: int) -> str:
        return f"{self.prefix}node{k}"

    def address(self, k: int) -> str:
        return f"10.231.0.{k + 1}"

    def _build(self) -> None:
        for k in range(self.nodes):
            self._netns(self.node(k))
        if self.nodes == 2:  # one cable between the two
            _ip("-n", self.node(0), "link", "add", IFACE, "type", "veth", "peer", "name", IFACE, "netns", self.node(1))
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
            if not self.delayed_acks:  # the route the address made, with every ACK sent at once
                _ip("-n", ns, "route", "replace", "10.231.0.0/24", "dev", IFACE, "proto", "kernel", "scope", "link",
                    "src", self.address(k), "quickack", "1")
        for ns, dev in ends:  # each direction of each link: egress shaping where the bytes leave
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10",
                  "r2q", "1000"])
            _run(["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate",
                  self.link_rate, "ceil", self.link_rate, "burst", "256k"])
        self._wait_until_up(ends)
        self._dir = Path(tempfile.mkdtemp(prefix="mpitrain-cluster-"))
        launcher = self._dir / "ssh"
        cases = "\n".join(f"  node{k}) cpus={','.join(map(str, cpus))} ;;" for k, cpus in enumerate(self.cores()))
        pin = 'taskset -c "$cpus"' if shutil.which("taskset") else ""
        enter = ""
        if self.dilation > 1:  # each node's processes in its own cgroup, held to ranks / D cores
            base = _cgroups()
            for k in range(self.nodes):
                self._groups.append(_cgroup(base / self.node(k), self.ranks / self.dilation))
            enter = f'echo $$ > "{base}/{self.prefix}$host/cgroup.procs" || exit 1\n'
        launcher.write_text(_LAUNCHER.format(prefix=self.prefix, cases=cases, pin=pin, enter=enter, netns=NETNS_DIR))
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
        _run(["ip", "netns", "exec", name, "sh", "-c", "echo 0 > /proc/sys/net/ipv6/conf/all/accept_dad && "
              "echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad"])
        _ip("-n", name, "link", "set", "lo", "up")

    def close(self) -> None:
        """Delete every namespace made (their links go with them) and the launcher."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._made.clear()
        for group in self._groups:
            _remove_cgroup(group)
        self._groups.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -------------------------------------------------------------- run
    def command(self, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` under mpiexec on every rank of the cluster."""
        hosts = ",".join(f"node{k}:{self.ranks}" for k in range(self.nodes))
        env = [f"{k}={v}" for k, v in self.environment().items()]
        return ["nsenter", f"--net={NETNS_DIR}/{self.node(0)}", "env", *env, mpiexec(), "-launcher", "ssh",
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
        stats = [json.loads(_ip("-n", self.node(k), "-s", "-j", "link", "show", IFACE))[0]["stats64"]
                 for k in range(self.nodes)]
        return [(f"node{k}", s["tx"]["bytes"], s["rx"]["bytes"]) for k, s in enumerate(stats)]


def bits_per_second(rate: str) -> float | None:
    """A tc rate (``1gbit``, ``100mbit``, ``2.5gbit``) in bits per second; None if not one."""
    m = _RATE.fullmatch(rate)
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else None


# Data parallelism across a network overlaps best with buckets of about this many
# seconds of the link (mpitrain/parallel/data_parallel.py, "Across a network")
BUCKET_SECONDS = 0.002


def link_bucket_mb(rate: str) -> float:
    """The bucket size (MB, as ``parallel.bucket_mb``) that takes ``BUCKET_SECONDS`` on a
    link of ``rate`` (a tc rate: ``1gbit`` gives 0.24)."""
    bps = bits_per_second(rate)
    if bps is None:
        raise ValueError(f"link rate {rate!r}: expected a rate such as 100mbit, 1gbit or 10gbit")
    return bps / 8 * BUCKET_SECONDS / 2**20


def mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec") or "mpiexec"


def check_tools() -> None:
    """Root, iproute2 and nsenter, or one ClusterError saying which is missing."""
    if os.geteuid() != 0:
        raise ClusterError("an emulated cluster needs root (network namespaces and tc)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"an emulated cluster needs iproute2 ({' and '.join(missing)} not found: "
                           "apt-get install iproute2)")
    if shutil.which("nsenter") is None:
        raise ClusterError("an emulated cluster needs nsenter (util-linux: apt-get install util-linux)")


def remove_stale() -> list[str]:
    """Delete the namespaces (and cgroups) of clusters whose process is gone (killed
    outright, so its teardown never ran); their names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    gone = []
    for line in listed.splitlines():
        m = re.match(re.escape(PREFIX) + r"(\d+)-\S+", line)
        if m and not process_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", m.group(0)], capture_output=True, check=False)
            gone.append(m.group(0))
    for base in (CGROUP_V1, CGROUP_V2):
        for group in base.glob(f"{PREFIX}*") if base.is_dir() else ():
            m = re.match(re.escape(PREFIX) + r"(\d+)-", group.name)
            if m and not process_alive(int(m.group(1))):
                _remove_cgroup(group)
                gone.append(str(group))
    return gone


# ------------------------------------------------------------------ cgroups (dilation)
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
CGROUP_V2 = Path("/sys/fs/cgroup")  # the unified hierarchy, when its cpu controller is on for children
PERIOD_US = 10_000  # the CPU bandwidth period: a node runs its share of every 10 ms


def _cgroups() -> Path:
    """Where node cgroups with a CPU limit can be made, or one ClusterError."""
    if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
        return CGROUP_V1
    controls = CGROUP_V2 / "cgroup.subtree_control"
    if controls.exists() and "cpu" in controls.read_text().split():
        return CGROUP_V2
    raise ClusterError("time dilation needs the kernel's CPU bandwidth control: cgroup v1's cpu controller "
                       f"({CGROUP_V1}) or cgroup v2's with +cpu in {controls}")


def _cgroup(path: Path, cores: float) -> Path:
    """A cgroup at ``path`` whose processes together use at most ``cores`` cores."""
    quota = max(1000, round(cores * PERIOD_US))  # the kernel's least quota is 1 ms
    try:
        path.mkdir()
        if path.parent == CGROUP_V1:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    except OSError as e:
        _remove_cgroup(path)
        raise ClusterError(f"cannot make the cgroup {path} for time dilation: {e.strerror}") from None
    return path


def _remove_cgroup(path: Path) -> None:
    """Remove an empty cgroup; its processes may take a moment to be gone after mpiexec."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


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
    line = (f"emulated cluster: {cluster.nodes} nodes x {cluster.ranks} rank(s), links {cluster.rate} "
            f"(htb{', delayed ACKs' if cluster.delayed_acks else ''}), MTU {cluster.mtu}, MPICH netmod {cluster.netmod} over {IFACE}; {cores}{pinned}")
    ranks, have = cluster.nodes * cluster.ranks, len(my_cores())
    if cluster.dilation > 1:
        line += (f"\ntime dilation {cluster.dilation:g}: links at {cluster.link_rate}, each node held to "
                 f"{cluster.ranks / cluster.dilation:g} core(s); durations measured inside are {cluster.dilation:g}x "
                 f"those of the cluster emulated (mpitrain report divides them)")
    elif ranks > have:
        line += f"\n{ranks} ranks share {have} core(s): compute is slower than on the cluster emulated, " \
                "links are not (--dilation auto makes both slower alike)"
    return line


def counters_table(rows: list[tuple[str, int, int]]) -> str:
    lines = ["link bytes: node |        sent MB |    received MB"]
    lines += [f"            {name:>4} | {tx / 1e6:14.2f} | {rx / 1e6:14.2f}" for name, tx, rx in rows]
    return "\n".join(lines)
