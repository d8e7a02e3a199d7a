"""Helpers for the ``ring`` transport's bootstrap: addresses, ports, the hostfile.

MLX's ring backend reads ``MLX_RANK`` and ``MLX_HOSTFILE``, a JSON list with
one entry per rank, each a list of ``"ip:port"`` strings: rank r listens on
its own entry (its left neighbour connects there) and connects to rank r+1's.
Under mpirun hpcmac builds that file itself: every rank picks a free port on
the address its left neighbour reaches it by, and the entries are exchanged
with an MPI allgather.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def ring_hostfile(addresses: list[list[str]]) -> str:
    """JSON text of the ring hostfile from each rank's ``"ip:port"`` list (rank order)."""
    if not addresses or any(not a for a in addresses):
        raise ValueError("ring hostfile: every rank needs at least one ip:port")
    if len({len(a) for a in addresses}) != 1:
        raise ValueError("ring hostfile: every rank needs the same number of connections")
    return json.dumps(addresses)


def free_port(ip: str) -> int:
    """A TCP port free on ``ip`` right now (the OS picks it; free until someone binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def free_ports(ip: str, n: int, tries: int = 50) -> int:
    """A base port ``p`` with ``p .. p + n - 1`` all free on ``ip`` right now.

    For launchers that count up from one port (``mlx.launch --starting-port``). The
    base comes from the OS, so it lies in the ephemeral range; the run is checked by
    binding all ``n`` at once. Raises ``OSError`` when ``tries`` bases all fail.
    """
    if n < 1:
        raise ValueError(f"free_ports: n must be at least 1, got {n}")
    for _ in range(tries):
        base = free_port(ip)
        if base + n - 1 > 65535:
            continue
        socks = []
        try:
            for k in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((ip, base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise OSError(f"no run of {n} free ports on {ip} in {tries} tries")


def parse_ifconfig(text: str) -> list[str]:
    """IPv4 addresses from ``ifconfig`` (BSD/macOS) or ``ip -o -4 addr`` output."""
    out = []
    for line in text.splitlines():
        fields = line.replace("/", " ").split()
        for k, word in enumerate(fields[:-1]):
            if word == "inet":
                addr = fields[k + 1].removeprefix("addr:")
                if addr.count(".") == 3:
                    out.append(addr)
    return out


def local_ipv4() -> list[str]:
    """This host's IPv4 addresses, loopback last."""
    text = ""
    for cmd in (["ip", "-o", "-4", "addr", "show"], ["ifconfig"]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            continue
        if proc.returncode == 0 and proc.stdout.strip():
            text = proc.stdout
            break
    addrs = parse_ifconfig(text)
    if not addrs:
        try:
            addrs = [socket.gethostbyname(socket.gethostname())]
        except OSError:
            addrs = []
    addrs = list(dict.fromkeys(addrs))
    loop = [a for a in addrs if a.startswith("127.")]
    return [a for a in addrs if a not in loop] + loop


def source_address_towards(peer_ips: list[str], mine: list[str]) -> str | None:
    """The first of my addresses the kernel would use to reach one of ``peer_ips``.

    On a Thunderbolt mesh each cable is its own /30, so this is the address
    of my end of the cable to that peer.
    """
    for ip in peer_ips:
        if ip.startswith("127."):
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((ip, 9))  # UDP connect sends nothing; it only picks a route
                src = s.getsockname()[0]
        except OSError:
            continue
        if src in mine:
            return src
    return None


def mesh_host(hf, mine: list[str]) -> str | None:
    """The hostfile host whose link addresses this machine has (``mine``), or None.

    ``hf`` is a :class:`~hpcmac.launch.hostfile.Hostfile`. A host matches when
    one of its link-end addresses is local here; None when none or several do.
    """
    have = set(mine)
    found = {e.host for lk in hf.links for e in lk.ends if e.addr in have}
    return found.pop() if len(found) == 1 else None


def mesh_listen_address(hf, me: str | None, left: str | None) -> str | None:
    """My address on the cable to my left neighbour's host, from the hostfile's links.

    None when either host is unknown or no cable joins them (the caller then
    falls back to the routing table). Pure.
    """
    if me is None or left is None or me == left:
        return None
    lk = hf.link_between(me, left)
    return lk.end_of(me).addr if lk is not None else None


def listen_address(rank: int, hosts: list[str], ips: list[list[str]],
                   mesh: list[str | None] | None = None, hf=None) -> str:
    """The IPv4 address rank ``rank`` listens on for its left neighbour.

    ``hosts`` and ``ips`` are every rank's host name and addresses (gathered);
    ``mesh`` is every rank's hostfile host (:func:`mesh_host`) and ``hf`` the
    hostfile (``HPCMAC_HOSTFILE``). With a cable between my host and my left
    neighbour's in the hostfile, its address is the answer: the mesh, never
    the Ethernet port that happens to route to the peer. Else
    ``HPCMAC_RING_ADDR`` overrides; ranks on one host use 127.0.0.1; else the
    source address the routing table picks.
    """
    override = os.environ.get("HPCMAC_RING_ADDR")
    if override:
        return override
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    left = (rank - 1) % len(hosts)
    if hosts[left] == hosts[rank]:
        return "127.0.0.1"
    if hf is not None and mesh is not None:
        addr = mesh_listen_address(hf, mesh[rank], mesh[left])
        if addr is not None:
            return addr
    src = source_address_towards(ips[left], ips[rank])
    if src:
        return src
    others = [a for a in ips[rank] if not a.startswith("127.")]
    if not others:
        print(f"hpcmac ring: rank {rank} has no non-loopback address", file=sys.stderr)
        return "127.0.0.1"
    return others[0]
