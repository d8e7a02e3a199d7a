"""One hostfile, converted for each launcher (pure: text in, text out).

* Open MPI: a hostfile (``name slots=N``) and the MCA settings that keep MPI
  traffic on the mesh links (``btl_tcp_if_include`` with the link subnets).
* MPICH / Hydra: a hostfile (``name:N``).
* ``mlx.launch``: its JSON hostfile, ``ips`` in ring order for ``ring``, the
  device matrix for ``jaccl``.
* ``HPCMAC_IBV_DEVICES``: the RDMA device matrix hpcmac's rdma transport reads.
* Routes: which per-peer host routes are missing from a route table, and the
  commands that add them.
"""

from __future__ import annotations

import ipaddress
import json
import re

from hpcmac.launch.hostfile import Hostfile
from hpcmac.launch.topology import Route, mesh_subnets, required_routes, ring_order


def openmpi_hostfile(hf: Hostfile) -> str:
    """Open MPI hostfile text: one ``ssh-name slots=N`` line per host."""
    return "".join(f"{h.ssh} slots={h.slots}\n" for h in hf.hosts)


def mpich_hostfile(hf: Hostfile) -> str:
    """MPICH (Hydra) hostfile text: one ``ssh-name:N`` line per host."""
    return "".join(f"{h.ssh}:{h.slots}\n" for h in hf.hosts)


def openmpi_mca(hf: Hostfile) -> list[tuple[str, str]]:
    """MCA (name, value) pairs that keep MPI's bytes on the mesh links.

    ``oob_tcp_if_include`` is deliberately left alone: matching several
    interfaces with it crashes PRRTE 3 (Open MPI 5.0.x) intermittently.
    A hostfile without links (this machine, or hosts on a switch) gets none:
    Open MPI's defaults then use shared memory between ranks on one host,
    where TCP over loopback made local jobs several times slower.
    """
    if not hf.links:
        return []
    return [("btl", "tcp,self"), ("btl_tcp_if_include", btl_tcp_if_include(hf))]


def btl_tcp_if_include(hf: Hostfile) -> str:
    """The value that matches every mesh interface and nothing else.

    The smallest network covering all link subnets, when it holds no
    management address (each host then matches it with all its cables and
    Open MPI does not warn about subnets a host lacks); else the subnets.
    """
    nets = [ipaddress.ip_network(s) for s in mesh_subnets(hf)]
    cover = nets[0]
    while not all(n.subnet_of(cover) for n in nets):
        cover = cover.supernet()
    others = [ipaddress.ip_address(ip) for h in hf.hosts for ip in h.ips]
    if cover.prefixlen >= 8 and not any(ip in cover for ip in others):
        return str(cover)
    return ",".join(str(n) for n in nets)


LOCAL_NAMES = ("localhost", "127.0.0.1")


def is_local(ssh: str) -> bool:
    """True for a host that is this machine (``localhost``, ``127.0.0.1``)."""
    return ssh.split("@")[-1] in LOCAL_NAMES


def mlx_hostfile(hf: Hostfile, backend: str | None = None, np: int | None = None) -> dict:
    """``mlx.launch`` JSON hostfile for ``backend`` (default: the hostfile's, else ring).

    One entry per rank. ring: with links, one rank per host in a ring order
    through the cables, each host's ``ips`` its address on the cable to its
    left neighbour (what ``mlx.distributed_config`` writes); without links,
    ``np`` ranks placed by slot (default: every slot), each with its host's
    management ``ips``. jaccl: hostfile order, management ``ips`` (rank 0's
    first one is the coordinator) and the RDMA device matrix. A local host
    (``localhost``) becomes ``127.0.0.1`` for ``ssh`` and ``ips``: mlx.launch
    starts those ranks without ssh.
    """
    from hpcmac.launch.topology import rank_hosts

    backend = backend or hf.backend or "ring"

    def entry(name: str, ips: list[str]) -> dict:
        h = hf.host(name)
        if is_local(h.ssh):
            return {"ssh": "127.0.0.1", "ips": ips or ["127.0.0.1"]}
        return {"ssh": h.ssh, "ips": ips}

    hosts = []
    if backend == "ring":
        if hf.links:
            order = ring_order(hf) or hf.names
            for i, name in enumerate(order):
                lk = hf.link_between(name, order[i - 1]) if len(order) > 1 else None
                hosts.append(entry(name, [lk.end_of(name).addr] if lk else list(
                    hf.host(name).ips)))
        else:
            hosts = [entry(name, list(hf.host(name).ips)) for name in rank_hosts(hf, np)]
    else:
        matrix = ibv_matrix(hf)
        for i, h in enumerate(hf.hosts):
            hosts.append({**entry(h.name, list(h.ips)), "rdma": matrix[i]})
    return {"backend": backend, "envs": list(hf.envs), "hosts": hosts}


def missing_rdma_pairs(hf: Hostfile, ring: bool = False) -> list[tuple[str, str]]:
    """Host pairs JACCL needs a device for and the hostfile has none (hostfile order).

    Every pair for ``jaccl``; ring neighbours only for ``jaccl-ring`` (``ring``).
    """
    names, matrix = hf.names, ibv_matrix(hf)
    n = len(names)
    out = []
    for i in range(n):
        peers = {(i - 1) % n, (i + 1) % n} if ring else set(range(n))
        for j in sorted(peers - {i}):
            if i < n and j < len(matrix[i]) and matrix[i][j] is None:
                out.append((names[i], names[j]))
    return out


