"""RDMA-over-Thunderbolt readiness: every macOS command output parsed in one place.

A Mac can carry JACCL (MLX's RDMA backend) on a cable only when all of this
holds, each read from a command's output by a pure function here:

* ``rdma_ctl status`` says enabled (switched on from Recovery);
* ``ibv_devices`` lists the cable's ``rdma_enX`` device and ``ibv_devinfo``
  shows its port ``PORT_ACTIVE`` (a cable is in and the peer is up);
* the port can do RDMA at all (``system_profiler SPThunderboltDataType``):
  a port running at 40 Gb/s or less is Thunderbolt 4 (or a TB4 cable) and
  shows an ``rdma_en*`` device that cannot do RDMA; on a Mac Studio the
  port next to the Ethernet jack (``en2``) cannot do RDMA (exo's docs);
* the Thunderbolt interface has its IPv4 address (``ifconfig``);
* every Mac runs the same macOS build (``sw_vers``).

:func:`host_refusals` and :func:`cluster_refusals` turn the outputs into
:class:`Refusal` lines that name the host, the port and why, with the
command that fixes it. Used by the ``rdma`` transport's probe
(:mod:`hpcmac.comm.rdma_env`), ``launch discover`` and ``launch doctor``.
Tested on recorded outputs (``tests/unit/fixtures/rdma``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

ENABLE_FIX = "boot into Recovery, open Terminal, run: rdma_ctl enable; then restart"
MIN_RDMA_GBPS = 80.0  # Thunderbolt 5; 40 Gb/s ports (TB4) show devices but cannot do RDMA
_DEVICE = re.compile(r"^[A-Za-z0-9_.-]+$")
_GUID = re.compile(r"^[0-9a-fA-F:]{16,19}$")


# ---------------------------------------------------------------- rdma_ctl

def parse_rdma_ctl(text: str | None) -> bool | None:
    """``rdma_ctl status`` -> True (enabled), False (disabled), None (no usable answer).

    Recorded variants: ``enabled``, ``disabled``, ``RDMA is not enabled``,
    ``RDMA is enabled``; anything else (a usage text, "command not found",
    nothing) is None.
    """
    if text is None:
        return None
    t = " ".join(text.strip().lower().split())
    if not t or "usage" in t or "not found" in t:
        return None
    if "disabled" in t or "not enabled" in t or "is off" in t:
        return False
    if t == "enabled" or t.endswith(" enabled") or t.endswith(" enabled."):
        return True
    return None


# ---------------------------------------------------------- ibv_devices/info

def parse_ibv_devices(text: str | None) -> list[str]:
    """Device names from ``ibv_devices``: rows of ``name  GUID`` under a two-line header.

    Lines that are not such a row ("No IB devices found", the header, a
    warning) are skipped, so they never become a device.
    """
    names = []
    for line in (text or "").splitlines():
        fields = line.split()
        if len(fields) == 2 and _DEVICE.match(fields[0]) and _GUID.match(fields[1]) \
                and fields[0] != "device":
            names.append(fields[0])
    return names


def parse_ibv_devinfo(text: str | None) -> dict[str, str]:
    """``ibv_devinfo`` -> {device: port state} (``PORT_ACTIVE``, ``PORT_DOWN``, ...).

    A device with several ports reports its first port's state. "No IB
    devices found" gives an empty dict.
    """
    states: dict[str, str] = {}
    dev = None
    for line in (text or "").splitlines():
        s = line.strip()
        if s.startswith("hca_id:"):
            dev = s.split(":", 1)[1].strip()
        elif s.startswith("state:") and dev is not None and dev not in states:
            states[dev] = s.split(":", 1)[1].split()[0]
    return states


# ---------------------------------------------------- system_profiler, ports

@dataclass(frozen=True)
class Port:
    """One Thunderbolt receptacle of a Mac, as ``system_profiler`` and ``networksetup`` say."""

    receptacle: str
    iface: str
    uuid: str
    peer_uuid: str | None
    speed_gbps: float | None  # the receptacle's current (or best, "Up to") speed
    model: str = ""  # the Mac's model name ("Mac Studio")


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


def parse_speed(text: str | None) -> float | None:
    """"Up to 120 Gb/s", "80 Gb/s", "40 Gb/s" -> Gbit/s; None when absent or unreadable."""
    m = re.search(r"([\d.]+)\s*Gb/s", text or "")
    return float(m.group(1)) if m else None


class ProfilerError(ValueError):
    """``system_profiler`` output that is not the expected JSON."""


def parse_thunderbolt(text: str, hardware_ports: dict[str, str]) -> list[Port]:
    """``system_profiler SPThunderboltDataType -json`` -> this Mac's ports, by interface.

    Each top-level entry with a ``domain_uuid_key`` is one receptacle
    (``receptacle_1_tag.receptacle_id_key`` = N, interface
    ``hardware_ports["Thunderbolt N"]``); an item under ``_items`` with its
    own ``domain_uuid_key`` is the Mac on the other end of the cable.
    Receptacles with no network interface are left out.
    """
    try:
        entries = json.loads(text)["SPThunderboltDataType"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ProfilerError(f"system_profiler output is not the expected JSON ({exc})") from None
    ports = []
    for bus in entries:
        uuid = bus.get("domain_uuid_key")
        if uuid is None:
            continue
        tag = bus.get("receptacle_1_tag", {})
        rid = str(tag.get("receptacle_id_key", ""))
        iface = hardware_ports.get(f"Thunderbolt {rid}")
        if iface is None:
            continue  # a receptacle with no IP interface cannot carry a link
        peers = [it["domain_uuid_key"] for it in bus.get("_items", []) if "domain_uuid_key" in it]
        ports.append(Port(receptacle=rid, iface=iface, uuid=uuid,
                          peer_uuid=peers[0] if peers else None,
                          speed_gbps=parse_speed(tag.get("current_speed_key")),
                          model=str(bus.get("device_name_key", ""))))
    return sorted(ports, key=lambda p: (len(p.iface), p.iface))


def port_cannot_rdma(port: Port) -> str:
    """Why ``port`` can never carry RDMA ('' when it can), from its profiler data."""
    if port.speed_gbps is not None and port.speed_gbps < MIN_RDMA_GBPS:
        return (f"Thunderbolt port {port.receptacle} runs at {port.speed_gbps:g} Gb/s "
                "(a Thunderbolt 4 port or cable): it lists an rdma device but cannot do RDMA")
    if port.model == "Mac Studio" and port.iface == "en2":
        return ("en2 is the Mac Studio's Thunderbolt port next to the Ethernet jack, "
                "which cannot do RDMA")
    return ""


# ------------------------------------------------------------ ifconfig, sw_vers

@dataclass(frozen=True)
class Iface:
    """One interface from ``ifconfig`` (macOS) or ``ip -o addr``/``ip -o link`` (Linux)."""

    name: str
    up: bool = False
    mtu: int | None = None
    ipv4: tuple[str, ...] = ()
    active: bool | None = None  # a carrier: macOS "status: active", Linux LOWER_UP


def parse_ifconfig(text: str) -> dict[str, Iface]:
    """``ifconfig`` (macOS, all interfaces or one) -> {name: Iface}.

    Header lines look like ``en2: flags=8863<UP,BROADCAST,...> mtu 9000``,
    followed by indented ``inet 10.77.0.1 netmask 0xfffffffc ...`` and
    ``status: active`` lines.
    """
    out: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        head = re.match(r"^([A-Za-z0-9_.-]+): flags=\w+<([^>]*)>(?:.*\bmtu (\d+))?", line)
        if head:
            cur = head.group(1)
            out[cur] = {"name": cur, "up": "UP" in head.group(2).split(","),
                        "mtu": int(head.group(3)) if head.group(3) else None,
                        "ipv4": [], "active": None}
            continue
        if cur is None:
            continue
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "inet":
            out[cur]["ipv4"].append(fields[1].split("/")[0])
        elif len(fields) >= 2 and fields[0] == "status:":
            out[cur]["active"] = fields[1] == "active"
    return {k: Iface(name=v["name"], up=v["up"], mtu=v["mtu"], ipv4=tuple(v["ipv4"]),
                     active=v["active"]) for k, v in out.items()}


def parse_ip_link_addr(link_text: str, addr_text: str) -> dict[str, Iface]:
    """Linux ``ip -o link show`` and ``ip -o -4 addr show`` -> {name: Iface}."""
    ifs: dict[str, dict] = {}
    for line in link_text.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)(?:@\S+)?:\s+<([^>]*)>.*?\bmtu (\d+)", line)
        if m:
            flags = m.group(2).split(",")
            ifs[m.group(1)] = {"up": "UP" in flags, "active": "LOWER_UP" in flags,
                               "mtu": int(m.group(3)), "ipv4": []}
    for line in addr_text.splitlines():
        m = re.match(r"^\d+:\s+(\S+)\s+inet\s+(\d+\.\d+\.\d+\.\d+)", line)
        if m and m.group(1) in ifs:
            ifs[m.group(1)]["ipv4"].append(m.group(2))
    return {k: Iface(name=k, up=v["up"], mtu=v["mtu"], ipv4=tuple(v["ipv4"]),
                     active=v["active"]) for k, v in ifs.items()}


def parse_sw_vers(text: str) -> dict[str, str]:
    """``sw_vers`` -> {"ProductName", "ProductVersion", "BuildVersion"} (what it printed)."""
    out = {}
    for line in text.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            out[k.strip()] = v.strip()
    return out


# ---------------------------------------------------------------- verdicts

@dataclass(frozen=True)
class Refusal:
    """One reason a host or one of its ports cannot run JACCL, and the fix."""

    host: str
    port: str  # an interface or device, or "-" for the whole host
    why: str
    fix: str

    def line(self) -> str:
        return f"{self.host} {self.port}: {self.why} (fix: {self.fix})"


@dataclass
class HostOutputs:
    """What one Mac printed; None where the command was missing or failed."""

    name: str
    rdma_ctl: str | None = None
    ibv_devices: str | None = None
    ibv_devinfo: str | None = None
    thunderbolt: str | None = None
    hardware_ports: str | None = None
    ifconfig: str | None = None
    sw_vers: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


def host_refusals(h: HostOutputs, ends: list[tuple[str, str, str | None]]) -> list[Refusal]:
    """Why ``h`` cannot run JACCL over its cables; [] when it can.

    ``ends``: this host's cables as (interface, its IPv4 address, rdma device)
    from the hostfile. Pure: reads only the outputs in ``h``.
    """
    out: list[Refusal] = []
    state = parse_rdma_ctl(h.rdma_ctl)
    if h.rdma_ctl is None:
        out.append(Refusal(h.name, "-", "no rdma_ctl: this macOS has no RDMA over Thunderbolt",
                           "update every Mac to macOS 26.2 or later (the same build on all)"))
        return out
    if state is False:
        out.append(Refusal(h.name, "-", f"RDMA is disabled (rdma_ctl status: "
                           f"{h.rdma_ctl.strip()!r})", ENABLE_FIX))
        return out
    if state is None:
        out.append(Refusal(h.name, "-", f"rdma_ctl status gave no answer "
                           f"({h.rdma_ctl.strip()[:60]!r})", "run: rdma_ctl status"))
    devices = parse_ibv_devices(h.ibv_devices)
    states = parse_ibv_devinfo(h.ibv_devinfo) if h.ibv_devinfo is not None else None
    ports: dict[str, Port] = {}
    if h.thunderbolt and h.hardware_ports is not None:
        try:
            ports = {p.iface: p for p in parse_thunderbolt(
                h.thunderbolt, parse_hardware_ports(h.hardware_ports))}
        except ProfilerError as exc:
            out.append(Refusal(h.name, "-", str(exc),
                               "run: system_profiler SPThunderboltDataType -json"))
    ifaces = parse_ifconfig(h.ifconfig) if h.ifconfig is not None else None
    for iface, addr, dev in ends:
        if dev is None:
            out.append(Refusal(h.name, iface, "the hostfile names no rdma device for this cable",
                               f"set \"rdma\": \"rdma_{iface}\" on this link end"))
            continue
        port = ports.get(iface)
        if port is not None:
            why = port_cannot_rdma(port)
            if why:
                out.append(Refusal(h.name, iface, why, "move the cable to a Thunderbolt 5 port "
                                   "(not en2 on a Mac Studio) and run launch discover again"))
                continue
        if h.ibv_devices is not None and dev not in devices:
            have = ", ".join(devices) or "none"
            out.append(Refusal(h.name, iface, f"{dev} is not in ibv_devices ({have})",
                               "check the cable, then: ibv_devices"))
            continue
        if states is not None and states.get(dev) != "PORT_ACTIVE":
            got = states.get(dev, "not listed")
            out.append(Refusal(h.name, iface, f"{dev} port state is {got}, not PORT_ACTIVE",
                               "reseat the cable; if it stays down restart both Macs"))
            continue
        if ifaces is not None:
            info = ifaces.get(iface)
            if info is not None and not info.up:
                out.append(Refusal(h.name, iface, "the interface is down",
                                   f"sudo ifconfig {iface} up"))
            elif info is None or addr not in info.ipv4:
                have = ", ".join(info.ipv4) if info and info.ipv4 else "no IPv4 address"
                out.append(Refusal(h.name, iface, f"has {have}, the hostfile says {addr}",
                                   f"sudo ifconfig {iface} inet {addr} netmask "
                                   "255.255.255.252 up"))
    return out


def cluster_refusals(hosts: list[HostOutputs]) -> list[Refusal]:
    """Cross-host: every Mac must run the same macOS build (JACCL's peers must match)."""
    builds = {h.name: parse_sw_vers(h.sw_vers).get("BuildVersion") for h in hosts
              if h.sw_vers is not None}
    builds = {k: v for k, v in builds.items() if v}
    if len(set(builds.values())) <= 1:
        return []
    first = next(iter(builds))
    return [Refusal(name, "-", f"macOS build {b} differs from {first}'s {builds[first]}",
                    "update every Mac to the same macOS build (System Settings > "
                    "Software Update)")
            for name, b in builds.items() if b != builds[first]]
