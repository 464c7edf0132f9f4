"""The namespace emulator: a real 2-node cluster on this machine, and clean teardown.

Runs by default where network namespaces work (root + iproute2); skips cleanly elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import netns_works

from comm.tools.emulate import EmulatedCluster, EmulatorError, leftovers, node_address

needs_netns = pytest.mark.skipif(not netns_works(), reason="needs root and ip netns")


@pytest.mark.netns
@pytest.mark.multiproc
@needs_netns
def test_two_node_cluster_runs_halo_check_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    cluster = EmulatedCluster(nodes=2, gpus_per_node=2, nic_mbit=200, tag=f"{os.getpid()}a")
    with cluster:
        assert len(leftovers(cluster.prefix)) > 0  # the namespaces really exist
        rc = cluster.run([sys.executable, "-m", "comm.selfcheck", "--out", str(out)],
                         timeout_s=150)
    assert leftovers(cluster.prefix) == []
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["ok"] and result["num_nodes"] == 2, result
    assert result["rank2node"] == [0, 0, 1, 1]  # discovered from namespaces + torchrun env
    assert {"random/halo", "empty_ranks/halo", "all_empty/auto"} <= set(result["passed"])


@pytest.mark.netns
@needs_netns
def test_failing_command_returns_status_and_tears_down() -> None:
    cluster = EmulatedCluster(nodes=1, gpus_per_node=1, nic_mbit=100, tag=f"{os.getpid()}b")
    with cluster:
        rc = cluster.run(["false"], timeout_s=60)
    assert rc != 0
    assert leftovers(cluster.prefix) == []


@pytest.mark.netns
@needs_netns
def test_exception_inside_two_group_cluster_tears_down() -> None:
    cluster = EmulatedCluster(nodes=3, gpus_per_node=1, nic_mbit=100, groups=2,
                              global_mbit=50, tag=f"{os.getpid()}d")
    with pytest.raises(RuntimeError, match="boom"), cluster:
        # group 0 = nodes 0-1, group 1 = node 2: a core bridge plus two shaped uplinks
        assert [cluster.group_of(i) for i in range(3)] == [0, 0, 1]
        assert any(name.startswith("pmu") for name in leftovers(cluster.prefix))
        raise RuntimeError("boom")
    assert leftovers(cluster.prefix) == []


@pytest.mark.netns
@needs_netns
def test_latency_without_netem_fails_clearly() -> None:
    cluster = EmulatedCluster(nodes=2, gpus_per_node=1, nic_mbit=100, latency_ms=2,
                              tag=f"{os.getpid()}c")
    try:
        with cluster:  # where the kernel has netem, the delayed cluster simply builds
            pass
    except EmulatorError as e:
        assert "netem" in str(e) and "--latency-ms" in str(e)
    assert leftovers(cluster.prefix) == []


@pytest.mark.netns
@needs_netns
def test_mtu_reaches_every_emulated_link() -> None:
    cluster = EmulatedCluster(nodes=2, gpus_per_node=1, nic_mbit=100, mtu=9000,
                              tag=f"{os.getpid()}m")
    with cluster:
        inside = subprocess.run(["ip", "netns", "exec", cluster.namespace(1), "ip", "-o",
                                 "link", "show", "eth0"], capture_output=True, text=True)
        host = subprocess.run(["ip", "-o", "link", "show", f"pmv{cluster.tag}n1"],
                              capture_output=True, text=True)
    assert " mtu 9000 " in inside.stdout and " mtu 9000 " in host.stdout
    assert leftovers(cluster.prefix) == []
    with pytest.raises(ValueError, match="mtu"):
        EmulatedCluster(nodes=1, gpus_per_node=1, nic_mbit=100, mtu=100)


def test_cli_rejects_bad_arguments() -> None:
    from comm.tools.emulate import main

    assert main(["--nodes", "0", "--gpus-per-node", "1", "--nic-mbit", "1", "--", "true"]) == 2
    assert main(["--nodes", "2", "--gpus-per-node", "1", "--nic-mbit", "1", "--groups", "2",
                 "--", "true"]) == 2
    with pytest.raises(SystemExit, match="missing '--'"):
        main(["--nodes", "2"])
    assert node_address(0) == "198.18.0.1" and node_address(251) == "198.18.1.2"
    with pytest.raises(ValueError, match="0..499"):
        node_address(500)


@pytest.mark.netns
@needs_netns
def test_sigterm_tears_everything_down() -> None:
    import signal
    import time

    cmd = [sys.executable, "-m", "comm.emulate", "--nodes", "2", "--gpus-per-node", "1",
           "--nic-mbit", "100", "--", "sleep", "60"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prefix = f"pmoe-{proc.pid}"
    deadline = time.monotonic() + 30
    while len(leftovers(prefix)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(prefix), "the cluster never came up"
    time.sleep(1.0)  # let the agents start, so there are processes to stop as well
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert leftovers(prefix) == []


def test_peer_queues_cover_every_node_and_never_limit_or_drop() -> None:
    from comm.tools.emulate import peer_queues, tbf_args

    batch = peer_queues("eth0", 100.0, 1500, 3, "dst").splitlines()
    assert batch[0] == "qdisc add dev eth0 parent 2:1 handle 3: htb default 4"
    filters = [line for line in batch if line.startswith("filter")]
    assert [f.split(" match ip ")[1].split()[:2] for f in filters] == [
        ["dst", node_address(i) + "/32"] for i in range(3)]
    assert [f.split()[-1] for f in filters] == ["3:1", "3:2", "3:3"]
    classes = [line for line in batch if line.startswith("class")]
    assert len(classes) == 4 and all("rate 1000.0mbit ceil 1000.0mbit" in c for c in classes)
    queues = [line for line in batch if line.startswith("qdisc add dev eth0 parent 3:")]
    assert len(queues) == 4 and all(q.endswith("pfifo limit 12500") for q in queues)
    tbf = tbf_args(100.0)
    assert tbf[:3] == ["tbf", "rate", "100.0mbit"]
    assert int(tbf[tbf.index("burst") + 1]) >= 65536 + 1514  # a whole GSO packet passes


@pytest.mark.netns
@needs_netns
def test_nic_has_round_robin_peer_queues_and_chosen_tcp() -> None:
    cluster = EmulatedCluster(nodes=2, gpus_per_node=1, nic_mbit=100, tag=f"{os.getpid()}q")
    with cluster:
        ns = ["ip", "netns", "exec", cluster.namespace(0)]
        qdiscs = subprocess.run(ns + ["tc", "qdisc", "show", "dev", "eth0"],
                                capture_output=True, text=True).stdout
        cc = subprocess.run(ns + ["sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                            capture_output=True, text=True).stdout.strip()
        host = subprocess.run(["tc", "filter", "show", "dev", f"pmv{cluster.tag}n0",
                               "parent", "3:"],
                              capture_output=True, text=True).stdout
    assert "qdisc tbf 2: root" in qdiscs and "qdisc htb 3: parent 2:1" in qdiscs
    assert qdiscs.count("pfifo") == 3 and cc == "reno"
    assert "c6120001/ffffffff at 12" in host  # receive side: classified by source address
    assert leftovers(cluster.prefix) == []
    with pytest.raises(ValueError, match="tcp_cc"):
        EmulatedCluster(nodes=1, gpus_per_node=1, nic_mbit=100, tcp_cc="no such")
