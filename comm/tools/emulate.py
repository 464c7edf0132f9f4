"""Emulate a multi-node cluster on one machine: one network namespace per node, shaped links.

    python -m comm.emulate --nodes N --gpus-per-node G --nic-mbit X [--latency-ms Y]
                           [--groups K --global-mbit Z] [--mtu B] [--tcp-cc NAME] [--fifo]
                           [--timeout-s T] -- CMD ...

Wiring (root and iproute2 needed; addresses in the benchmarking range 198.18.0.0/15):

    node i: netns <prefix>-n<i>, eth0 = 198.18.<i // 250>.<i % 250 + 1>/15
            veth pair eth0 <-> pmv<pid>n<i>, the host end enslaved to its group's bridge
    NIC:    tbf at X Mbit/s on both ends of the node's veth (egress in the namespace shapes
            what the node sends, egress on the bridge port what it receives); under each
            tbf one queue per peer node, served round-robin (`--fifo`: one FIFO), 1 s deep
    TCP:    --tcp-cc in every node (default reno, loss-based: keeps the NIC queue busy; the
            host's BBR left a two-way loaded link idle ~7 % of the time), no slow-start
            restart after idle
    groups: with K > 1, every group bridge connects to one core bridge through a veth pair
            shaped at Z Mbit/s per direction (the global links of a Dragonfly group)
    delay:  netem under the tbf where the kernel has it; otherwise --latency-ms fails clearly
    MTU:    --mtu on every emulated link (default 1500, Ethernet). TCP/IP/Ethernet headers
            then take 4.4 % of a shaped link (at most 0.956 of the rate is TCP payload, one
            way or loaded in both directions); 9000 (jumbo frames, cluster fabrics) ~1 %.

Each namespace runs `torchrun --nnodes N --nproc-per-node G --node-rank i` with a static
rendezvous at node 0 (GLOO_SOCKET_IFNAME=eth0 so gloo uses the shaped NIC; ranks of one node
talk over local routes, unshaped, like NVLink next to a NIC). CMD is run by every worker
(`--no-python`); a CMD starting with a `.py` file is run with this interpreter. The exit
status is the first non-zero one of the agents. Everything is torn down on success, failure,
timeout, Ctrl-C and SIGTERM; names carry the pid so parallel runs never collide.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["EmulatedCluster", "EmulatorError", "leftovers", "main", "node_address", "peer_queues",
           "tbf_args"]

MASTER_PORT = 29500  # every emulated node has its own namespace, so the port is always free


class EmulatorError(RuntimeError):
    """The emulated cluster cannot be built or run here (no root, no ip, no netem, ...)."""


def node_address(i: int) -> str:
    """IPv4 address of emulated node i inside 198.18.0.0/15 (up to 500 nodes)."""
    if not 0 <= i < 500:
        raise ValueError(f"node index {i} out of range 0..499")
    return f"198.18.{i // 250}.{i % 250 + 1}"


def _run(cmd: list[str], check: bool = True,
         stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, input=stdin)
    if check and proc.returncode != 0:
        raise EmulatorError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout}")
    return proc


def tbf_args(mbit: float) -> list[str]:
    """The `tc qdisc ... tbf` arguments that shape a NIC to `mbit` Mbit/s."""
    # burst >= rate/HZ is needed to reach the rate, and >= one 64 KiB TSO/GSO packet (plus
    # headers) so that tbf passes such packets whole, as a NIC puts a TSO packet on the wire
    # at line rate, instead of segmenting each one in software (CPU the emulated cluster's
    # processes need); 2 ms of traffic above that. A 1 s queue absorbs the synchronised
    # bursts of an all-to-all (28 TCP flows into one node at 8x2) without tail drops, each
    # of which would cost a >= 200 ms retransmission timeout.
    rate_bytes = mbit * 1e6 / 8
    burst = max(int(rate_bytes * 0.002), 96 * 1024)
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "1000ms"]


def peer_queues(dev: str, mbit: float, mtu: int, nodes: int, field: str) -> str:
    """tc batch: under the tbf (handle 2:), an htb that only orders, never limits (every
    class may take 10x the link), with one class per emulated node matched on the packet's
    IPv4 `field` and served round-robin, a quantum of two frames each. A NIC arbitrates
    between its queue pairs like this; one FIFO would let whichever socket wrote first hold
    the link, so that in an all-to-all several senders crowd one receiver while others idle.
    Each class queues 1 s of traffic (>= 10000 packets), like the tbf, so nothing drops."""
    fast = f"{10 * mbit}mbit"
    packets = max(10_000, int(mbit * 1e6 / 8 / 1000))
    quantum = 2 * (mtu + 14)
    lines = [f"qdisc add dev {dev} parent 2:1 handle 3: htb default {nodes + 1}"]
    for k in range(1, nodes + 2):  # class k serves node k - 1; the last one the rest (ARP)
        lines.append(f"class add dev {dev} parent 3: classid 3:{k} htb rate {fast} "
                     f"ceil {fast} quantum {quantum}")
        lines.append(f"qdisc add dev {dev} parent 3:{k} pfifo limit {packets}")
    for i in range(nodes):
        lines.append(f"filter add dev {dev} parent 3: protocol ip prio 1 u32 match ip "
                     f"{field} {node_address(i)}/32 flowid 3:{i + 1}")
    return "\n".join(lines) + "\n"


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links whose name starts with the run's prefix (for leak checks)."""
    found = []
    ns = _run(["ip", "netns", "list"], check=False).stdout.split()
    found += [name for name in ns if name.startswith(prefix)]
    tag = prefix.replace("pmoe-", "")
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for line in links:
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name[:3] in ("pmv", "pmb", "pmu", "pmc") and name[3:].startswith(tag):
                found.append(name)
    return found


