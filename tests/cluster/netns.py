"""A Thunderbolt-like mesh of hosts made of Linux network namespaces.

Built from an hpcmac hostfile: one namespace per host (named
``prefix + ssh name``), one veth pair per link carrying the link's interface
names and /30 addresses, MTU 9000 like IP over Thunderbolt. Like a real Mac,
each host also has a management Ethernet port, ``en0``, created first (so it
is the first address a host lists), holding the host's ``ips`` on one
switched /24 (a bridge in a namespace of its own) with the default route: a
transport that picks addresses by routing luck sends its bytes there. Processes enter a
host with :meth:`Mesh.argv`, which also gives them the host's own hostname
(``unshare --uts``). :meth:`Mesh.destroy` kills whatever runs in the
namespaces and deletes them; it is safe to call twice and after a failed
:meth:`Mesh.create`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from hpcmac.launch.hostfile import Hostfile, load

AGENT = str(Path(__file__).with_name("netns-agent"))


def sh(*argv: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=timeout)


def capability() -> str:
    """'' when this machine can build namespace meshes, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            return f"{tool} is not installed (iproute2 / util-linux)"
    probe = f"hpcmac-probe-{os.getpid()}"
    res = sh("ip", "netns", "add", probe, check=False)
    if res.returncode:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return ""


class Mesh:
    """The hosts of ``hostfile`` as namespaces ``prefix + ssh``."""

    def __init__(self, hostfile: str | Path, prefix: str):
        self.hf: Hostfile = load(hostfile)
        self.path = str(hostfile)
        self.prefix = prefix
        self.ns = {h.name: prefix + h.ssh for h in self.hf.hosts}
        self.hostname = {h.name: h.ssh for h in self.hf.hosts}
        self.switch = prefix + "sw"

    # ---------------------------------------------------------- lifecycle
    def create(self, routes: bool = True, tcp_retries2: int = 3,
               management: bool = True) -> None:
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            # a dead peer is noticed in seconds instead of ~15 minutes
            sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w",
               f"net.ipv4.tcp_retries2={tcp_retries2}")
        tag = f"{os.getpid() % 100000}"
        if management:
            self._management(tag)
        for k, lk in enumerate(self.hf.links):
            a, b = lk.ends
            ta, tb = f"hm{tag}l{k}a", f"hm{tag}l{k}b"
            sh("ip", "link", "add", ta, "type", "veth", "peer", "name", tb)
            plen = lk.subnet.split("/")[1]
            for tmp, end in ((ta, a), (tb, b)):
                ns = self.ns[end.host]
                sh("ip", "link", "set", tmp, "netns", ns)
                sh("ip", "-n", ns, "link", "set", tmp, "name", end.iface)
                sh("ip", "-n", ns, "addr", "add", f"{end.addr}/{plen}", "dev", end.iface)
                sh("ip", "-n", ns, "link", "set", end.iface, "up", "mtu", "9000")
        if routes:
            self.add_routes()

    def _management(self, tag: str) -> None:
        """``en0`` on every host, all on one bridge, with the default route."""
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for k, h in enumerate(self.hf.hosts):
            if not h.ips:
                continue
            ta, tb = f"hm{tag}m{k}a", f"hm{tag}m{k}b"
            ns = self.ns[h.name]
            sh("ip", "link", "add", ta, "type", "veth", "peer", "name", tb)
            sh("ip", "link", "set", ta, "netns", ns)
            sh("ip", "-n", ns, "link", "set", ta, "name", "en0")
            for ip in h.ips:
                sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "en0")
            sh("ip", "-n", ns, "link", "set", "en0", "up")
            sh("ip", "-n", ns, "route", "add", "default", "dev", "en0")
            sh("ip", "link", "set", tb, "netns", self.switch)
            sh("ip", "-n", self.switch, "link", "set", tb, "master", "br0", "up")

    def add_routes(self) -> None:
        """The per-peer /32 routes, with the commands ``launch routes --os linux`` prints."""
        from hpcmac.launch.topology import required_routes

        for r in required_routes(self.hf):
            self.run(r.host, r.linux().split())

    def heal(self) -> None:
        """Undo faults: every link up, no iptables rule, routes back (link down drops them)."""
        for lk in self.hf.links:
            for e in lk.ends:
                self.run(e.host, ["ip", "link", "set", e.iface, "up"], check=False)
        for host in self.ns:
            self.run(host, ["iptables", "-F"], check=False)
        self.add_routes()

    def kill_all(self) -> list[str]:
        """SIGKILL every process in the namespaces; what was still running."""
        leftovers = []
        for name, ns in self.ns.items():
            if not Path(f"/run/netns/{ns}").exists():
                continue
            for p in self.pids(name):
                leftovers.append(f"{name}:{p}:{_cmdline(p)}")
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return leftovers

    def destroy(self) -> list[str]:
        """Kill every process in the namespaces, delete them; what was still running."""
        leftovers = self.kill_all()
        for ns in [*self.ns.values(), self.switch]:
            if Path(f"/run/netns/{ns}").exists():
                sh("ip", "netns", "del", ns, check=False)
        return leftovers

    # ------------------------------------------------------------ helpers
    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run on ``host``: in its namespace, under its own hostname."""
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--uts", "sh", "-c",
                'hostname "$1"; shift; exec "$@"', "sh", self.hostname[host], *argv]

    def run(self, host: str, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.ns[host], *argv, check=check)

    def pids(self, host: str) -> list[int]:
        res = sh("ip", "netns", "pids", self.ns[host], check=False)
        return [int(p) for p in res.stdout.split()]

    def wait_idle(self, seconds: float = 10) -> list[str]:
        """Wait until no process runs in any namespace; what still runs after ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            busy = [f"{h}:{p}:{_cmdline(p)}" for h in self.ns for p in self.pids(h)]
            if not busy or time.monotonic() > deadline:
                return busy
            time.sleep(0.2)

    def counters(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(host, iface) -> (rx_bytes, tx_bytes) for every link end."""
        out = {}
        for host, ns in self.ns.items():
            res = sh("ip", "-n", ns, "-j", "-s", "link", "show")
            for dev in json.loads(res.stdout):
                st = dev.get("stats64") or dev.get("stats")
                out[(host, dev["ifname"])] = (st["rx"]["bytes"], st["tx"]["bytes"])
        return out

    def env(self) -> dict[str, str]:
        """Environment for a launcher using :data:`AGENT` on this mesh."""
        return {**os.environ, "HPCMAC_NETNS_PREFIX": self.prefix}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return "?"
