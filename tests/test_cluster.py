"""The emulated cluster (mpitrain/cluster.py): the MPI tier's data-parallel equivalence
tests run across 2 emulated nodes linked at 1 Gbit/s, their bytes cross the link, and
no namespace is left behind, also when the command fails. Skipped, with the reason,
where namespaces cannot be made (no root, no iproute2, a container without the
capability)."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mpitrain import cluster

ROOT = Path(__file__).resolve().parent.parent


def _why_not() -> str | None:
    try:
        cluster.check_tools()
    except cluster.ClusterError as e:
        return str(e)
    probe = f"mpitrain-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


WHY_NOT = _why_not()
needs_namespaces = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


def namespaces() -> set[str]:
    """The network namespaces there are but those of a cluster still running (named for
    its process: ``cluster.PREFIX`` and its pid), which another test beside this one, in the
    tier's other worker, may hold: what a cluster that ended left behind."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    return {n for n in names if not _running(n)}


def _running(name: str) -> bool:
    pid = name[len(cluster.PREFIX):].split("-")[0] if name.startswith(cluster.PREFIX) else ""
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


def run_cluster(*argv, timeout=240):
    return subprocess.run([sys.executable, "-m", "mpitrain", "cluster", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, check=False)


@needs_namespaces
def test_the_data_parallel_equivalence_tests_pass_across_two_emulated_nodes():
    before = namespaces()
    done = run_cluster("--nodes", "2", "--ranks", "1", "--rate", "1gbit", "--", sys.executable, "-m", "pytest",
                       "-q", "--with-mpi", "-m", "mpi", "-p", "no:cacheprovider", "tests/test_mpi_parallel.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "emulated cluster: 2 nodes x 1 rank(s), links 1gbit" in done.stdout
    assert "failed" not in done.stdout and " passed" in done.stdout
    rows = [line.split("|") for line in done.stdout.splitlines() if line.strip().startswith("node")]
    assert len(rows) == 2 and all(float(sent) > 1 and float(got) > 1 for _, sent, got in rows), done.stdout
    assert namespaces() == before


@needs_namespaces
def test_a_failing_command_gives_its_status_and_leaves_no_namespace():
    before = namespaces()
    done = run_cluster("--nodes", "3", "--", sys.executable, "-c", "import sys; sys.exit(3)", timeout=120)
    assert done.returncode == 3, done.stderr
    assert namespaces() == before


@needs_namespaces
def test_the_links_send_every_ack_at_once_unless_told_to_delay():
    """Each node's route to the others carries quickack (delayed ACKs stalled long allreduces
    40 ms, cluster.py), between two nodes and behind a switch; --delayed-acks leaves the
    kernel's route; the route keeps its source address either way."""
    probe = [sys.executable, "-c", "import os, subprocess; os.write(1, subprocess.run(['ip', 'route', 'show', "
             "'dev', 'vnet0'], capture_output=True, text=True).stdout.encode())"]
    for argv, quick in [(["--nodes", "2"], True), (["--nodes", "3"], True), (["--nodes", "2", "--delayed-acks"], False)]:
        done = run_cluster(*argv, "--", *probe, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        routes = [line for line in done.stdout.splitlines() if line.startswith("10.231.0.0/24")]
        assert len(routes) == int(argv[1]), done.stdout
        assert all(("quickack 1" in r) == quick and " src 10.231.0." in r for r in routes), routes
        assert ("delayed ACKs" in done.stdout) != quick


@needs_namespaces
def test_the_namespaces_of_a_killed_cluster_are_removed_by_the_next():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{cluster.PREFIX}{dead.pid}-node0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in cluster.remove_stale() and stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)


def test_bad_settings_and_missing_tools_are_one_line(monkeypatch):
    for kwargs, message in [({"nodes": 1}, "at least 2 nodes"), ({"rate": "fast"}, "expected a tc rate"),
                            ({"mtu": 100}, "expected 576 to 65535"), ({"netmod": "shm"}, "expected one of ofi, ucx")]:
        with pytest.raises(cluster.ClusterError, match=message):
            cluster.Cluster(**kwargs)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.ClusterError, match="needs root"):
        cluster.check_tools()
    done = subprocess.run([sys.executable, "-m", "mpitrain", "cluster", "--rate", "fast", "--", "true"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "mpitrain: error: rate 'fast': expected a tc rate such as 100mbit, 1gbit or 10gbit"]


def _why_no_dilation() -> str | None:
    if WHY_NOT is not None:
        return WHY_NOT
    try:
        cluster._cgroups()
    except cluster.ClusterError as e:
        return str(e)
    return None


@pytest.mark.skipif(_why_no_dilation() is not None, reason=_why_no_dilation() or "")
def test_time_dilation_slows_the_links_and_holds_each_node_to_its_share_of_a_core():
    """--dilation 2: links at half the rate, each node's processes in a cgroup of half a
    core per rank, every rank told the cluster; nothing left behind."""
    before = namespaces()
    probe = ("import os; cg = [l.split(':')[2] for l in open('/proc/self/cgroup') if 'mpitrain-' in l][0].strip(); "
             "base = '/sys/fs/cgroup/cpu' if os.path.exists('/sys/fs/cgroup/cpu' + cg) else '/sys/fs/cgroup'; "
             "limit = open(base + cg + '/cpu.cfs_quota_us').read().strip() if base.endswith('cpu') else "
             "open(base + cg + '/cpu.max').read().split()[0]; "
             "env = os.environ; line = ' '.join(['rank', cg.rsplit('-', 1)[1], limit, env['MPITRAIN_LINK_RATE'], "
             "env['MPITRAIN_CLUSTER']]); os.write(1, (line + chr(10)).encode())")  # one write: lines cannot mix
    done = run_cluster("--nodes", "2", "--ranks", "1", "--rate", "1gbit", "--dilation", "2", "--",
                       sys.executable, "-c", probe, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "time dilation 2: links at 500000kbit, each node held to 0.5 core(s)" in done.stdout
    ranks = sorted(line.split(" ", 4)[1:] for line in done.stdout.splitlines() if line.startswith("rank "))
    told = '{"nodes": 2, "ranks_per_node": 1, "rate": "1gbit", "dilation": 2.0}'
    assert ranks == [["node0", "5000", "500000kbit", told], ["node1", "5000", "500000kbit", told]], done.stdout
    assert namespaces() == before
    assert not [p for base in (cluster.CGROUP_V1, cluster.CGROUP_V2) for p in base.glob(f"{cluster.PREFIX}*")]


def test_bench_ddp_network_starts_its_own_ranks_and_names_a_bad_rate():
    def bench(*args, **env):
        return subprocess.run([sys.executable, "-m", "mpitrain", "bench", "ddp", *args], capture_output=True, text=True,
                              timeout=60, check=False, env=dict(os.environ, **env))

    done = bench("--network", "1gbit", PMI_RANK="0")
    assert done.returncode == 2 and "run it without mpiexec" in done.stderr
    done = bench("--network", "fast")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "mpitrain: error: --network 'fast': expected a link rate such as 100mbit, 1gbit or 10gbit"]
    with pytest.raises(cluster.ClusterError, match="dilation 0.5: expected a number from 1 to 64, or auto"):
        cluster.Cluster(dilation=0.5)


@needs_namespaces
def test_bench_ddp_network_runs_on_shared_memory_and_across_two_nodes_and_compares():
    before = namespaces()
    done = subprocess.run([sys.executable, "-m", "mpitrain", "bench", "ddp", "--network", "1gbit", "--models", "gpt",
                           "--allreduce", "ring", "--rounds", "1", "--steps", "1", "--warmup", "0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "buckets <= 0.238419 MB" in done.stdout  # 2 ms of the link
    table = done.stdout.split("overlap on shared memory and across the network")[1].splitlines()
    rows = [line.split("|")[0].split() for line in table[2:] if line.strip()]
    assert rows == [["gpt", "ring", "shared", "memory"], ["gpt", "ring", "2", "nodes,", "1gbit"]], table
    assert namespaces() == before
