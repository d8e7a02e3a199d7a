"""Discover a Thunderbolt mesh over ssh and write its hostfile.

What ``mlx.distributed_config`` does, for hpcmac's hostfile: on each Mac,
read ``system_profiler SPThunderboltDataType -json`` (which port is cabled to
which other Mac's Thunderbolt domain), ``networksetup -listallhardwareports``
(port -> ``enX``), ``ibv_devices`` (RDMA devices), ``rdma_ctl status`` and
``sysctl -n hw.memsize``; match cables by domain UUID; give each cable a /30.

Parsing and planning are pure functions of the command outputs (tested on
recorded outputs); :func:`collect` is the only part that runs ssh.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import dataclass

from hpcmac.errors import UsageError

COMMANDS = {
    "thunderbolt": ["system_profiler", "SPThunderboltDataType", "-json"],
    "ports": ["networksetup", "-listallhardwareports"],
    "ibv": ["ibv_devices"],
    "rdma_ctl": ["rdma_ctl", "status"],
    "memsize": ["sysctl", "-n", "hw.memsize"],
}


@dataclass(frozen=True)
class Port:
    """One Thunderbolt receptacle: its network interface, its domain, and the peer's."""

    iface: str
    uuid: str
    peer_uuid: str | None


def parse_hardware_ports(text: str) -> dict[str, str]:
    """``networksetup -listallhardwareports`` -> {"Thunderbolt 1": "en2", ...}."""
    ports: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Hardware Port:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and name is not None:
            ports[name] = line.split(":", 1)[1].strip()
            name = None
    return ports


def parse_thunderbolt(text: str, hardware_ports: dict[str, str], where: str = "") -> list[Port]:
    """``system_profiler SPThunderboltDataType -json`` -> the host's ports, sorted by interface.

    Each top-level entry with a ``domain_uuid_key`` is one of this Mac's
    receptacles (``receptacle_1_tag.receptacle_id_key`` gives its number, so
    its interface is ``hardware_ports["Thunderbolt N"]``); an item under
    ``_items`` that has its own ``domain_uuid_key`` is another Mac on the cable.
    """
    try:
        data = json.loads(text)
        entries = data["SPThunderboltDataType"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UsageError(f"{where}system_profiler output is not the expected JSON "
                         f"({exc})") from None
    ports = []
    for bus in entries:
        uuid = bus.get("domain_uuid_key")
        if uuid is None:
            continue
        tag = bus.get("receptacle_1_tag", {}).get("receptacle_id_key")
        iface = hardware_ports.get(f"Thunderbolt {tag}")
        if iface is None:
            continue  # a receptacle with no IP interface cannot carry a link
        peers = [it["domain_uuid_key"] for it in bus.get("_items", []) if "domain_uuid_key" in it]
        ports.append(Port(iface=iface, uuid=uuid, peer_uuid=peers[0] if peers else None))
    return sorted(ports, key=lambda p: (len(p.iface), p.iface))


def parse_ibv_devices(text: str) -> list[str]:
    """``ibv_devices`` -> device names (``rdma_en2`` ...), header lines skipped."""
    devs = []
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] not in ("device", "------") and not parts[0].startswith("-"):
            devs.append(parts[0])
    return devs


def parse_rdma_ctl(text: str) -> bool | None:
    """``rdma_ctl status`` -> True (enabled), False (disabled), None (no answer)."""
    t = text.strip().lower()
    if "disabled" in t:
        return False
    if "enabled" in t:
        return True
    return None


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


def plan_hostfile(probes: list[Probe], base: str = "10.77.0.0/16",
                  ssh: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """The hostfile (as JSON-ready dict) for the probed hosts, and warnings.

    Cables are found by matching a port's peer domain UUID to another host's
    port; each cable gets the next /30 of ``base`` (host listed first: .1).
    RDMA devices are ``rdma_<iface>`` when ``ibv_devices`` lists them and
    ``rdma_ctl`` does not say disabled.
    """
    warnings: list[str] = []
    ports = {}
    owner: dict[str, tuple[int, Port]] = {}
    for i, p in enumerate(probes):
        ports[i] = parse_thunderbolt(p.thunderbolt, parse_hardware_ports(p.ports), f"{p.name}: ")
        for port in ports[i]:
            owner[port.uuid] = (i, port)
    rdma_ok = {}
    for i, p in enumerate(probes):
        devs = set(parse_ibv_devices(p.ibv))
        enabled = parse_rdma_ctl(p.rdma_ctl)
        if enabled is False:
            warnings.append(f"{p.name}: RDMA disabled (run rdma_ctl enable from Recovery)")
        rdma_ok[i] = devs if enabled is not False else set()
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
                dev = f"rdma_{prt.iface}"
                return {"host": probes[k].name, "iface": prt.iface, "addr": str(addr),
                        "rdma": dev if dev in rdma_ok[k] else None}

            links.append({"subnet": str(net), "ends": [end(i, port, a), end(j, peer_port, b)]})
    hosts = []
    for p in probes:
        h: dict = {"name": p.name, "ssh": (ssh or {}).get(p.name, p.name), "slots": 1}
        mem = parse_memsize(p.memsize)
        if mem is not None:
            h["memory_gb"] = mem
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


def setup_commands(hostfile: dict) -> dict[str, list[str]]:
    """Per host, the macOS commands that give each cable its address and routes.

    The Thunderbolt Bridge must be down (it would claim every port); each
    cable's interface gets its /30 address; the per-peer host routes come from
    :func:`hpcmac.launch.topology.required_routes`.
    """
    from hpcmac.launch.hostfile import parse
    from hpcmac.launch.topology import required_routes

    hf = parse(hostfile, "<discovered>")
    cmds: dict[str, list[str]] = {h.name: ["sudo ifconfig bridge0 down"] for h in hf.hosts}
    for lk in hf.links:
        mask = str(ipaddress.ip_network(lk.subnet).netmask)
        for e in lk.ends:
            cmds[e.host].append(f"sudo ifconfig {e.iface} inet {e.addr} netmask {mask} up")
    for r in required_routes(hf):
        cmds[r.host].append(r.macos())
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
            raise UsageError(f"{name}: ssh failed ({res.stderr.strip().splitlines()[-1:]})")
        out[key] = res.stdout if res.returncode == 0 else ""
    if not out["thunderbolt"]:
        raise UsageError(f"{name}: system_profiler SPThunderboltDataType gave nothing "
                         "(is this a Mac?)")
    return Probe(name=name, **out)