@dataclass
class EmulatedCluster:
    """Context manager: builds the namespaces and links on enter, removes them on exit."""

    nodes: int
    gpus_per_node: int
    nic_mbit: float
    latency_ms: float | None = None
    groups: int = 1
    global_mbit: float | None = None
    tag: str = field(default_factory=lambda: str(os.getpid()))
    mtu: int = 1500
    tcp_cc: str = "reno"
    fair_queue: bool = True
    _made_ns: list[str] = field(default_factory=list, init=False)
    _made_links: list[str] = field(default_factory=list, init=False)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= 500:
            raise ValueError(f"nodes must be an int in 1..500, got {self.nodes!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")
        if not self.nic_mbit > 0:
            raise ValueError(f"nic_mbit must be > 0, got {self.nic_mbit}")
        if not 1 <= self.groups <= self.nodes:
            raise ValueError(f"groups must be in 1..nodes={self.nodes}, got {self.groups}")
        if self.groups > 1 and (self.global_mbit is None or not self.global_mbit > 0):
            raise ValueError(f"--groups {self.groups} needs --global-mbit > 0")
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be an int in 576..65535 bytes, got {self.mtu!r}")
        if not isinstance(self.tcp_cc, str) or not self.tcp_cc.isidentifier():
            raise ValueError(f"tcp_cc must be a congestion control name, got {self.tcp_cc!r}")
        if self.latency_ms is not None and self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")

    @property
    def prefix(self) -> str:
        return f"pmoe-{self.tag}"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def group_of(self, i: int) -> int:
        return i * self.groups // self.nodes

    # ---- setup / teardown ---------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        if os.geteuid() != 0:
            raise EmulatorError("the emulator needs root (network namespaces, veth, tc)")
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise EmulatorError(f"the emulator needs iproute2; not found on PATH: {missing}")
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _link(self, name: str) -> str:
        self._made_links.append(name)
        return name

    def _shape(self, dev: str, mbit: float, ns: str | None = None,
               peer_field: str | None = None) -> None:
        """tbf at `mbit` on dev's egress; with peer_field ("dst" or "src"), the queue under
        the tbf serves one class per emulated peer node round-robin."""
        pre = ["ip", "netns", "exec", ns] if ns else []
        if self.latency_ms:
            netem = _run(pre + ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                                "netem", "delay", f"{self.latency_ms}ms"], check=False)
            if netem.returncode != 0:
                raise EmulatorError(
                    f"--latency-ms {self.latency_ms} needs the netem qdisc, which this kernel "
                    f"does not provide ({netem.stderr.strip()}); run without --latency-ms"
                )
            _run(pre + ["tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:",
                        *tbf_args(mbit)])
        else:
            _run(pre + ["tc", "qdisc", "add", "dev", dev, "root", "handle", "2:", *tbf_args(mbit)])
        if peer_field and self.fair_queue:
            batch = peer_queues(dev, mbit, self.mtu, self.nodes, peer_field)
            _run(pre + ["tc", "-batch", "-"], stdin=batch)

    def _set_cc(self, inside: list[str]) -> None:
        # A namespace inherits the host's TCP congestion control. A model-based one (BBR)
        # keeps the shaped queue nearly empty and, with the acks of one direction queued
        # behind the data of the other, leaves the link idle part of the time; a cluster
        # NIC under an all-to-all stays busy. The loss-based default keeps the queue full.
        cc = _run(inside + ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.tcp_cc}"],
                  check=False)
        if cc.returncode != 0:
            raise EmulatorError(
                f"cannot select TCP congestion control {self.tcp_cc!r} in the emulated nodes "
                f"({cc.stderr.strip()}); pass --tcp-cc with one of "
                "/proc/sys/net/ipv4/tcp_available_congestion_control"
            )

    def _build(self) -> None:
        t = self.tag
        core = None
        if self.groups > 1:
            core = self._link(f"pmb{t}c")
            _run(["ip", "link", "add", core, "type", "bridge"])
            _run(["ip", "link", "set", core, "mtu", str(self.mtu), "up"])
        bridges = []
        for k in range(self.groups):
            br = self._link(f"pmb{t}g{k}")
            _run(["ip", "link", "add", br, "type", "bridge"])
            _run(["ip", "link", "set", br, "mtu", str(self.mtu), "up"])
            bridges.append(br)
            if core is not None:
                up, down = self._link(f"pmu{t}g{k}"), f"pmc{t}g{k}"
                _run(["ip", "link", "add", up, "type", "veth", "peer", "name", down])
                _run(["ip", "link", "set", up, "mtu", str(self.mtu), "master", br, "up"])
                _run(["ip", "link", "set", down, "mtu", str(self.mtu), "master", core, "up"])
                assert self.global_mbit is not None
                self._shape(up, self.global_mbit)  # group k -> core
                self._shape(down, self.global_mbit)  # core -> group k
        for i in range(self.nodes):
            ns, host = self.namespace(i), f"pmv{t}n{i}"
            _run(["ip", "netns", "add", ns])
            self._made_ns.append(ns)
            _run(["ip", "link", "add", self._link(host), "type", "veth", "peer", "name",
                  f"pmi{t}n{i}"])
            _run(["ip", "link", "set", f"pmi{t}n{i}", "netns", ns])
            inside = ["ip", "netns", "exec", ns]
            _run(inside + ["ip", "link", "set", f"pmi{t}n{i}", "name", "eth0"])
            _run(inside + ["ip", "addr", "add", f"{node_address(i)}/15", "dev", "eth0"])
            _run(inside + ["ip", "link", "set", "eth0", "mtu", str(self.mtu), "up"])
            _run(inside + ["ip", "link", "set", "lo", "up"])
            # An all-to-all leaves each TCP connection idle between calls; Linux would then
            # restart slow start and a 256 KB message would never reach the shaped rate.
            # Cluster fabrics (RDMA) have no such ramp, so the emulated nodes turn it off.
            _run(inside + ["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"],
                 check=False)
            self._set_cc(inside)
            _run(["ip", "link", "set", host, "mtu", str(self.mtu), "master",
                  bridges[self.group_of(i)], "up"])
            self._shape("eth0", self.nic_mbit, ns, "dst")  # what node i sends
            self._shape(host, self.nic_mbit, None, "src")  # what node i receives

    def teardown(self) -> None:
        """Stop our processes, delete our namespaces and links; safe to call twice."""
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()
        for ns in self._made_ns:
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:  # strays that left our process groups; they live in our netns
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
        self._made_ns.clear()
        for link in reversed(self._made_links):  # veth peers and bridge ports go with them
            _run(["ip", "link", "del", link], check=False)
        self._made_links.clear()

    # ---- running ------------------------------------------------------------------------
    def agent_command(self, i: int, cmd: Sequence[str]) -> list[str]:
        cmd = list(cmd)
        if cmd and cmd[0].endswith(".py"):
            cmd = [sys.executable, *cmd]
        return [
            "ip", "netns", "exec", self.namespace(i),
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(self.nodes), "--nproc-per-node", str(self.gpus_per_node),
            "--node-rank", str(i), "--master-addr", node_address(0),
            "--master-port", str(MASTER_PORT), "--no-python", *cmd,
        ]  # fmt: skip

    def run(self, cmd: Sequence[str], timeout_s: float | None = None) -> int:
        """Run CMD on every emulated node; returns the first non-zero exit status (or 0)."""
        if not cmd:
            raise ValueError("no command given to run on the emulated cluster")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
               "PIPER_EMU_NODES": str(self.nodes), "PIPER_EMU_GPUS": str(self.gpus_per_node),
               "PIPER_EMU_NIC_MBIT": str(self.nic_mbit)}
        for i in range(self.nodes):
            self._procs.append(subprocess.Popen(self.agent_command(i, cmd), env=env,
                                                start_new_session=True))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        status = 0
        while any(p.poll() is None for p in self._procs):
            if deadline is not None and time.monotonic() > deadline:
                self.teardown_processes()
                return 124
            failed = [p.returncode for p in self._procs if p.returncode not in (None, 0)]
            if failed:  # one agent died: the others would wait for it until their timeout
                status = failed[0]
                self.teardown_processes()
                return status
            time.sleep(0.1)
        codes = [p.returncode for p in self._procs]
        self._procs.clear()
        return next((c for c in codes if c != 0), 0)

    def teardown_processes(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self._procs.clear()


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m comm.emulate [options] -- CMD ...  (missing '--')")
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m comm.emulate", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--nic-mbit", type=float, required=True)
    p.add_argument("--latency-ms", type=float, default=None)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--global-mbit", type=float, default=None)
    p.add_argument("--mtu", type=int, default=1500, help="bytes per frame on every link")
    p.add_argument("--tcp-cc", default="reno",
                   help="TCP congestion control inside the emulated nodes (default reno)")
    p.add_argument("--fifo", action="store_true",
                   help="one FIFO behind each shaped NIC instead of a round-robin per peer")
    p.add_argument("--timeout-s", type=float, default=None)
    return p.parse_args(argv[:split]), argv[split + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    args, cmd = _parse(sys.argv[1:] if argv is None else argv)

    def on_sigterm(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the context manager's teardown

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with EmulatedCluster(args.nodes, args.gpus_per_node, args.nic_mbit, args.latency_ms,
                             args.groups, args.global_mbit, mtu=args.mtu, tcp_cc=args.tcp_cc,
                             fair_queue=not args.fifo) as cluster:
            return cluster.run(cmd, args.timeout_s)
    except (EmulatorError, ValueError) as e:
        print(f"comm.emulate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
