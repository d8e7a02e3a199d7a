"""Pure topology questions about a :class:`~hpcmac.launch.hostfile.Hostfile`.

Which pairs a full mesh is missing, a ring order through the links, every
mesh address of a host, and the per-peer routes a full mesh needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations, permutations
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: hostfile validates shapes with these functions
    from hpcmac.launch.hostfile import Hostfile


def missing_mesh_pairs(hf: Hostfile) -> list[tuple[str, str]]:
    """Host pairs (in hostfile order) that have no link between them."""
    return [(a, b) for a, b in combinations(hf.names, 2) if hf.link_between(a, b) is None]


def is_full_mesh(hf: Hostfile) -> bool:
    return bool(hf.links) and not missing_mesh_pairs(hf)


def ring_order(hf: Hostfile) -> list[str] | None:
    """Host names in an order where each is linked to the next (cyclically).

    The hostfile order when it already is one; else the first cycle found
    starting at the first host; None when the links hold no such cycle. A
    ring of one or two hosts needs no cycle beyond the single link.
    """
    names = hf.names
    if len(names) <= 2:
        return names if len(names) < 2 or hf.link_between(*names) else None

    def closes(order: list[str]) -> bool:
        return all(hf.link_between(order[i], order[(i + 1) % len(order)]) is not None
                   for i in range(len(order)))

    if closes(names):
        return names
    if len(names) <= 6:  # every order: at most 120
        for rest in permutations(names[1:]):
            order = [names[0], *rest]
            if closes(order):
                return order
        return None
    # a walk along the links (linear time, any number of hosts): follow from the
    # first host to an unvisited linked neighbour, first in hostfile order
    index = {name: i for i, name in enumerate(names)}
    peers: dict[str, list[str]] = {name: [] for name in names}
    for lk in hf.links:
        a, b = lk.ends[0].host, lk.ends[1].host
        if a in peers and b in peers and a != b:
            peers[a].append(b)
            peers[b].append(a)
    order = [names[0]]
    seen = {names[0]}
    while len(order) < len(names):
        nxt = sorted((p for p in peers[order[-1]] if p not in seen), key=index.__getitem__)
        if not nxt:
            return None
        order.append(nxt[0])
        seen.add(nxt[0])
    return order if closes(order) else None


def mesh_addresses(hf: Hostfile, host: str) -> list[tuple[str, str]]:
    """(interface, address) of every link end on ``host``, in link order."""
    return [(lk.end_of(host).iface, lk.end_of(host).addr) for lk in hf.links_of(host)]


def mesh_subnets(hf: Hostfile) -> list[str]:
    """Every link's subnet, in link order (what ``btl_tcp_if_include`` takes)."""
    return [lk.subnet for lk in hf.links]


@dataclass(frozen=True)
class Route:
    """On ``host``, reach ``addr`` (one of ``peer``'s) through the direct link ``iface``."""

    host: str
    addr: str
    iface: str
    peer: str

    def linux(self) -> str:
        return f"ip route replace {self.addr}/32 dev {self.iface}"

    def macos(self) -> str:
        return f"sudo route -n add -host {self.addr} -interface {self.iface}"


def required_routes(hf: Hostfile) -> list[Route]:
    """The host routes a full mesh needs so that every address of a peer is one hop away.

    A link's own /30 already reaches the peer's address on that link; the
    peer's addresses on its *other* links need a /32 through the direct cable,
    or Open MPI's TCP transport (which tries every address of a peer) fails
    with "Network is unreachable" or takes a detour.
    """
    routes: list[Route] = []
    for h in hf.names:
        for lk in hf.links_of(h):
            mine, peer = lk.end_of(h), lk.peer_of(h)
            for other in hf.links_of(peer.host):
                if other is lk:
                    continue
                addr = other.end_of(peer.host).addr
                routes.append(Route(host=h, addr=addr, iface=mine.iface, peer=peer.host))
    return routes


def rank_hosts(hf: Hostfile, np: int | None = None) -> list[str]:
    """Host name of each rank when ``mpirun --hostfile`` maps by slot (its default).

    Ranks fill the first host's slots, then the next host's, and wrap around
    (oversubscribing) when ``np`` exceeds the slots. Local vs global: the
    same on every rank.
    """
    order = [h.name for h in hf.hosts for _ in range(h.slots)]
    np = len(order) if np is None else np
    return [order[r % len(order)] for r in range(np)]


def memory_per_rank(hf: Hostfile, np: int | None = None) -> list[float | None]:
    """Each rank's share of its host's ``memory_gb`` (None where the host has none)."""
    from collections import Counter

    hosts = rank_hosts(hf, np)
    counts = Counter(hosts)
    return [None if hf.host(h).memory_gb is None else hf.host(h).memory_gb / counts[h]
            for h in hosts]