def ibv_matrix(hf: Hostfile) -> list[list[str | None]]:
    """RDMA device matrix: row i, column j = host i's device on its cable to host j.

    From the links when there are any, else from each host's ``rdma`` row;
    null on the diagonal and where there is no cable.
    """
    names = hf.names
    rows: list[list[str | None]] = []
    for i, a in enumerate(names):
        if not hf.links and hf.hosts[i].rdma is not None:
            rows.append(list(hf.hosts[i].rdma))
            continue
        row: list[str | None] = []
        for b in names:
            lk = hf.link_between(a, b) if a != b else None
            row.append(lk.end_of(a).rdma if lk else None)
        rows.append(row)
    return rows


def ibv_rank_matrix(hf: Hostfile, np: int | None = None) -> list[list[str | None]]:
    """The device matrix by rank, for ``np`` ranks placed by slot (mpirun's default).

    With one rank per host it is :func:`ibv_matrix`; ranks sharing a host get
    null between them (no cable), so a transport that needs a device for every
    pair sees that it cannot run and says so.
    """
    from hpcmac.launch.topology import rank_hosts

    names = hf.names
    by_host = ibv_matrix(hf)
    hosts = [names.index(h) for h in rank_hosts(hf, np)]
    return [[None if a == b else by_host[a][b] for b in hosts] for a in hosts]


def ibv_devices_env(hf: Hostfile, np: int | None = None) -> str:
    """The value of ``HPCMAC_IBV_DEVICES``: the rank matrix as inline JSON.

    Without ``np`` (and for ``mlx.launch``, one rank per host) it is the host matrix.
    """
    matrix = ibv_matrix(hf) if np is None else ibv_rank_matrix(hf, np)
    return json.dumps(matrix, separators=(",", ":"))


# ------------------------------------------------------------------ routes

_LINUX_ROUTE = re.compile(r"^(?P<dst>\d+\.\d+\.\d+\.\d+(?:/\d+)?)\s.*\bdev\s+(?P<dev>\S+)")


def parse_route_table(text: str) -> list[tuple[ipaddress.IPv4Network, str]]:
    """(destination network, interface) rows from ``ip -4 route show`` or ``netstat -rn -f inet``.

    Linux rows look like ``10.77.1.0/30 dev tb1 proto kernel scope link``;
    macOS rows like ``10.77.1.2  link#18  UHLWIi  en2`` (destination, gateway,
    flags, interface). ``default`` routes are skipped: they do not pin a peer
    address to its cable.
    """
    rows: list[tuple[ipaddress.IPv4Network, str]] = []
    for line in text.splitlines():
        line = line.strip()
        m = _LINUX_ROUTE.match(line)
        if m:
            rows.append((ipaddress.ip_network(m["dst"], strict=False), m["dev"]))
            continue
        parts = line.split()
        if len(parts) >= 4 and re.match(r"^\d+(\.\d+){0,3}(/\d+)?$", parts[0]):
            dst = parts[0]
            if "/" not in dst:
                octets = dst.split(".")
                # netstat abbreviates networks: 10.77.1/30 or 10.77; a full dotted quad is a host
                dst = ".".join(octets + ["0"] * (4 - len(octets))) + \
                    ("" if len(octets) == 4 else f"/{8 * len(octets)}")
            else:
                addr, plen = dst.split("/")
                octets = addr.split(".")
                dst = ".".join(octets + ["0"] * (4 - len(octets))) + "/" + plen
            try:
                rows.append((ipaddress.ip_network(dst, strict=False), parts[3]))
            except ValueError:
                continue
    return rows


def route_iface(table: list[tuple[ipaddress.IPv4Network, str]], addr: str) -> str | None:
    """The interface the longest matching row sends ``addr`` through, or None."""
    ip = ipaddress.ip_address(addr)
    best: tuple[int, str] | None = None
    for net, dev in table:
        if ip in net and (best is None or net.prefixlen > best[0]):
            best = (net.prefixlen, dev)
    return best[1] if best else None


def missing_routes(hf: Hostfile, tables: dict[str, str]) -> list[Route]:
    """Routes from :func:`required_routes` that ``tables`` (host -> route table text) lack.

    A route is present when the table sends the peer address through the
    direct cable's interface. Hosts absent from ``tables`` are not checked.
    """
    parsed = {h: parse_route_table(t) for h, t in tables.items()}
    return [r for r in required_routes(hf)
            if r.host in parsed and route_iface(parsed[r.host], r.addr) != r.iface]


def route_commands(routes: list[Route], os_name: str = "macos") -> list[str]:
    """``# host`` headers and the exact commands that add ``routes`` (macos or linux)."""
    lines: list[str] = []
    current = None
    for r in routes:
        if r.host != current:
            lines.append(f"# on {r.host}")
            current = r.host
        lines.append(r.macos() if os_name == "macos" else r.linux())
    return lines
