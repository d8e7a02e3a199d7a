"""Discover a Thunderbolt mesh over ssh and write its hostfile.

What ``mlx.distributed_config`` does, for hpcmac's hostfile: on each Mac,
read ``system_profiler SPThunderboltDataType -json`` (which port is cabled to
which other Mac's Thunderbolt domain), ``networksetup -listallhardwareports``
(port -> ``enX``), ``ibv_devices``/``ibv_devinfo`` (RDMA devices and port
states), ``rdma_ctl status``, ``sysctl -n hw.memsize`` and the management
address (``ipconfig getifaddr en0``, else ``en1``); match cables by domain
UUID; give each cable a /30. Every output is read by
:mod:`hpcmac.comm.rdma_ready`.

Parsing and planning are pure functions of the command outputs (tested on
recorded outputs); :func:`collect` is the only part that runs ssh.
"""

from __future__ import annotations

import ipaddress
import subprocess
from dataclasses import dataclass

from hpcmac.comm import rdma_ready
from hpcmac.errors import UsageError

COMMANDS = {
    "thunderbolt": ["system_profiler", "SPThunderboltDataType", "-json"],
    "ports": ["networksetup", "-listallhardwareports"],
    "ibv": ["ibv_devices"],
    "ibv_devinfo": ["ibv_devinfo"],
    "rdma_ctl": ["rdma_ctl", "status"],
    "memsize": ["sysctl", "-n", "hw.memsize"],
    "en0": ["ipconfig", "getifaddr", "en0"],  # the management address, as mlx's config finds it
    "en1": ["ipconfig", "getifaddr", "en1"],
}
MTU = 9000  # jumbo frames on every Thunderbolt link (both ends must agree)


def parse_memsize(text: str) -> float | None:
    """``sysctl -n hw.memsize`` (bytes) -> GiB rounded to a whole number, or None."""
    t = text.strip()
    return float(round(int(t) / 2**30)) if t.isdigit() else None


@dataclass(frozen=True)
class Probe:
    """Everything read from one host (raw command outputs)."""

    name: str
    thunderbolt: str
    ports: str
    ibv: str = ""
    rdma_ctl: str = ""
    memsize: str = ""
    ibv_devinfo: str = ""
    en0: str = ""
    en1: str = ""

    def management_ip(self) -> str | None:
        """The address ssh and JACCL's coordinator use: the ssh name if it is an
        IP, else en0's (Ethernet), else en1's (Wi-Fi on a Mac Studio)."""
        try:
            return str(ipaddress.ip_address(self.name))
        except ValueError:
            pass
        for text in (self.en0, self.en1):
            word = text.strip()
            try:
                return str(ipaddress.ip_address(word))
            except ValueError:
                continue
        return None


def _ports(p: Probe) -> list[rdma_ready.Port]:
    try:
        return rdma_ready.parse_thunderbolt(p.thunderbolt,
                                            rdma_ready.parse_hardware_ports(p.ports))
    except rdma_ready.ProfilerError as exc:
        raise UsageError(f"{p.name}: {exc}") from None


def _rdma_refusal(p: Probe, port: rdma_ready.Port) -> str:
    """Why ``port`` of ``p`` gets no rdma device in the hostfile ('' when it gets one)."""
    why = rdma_ready.port_cannot_rdma(port)
    if why:
        return why
    dev = f"rdma_{port.iface}"
    if dev not in rdma_ready.parse_ibv_devices(p.ibv):
        return f"{dev} is not in ibv_devices"
    states = rdma_ready.parse_ibv_devinfo(p.ibv_devinfo) if p.ibv_devinfo.strip() else None
    if states is not None and states.get(dev) != "PORT_ACTIVE":
        return f"{dev} port is {states.get(dev, 'not in ibv_devinfo')}, not PORT_ACTIVE"
    return ""


