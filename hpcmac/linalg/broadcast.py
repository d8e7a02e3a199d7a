"""Panel broadcast along a process row, netlib HPL's six topologies.

Ranks are counted relative to the root (``rel = (rank - root) % Q``):

* ``"1ring"``  increasing ring: 0 -> 1 -> 2 -> ... -> Q-1;
* ``"1ringM"`` modified ring: 0 -> 1 (which holds the next panel and does not
  forward), 0 -> 2 -> 3 -> ... -> Q-1;
* ``"2ring"``  two rings: 0 -> 1 -> ... -> h and 0 -> h+1 -> ... -> Q-1;
* ``"2ringM"`` modified two rings: 0 -> 1, then two rings over 2 .. Q-1;
* ``"long"``   spread-roll: the root scatters Q-1 pieces, one to each other
  rank, which then roll them round a ring of the Q-1 (ring allgather);
* ``"longM"``  modified spread-roll: 0 -> 1 whole, then ``long`` over the rest.

The broadcast is non-blocking: :meth:`RowBcast.test` advances it (posting the
forwards once a piece has arrived) and is cheap to call between chunks of the
trailing update, which is how look-ahead overlaps communication with BLAS.
Collective over the row group (every rank of it builds one with the same
root, variant and buffer size).
"""

from __future__ import annotations

import numpy as np

VARIANTS = ("1ring", "1ringM", "2ring", "2ringM", "long", "longM")

# a step: ("send" | "recv", peer_rel, lo, hi) over the buffer's words


def _ring(members: list[int], rel: int, lo: int, hi: int) -> list[list[tuple]]:
    """Forward [lo, hi) along ``members`` (members[0] already has it)."""
    if rel not in members:
        return []
    i = members.index(rel)
    phases = []
    if i > 0:
        phases.append([("recv", members[i - 1], lo, hi)])
    if i + 1 < len(members):
        phases.append([("send", members[i + 1], lo, hi)])
    return phases


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    edges = [lo + (hi - lo) * p // parts for p in range(parts + 1)]
    return [(edges[p], edges[p + 1]) for p in range(parts)]


def _long(root: int, others: list[int], rel: int, n: int) -> list[list[tuple]]:
    """Spread-roll of [0, n) from ``root`` to ``others``."""
    q = len(others)
    if q == 0:
        return []
    if q == 1:
        return _ring([root, others[0]], rel, 0, n)
    pieces = _split(0, n, q)
    if rel == root:
        return [[("send", others[i], *pieces[i]) for i in range(q)]]
    if rel not in others:
        return []
    i = others.index(rel)
    phases = [[("recv", root, *pieces[i])]]
    nxt, prv = others[(i + 1) % q], others[(i - 1) % q]
    for s in range(q - 1):
        out, inc = pieces[(i - s) % q], pieces[(i - s - 1) % q]
        phases.append([("send", nxt, *out), ("recv", prv, *inc)])
    return phases


def plan(variant: str, q: int, rel: int, n: int) -> list[list[tuple]]:
    """Pure: the phases (lists of steps) rank ``rel`` runs to broadcast ``n`` words."""
    if variant not in VARIANTS:
        raise ValueError(f"bcast must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if q <= 1:
        return []
    everyone = list(range(q))
    if variant == "1ring":
        return _ring(everyone, rel, 0, n)
    if variant == "1ringM":
        if q == 2:
            return _ring(everyone, rel, 0, n)
        if rel == 0:
            return [[("send", 1, 0, n), ("send", 2, 0, n)]] + _ring([0, *range(2, q)], 0, 0, n)[1:]
        if rel == 1:
            return [[("recv", 0, 0, n)]]
        return _ring([0, *range(2, q)], rel, 0, n)
    if variant in ("2ring", "2ringM"):
        first = 1 if variant == "2ring" else 2
        rest = list(range(first, q))
        h = (len(rest) + 1) // 2
        rings = [[0, *rest[:h]], [0, *rest[h:]]] if len(rest) > 1 else [[0, *rest]]
        if variant == "2ringM":
            rings.insert(0, [0, 1])
        if rel == 0:
            return [[("send", r[1], 0, n) for r in rings if len(r) > 1]]
        for r in rings:
            if rel in r:
                return _ring(r, rel, 0, n)
        return []
    if variant == "long":
        return _long(0, list(range(1, q)), rel, n)
    # longM
    if rel == 0:
        return [[("send", 1, 0, n)]] + _long(0, list(range(2, q)), 0, n)
    if rel == 1:
        return [[("recv", 0, 0, n)]]
    return _long(0, list(range(2, q)), rel, n)


class RowBcast:
    """Broadcast ``buf`` (1-D, contiguous, same size on every rank) from ``root``.

    Collective over ``group``; ``root`` and ``variant`` are global, ``tag``
    must differ from any other broadcast in flight on the same group.
    """

    def __init__(self, group, root: int, buf: np.ndarray, variant: str, tag: int = 0):
        self.group, self.buf, self.tag = group, buf, tag
        q = group.size
        rel = (group.rank - root) % q
        self.phases = plan(variant, q, rel, buf.size)
        self._abs = [(p + root) % q for p in range(q)]
        self.reqs: list = []
        self.next = 0

    def _post(self) -> None:
        steps = self.phases[self.next]
        self.next += 1
        self.reqs = []
        for kind, peer, lo, hi in steps:
            view = self.buf[lo:hi]
            if kind == "send":
                self.reqs.append(self.group.isend(view, self._abs[peer], self.tag))
            else:
                self.reqs.append(self.group.irecv(view, self._abs[peer], self.tag))

    def start(self) -> RowBcast:
        if self.phases:
            self._post()
        return self

    def test(self) -> bool:
        """Advance without blocking; True once this rank's part is complete."""
        while True:
            if not all(r.test() for r in self.reqs):
                return False
            self.reqs = []
            if self.next >= len(self.phases):
                return True
            self._post()

    def wait(self) -> None:
        """Block until this rank's part is complete."""
        while True:
            for r in self.reqs:
                r.wait()
            self.reqs = []
            if self.next >= len(self.phases):
                return
            self._post()