def plan_hostfile(probes: list[Probe], base: str = "10.77.0.0/16",
                  ssh: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """The hostfile (as JSON-ready dict) for the probed hosts, and warnings.

    Cables are found by matching a port's peer domain UUID to another host's
    port; each cable gets the next /30 of ``base`` (host listed first: .1).
    A cable end gets ``rdma_<iface>`` only when RDMA is enabled there and the
    port passes :mod:`hpcmac.comm.rdma_ready`'s checks (Thunderbolt 5 speed,
    not a Mac Studio's ``en2``, listed by ``ibv_devices``, ``PORT_ACTIVE``);
    each refusal is a warning naming host, port and why. Each host's ``ips``
    is its management address (:meth:`Probe.management_ip`).
    """
    warnings: list[str] = []
    ports = {}
    owner: dict[str, tuple[int, rdma_ready.Port]] = {}
    for i, p in enumerate(probes):
        ports[i] = _ports(p)
        for port in ports[i]:
            owner[port.uuid] = (i, port)
    enabled = {}
    for i, p in enumerate(probes):
        enabled[i] = rdma_ready.parse_rdma_ctl(p.rdma_ctl) is True
        if rdma_ready.parse_rdma_ctl(p.rdma_ctl) is False:
            warnings.append(f"{p.name}: RDMA disabled ({rdma_ready.ENABLE_FIX})")
        elif not enabled[i]:
            warnings.append(f"{p.name}: rdma_ctl status gave no answer "
                            f"({p.rdma_ctl.strip()[:40]!r}): no RDMA on this Mac")
    subnets = ipaddress.ip_network(base).subnets(new_prefix=30)
    links = []
    seen_pairs: set[frozenset[int]] = set()
    for i, _ in enumerate(probes):
        for port in ports[i]:
            if port.peer_uuid is None or port.peer_uuid not in owner:
                continue
            j, peer_port = owner[port.peer_uuid]
            pair = frozenset((i, j))
            if j == i or pair in seen_pairs:
                if j != i and i < j:
                    warnings.append(f"{probes[i].name}-{probes[j].name}: more than one cable; "
                                    f"using the first, {port.iface} is not used")
                continue
            seen_pairs.add(pair)
            net = next(subnets)
            a, b = list(net.hosts())[:2]

            def end(k, prt, addr):
                dev = None
                if enabled[k]:
                    why = _rdma_refusal(probes[k], prt)
                    if why:
                        warnings.append(f"{probes[k].name} {prt.iface}: {why}; this cable "
                                        "carries TCP only")
                    else:
                        dev = f"rdma_{prt.iface}"
                return {"host": probes[k].name, "iface": prt.iface, "addr": str(addr),
                        "rdma": dev}

            links.append({"subnet": str(net), "ends": [end(i, port, a), end(j, peer_port, b)]})
    hosts = []
    for p in probes:
        h: dict = {"name": p.name, "ssh": (ssh or {}).get(p.name, p.name), "slots": 1}
        mem = parse_memsize(p.memsize)
        if mem is not None:
            h["memory_gb"] = mem
        ip = p.management_ip()
        if ip is not None:
            h["ips"] = [ip]
        else:
            warnings.append(f"{p.name}: no management address (ipconfig getifaddr en0/en1 "
                            "gave none): add \"ips\" by hand for --via mlx")
        hosts.append(h)
    n = len(probes)
    complete = len(seen_pairs) == n * (n - 1) // 2
    if not complete:
        warnings.append(f"{len(seen_pairs)} of {n * (n - 1) // 2} host pairs are cabled: "
                        "not a full mesh")
    out = {"topology": "mesh" if complete or n <= 2 else "ring", "hosts": hosts, "links": links}
    if links and all(e["rdma"] for lk in links for e in lk["ends"]):
        out["backend"] = "jaccl"
    return out, warnings


def services(probes: list[Probe]) -> dict[str, dict[str, str]]:
    """{host: {interface: network service name}} ("Thunderbolt 2" for en3 ...)."""
    return {p.name: {dev: port for port, dev in rdma_ready.parse_hardware_ports(p.ports).items()}
            for p in probes}


def setup_commands(hostfile: dict,
                   service_names: dict[str, dict[str, str]] | None = None) -> dict[str, list[str]]:
    """Per host, the macOS commands that give each cable its address, MTU and routes.

    The Thunderbolt Bridge must go (it would claim every port): its network
    service is disabled, which survives a reboot, and ``bridge0`` is downed
    now. Each cable's interface gets its /30 address and MTU 9000 now
    (``ifconfig``) and for good (``networksetup -setmanual``/``-setMTU``,
    when the service name is known); the per-peer host routes
    (:func:`hpcmac.launch.topology.required_routes`) likewise, with
    ``route`` now and ``networksetup -setadditionalroutes`` for good.
    """
    import shlex

    from hpcmac.launch.hostfile import parse
    from hpcmac.launch.topology import required_routes

    hf = parse(hostfile, "<discovered>")
    svc = service_names or {}
    cmds: dict[str, list[str]] = {
        h.name: ["sudo networksetup -setnetworkserviceenabled 'Thunderbolt Bridge' off",
                 "sudo ifconfig bridge0 down"] for h in hf.hosts}
    for lk in hf.links:
        mask = str(ipaddress.ip_network(lk.subnet).netmask)
        for e in lk.ends:
            cmds[e.host].append(f"sudo ifconfig {e.iface} inet {e.addr} netmask {mask} "
                                f"mtu {MTU} up")
            name = svc.get(e.host, {}).get(e.iface)
            if name:
                cmds[e.host].append(f"sudo networksetup -setmanual {shlex.quote(name)} "
                                    f"{e.addr} {mask}")
            cmds[e.host].append(f"sudo networksetup -setMTU {e.iface} {MTU}")
    routes = required_routes(hf)
    for r in routes:
        cmds[r.host].append(r.macos())
    by_service: dict[tuple[str, str], list[str]] = {}
    for r in routes:
        lk = hf.link_between(r.host, r.peer)
        gateway = lk.peer_of(r.host).addr
        by_service.setdefault((r.host, r.iface), []).append(f"{r.addr} 255.255.255.255 {gateway}")
    for (host, iface), triples in by_service.items():
        name = svc.get(host, {}).get(iface)
        if name:
            cmds[host].append(f"sudo networksetup -setadditionalroutes {shlex.quote(name)} "
                              + " ".join(triples))
    return cmds


def collect(name: str, ssh_cmd: list[str], timeout: float = 30.0) -> Probe:
    """Run the discovery commands on ``name`` through ``ssh_cmd`` (e.g. ``["ssh"]``).

    A command that fails leaves its output empty (e.g. no ``ibv_devices`` before
    macOS 26.2); an unreachable host is a UsageError.
    """
    out: dict[str, str] = {}
    for key, cmd in COMMANDS.items():
        try:
            res = subprocess.run([*ssh_cmd, name, *cmd], capture_output=True, text=True,
                                 timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UsageError(f"{name}: '{' '.join(cmd)}' over ssh took over "
                             f"{timeout:g} s") from None
        if res.returncode == 255:
            last = (res.stderr.strip().splitlines() or ["no message"])[-1]
            raise UsageError(f"{name}: ssh failed ({last})")
        out[key] = res.stdout if res.returncode == 0 else ""
    if not out["thunderbolt"]:
        raise UsageError(f"{name}: system_profiler SPThunderboltDataType gave nothing "
                         "(is this a Mac?)")
    return Probe(name=name, **out)
