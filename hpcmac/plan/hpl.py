"""HPL performance model: netlib HPL's right-looking LU, step by step.

For each panel step (remaining order ``m``, local ``mp = m/P`` rows and
``nq = (m - NB)/Q`` trailing columns on every rank):

* update: ``2 mp nq NB`` (DGEMM) + ``NB^2 nq`` (DTRSM) flops at the rank's
  DGEMM rate for a rank-NB update;
* row interchanges applied locally: ``NB nq`` elements, each a cache line
  read and written (rows are strided in column-major storage), over the
  rank's share of memory bandwidth;
* panel factorisation: ``NB`` columns of fixed cost (pivot search, swap,
  scaling calls) + ``mp NB^2`` flops at the panel rate, plus, with P > 1,
  one pivot all-reduce down the process column per column (log2 P messages);
* panel broadcast along the process row (``(mp + NB + 1) NB`` words): the
  next panel's owner receives it after one hop; the farthest rank after the
  variant's hop count (rings forward whole messages; spread-roll sends Q-1
  pieces then rolls them);
* row swap down the process column (``NB nq`` words of U): binary exchange
  ``log2 P`` exchanges, spread-roll ``P - 1`` steps moving ``2 (P-1)/P`` of U,
  ``mix`` one or the other by the local column count.

Look-ahead (depth 1) overlaps the next panel's factorisation and broadcast
with the trailing update: a step costs the longest of a rank's busy time
(update + swaps + ``panel / Q``: the process columns take turns), the chain
from the next panel's columns through its factorisation and broadcast to its
owner, and the same chain to the farthest rank of the row. Depth 0 adds
everything. The final triangular solve
streams U once. Gflops = (2/3 N^3 + 3/2 N^2) / time, as HPL reports it.

Pure: no I/O, no MPI. Every rank does the same share of work (block-cyclic),
so the slowest rank sets the pace.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.plan.cluster import Cluster
from hpcmac.plan.machines import Link

BCASTS = ("1ring", "1ringM", "2ring", "2ringM", "long", "longM")
SWAPS = ("binexch", "spread", "mix")
LINE = 64  # bytes of a cache line: one strided element of a row interchange costs this much


@dataclass(frozen=True)
class HplCase:
    """One run as HPL.dat describes it (global)."""

    n: int
    nb: int = 256
    p: int = 1
    q: int = 1
    depth: int = 1
    bcast: str = "1ringM"
    swap: str = "mix"
    swap_threshold: int = 64

    def check(self) -> None:
        if self.n < 1:
            raise UsageError(f"N must be >= 1, got {self.n}")
        if self.nb < 1:
            raise UsageError(f"NB must be >= 1, got {self.nb}")
        if self.p < 1 or self.q < 1:
            raise UsageError(f"grid must be at least 1x1, got {self.p}x{self.q}")
        if self.depth not in (0, 1):
            raise UsageError(f"depth must be 0 or 1, got {self.depth}")
        if self.bcast not in BCASTS:
            raise UsageError(f"bcast must be one of {', '.join(BCASTS)}, got {self.bcast!r}")
        if self.swap not in SWAPS:
            raise UsageError(f"swap must be one of {', '.join(SWAPS)}, got {self.swap!r}")


@dataclass(frozen=True)
class HplPrediction:
    """Predicted time and rate, and where the time goes (seconds, summed over steps)."""

    n: int
    nb: int
    p: int
    q: int
    time_s: float
    gflops: float
    update_s: float
    laswp_s: float
    panel_s: float
    bcast_s: float      # exposed (not hidden by the update)
    swap_s: float
    solve_s: float
    memory_fraction: float   # of the smallest rank's memory the matrix takes
    rank_gflops: float       # DGEMM rate of the slowest rank (large k)

    def as_dict(self) -> dict:
        return asdict(self)


def hpl_flops(n: int) -> float:
    return 2.0 / 3.0 * n ** 3 + 1.5 * n ** 2


def _hops(variant: str, q: int) -> tuple[int, float]:
    """(hops to the farthest rank, bytes factor per hop) for a row of ``q``."""
    if q <= 1:
        return 0, 0.0
    if variant == "1ring":
        return q - 1, 1.0
    if variant == "1ringM":
        return max(1, q - 2), 1.0
    if variant == "2ring":
        return max(1, math.ceil((q - 1) / 2)), 1.0
    if variant == "2ringM":
        return max(1, math.ceil((q - 2) / 2)), 1.0
    # spread-roll: the root sends one piece to each of the k others, then k-1 roll steps
    k = q - 1 if variant == "long" else q - 2
    if k <= 1:
        return 1, 1.0
    return 2 * k - 1, 1.0 / k


def _log2(x: int) -> int:
    return max(0, math.ceil(math.log2(x))) if x > 1 else 0


def _effective(cluster: Cluster, where: list[int], groups: list[list[int]],
               nodes_used: int) -> Link:
    """One alpha-beta link standing for the messages of a row (or column) operation.

    A fraction ``f`` of the neighbour hops in a group (in ring order) joins two
    nodes, the rest stay inside a node. Every group works at the same time, so
    the ranks of one node whose groups cross share the node's port (a switched
    link) or its cables to the other nodes (a mesh).
    """
    cross = hops = 0
    sharing = [0] * len(cluster.nodes)
    for g in groups:
        if len(g) < 2:
            continue
        c = sum(where[g[i]] != where[g[(i + 1) % len(g)]] for i in range(len(g)))
        cross += c
        hops += len(g)
        if c:
            for r in g:
                sharing[where[r]] += 1
    if hops == 0 or cross == 0:
        return cluster.local
    f = cross / hops
    x = cluster.link
    ports = 1 if x.switched else max(1, nodes_used - 1)
    beta_x = x.beta_bps * min(1.0, ports / max(sharing))
    inv_beta = f / beta_x + (1 - f) / cluster.local.beta_bps
    alpha = f * x.alpha_s + (1 - f) * cluster.local.alpha_s
    return Link(f"{x.name} (effective)", alpha, 1.0 / inv_beta, x.source)


def predict(cluster: Cluster, case: HplCase) -> HplPrediction:
    """Predicted HPL time for ``case`` on ``cluster`` (the first P*Q ranks)."""
    case.check()
    n, nb, P, Q = case.n, case.nb, case.p, case.q
    nranks = P * Q
    where = cluster.placement(nranks)
    per_node = [where.count(i) for i in range(len(cluster.nodes))]
    # the slowest rank sets the pace: per rank DGEMM, bandwidth, panel rate, memory
    rank_rate = rank_rate_k = bw = prate = mem = math.inf
    col_s = 0.0
    for i, node in enumerate(cluster.nodes):
        k = per_node[i]
        if k == 0:
            continue
        t = cluster.threads(node, k)
        busy = min(node.rates.cores, k * t)
        rank_rate = min(rank_rate, node.rates.dgemm_at(busy) * 1e9 / k)
        rank_rate_k = min(rank_rate_k, node.rates.dgemm_at(busy, nb) * 1e9 / k)
        bw = min(bw, node.rates.bw_at(busy) / k)
        prate = min(prate, node.rates.panel_rate(t))
        col_s = max(col_s, node.rates.panel_col_s)
        mem = min(mem, node.rates.memory_gb * 1e9 / k)
    nodes_used = sum(1 for k in per_node if k)
    row_link = _effective(cluster, where, [[r * Q + c for c in range(Q)] for r in range(P)],
                          nodes_used)
    col_link = _effective(cluster, where, [[r * Q + c for r in range(P)] for c in range(Q)],
                          nodes_used)

    hops, hop_bytes = _hops(case.bcast, Q)
    # every panel step at once (arrays over the steps)
    j = np.arange(0, n, nb, dtype=np.float64)
    jb = np.minimum(nb, n - j)
    m = n - j
    mp = m / P
    nq = np.maximum(0.0, (m - jb) / Q + 1.0 / Q)  # trailing columns (+ b) per rank
    upd = (2.0 * mp * nq * jb + jb * jb * nq) / rank_rate_k
    laswp = 2.0 * jb * nq * LINE / bw
    pan = jb * col_s + mp * jb * jb / prate
    if P > 1:  # one pivot all-reduce (jb + 4 words) per column, log2 P messages
        pan = pan + jb * _log2(P) * (col_link.alpha_s + (jb + 4) * 8 / col_link.beta_bps)
    msg = (mp + jb + 1) * jb * 8
    zero = np.zeros_like(j)
    first = row_link.alpha_s + msg / row_link.beta_bps if Q > 1 else zero
    last = hops * (row_link.alpha_s + msg * hop_bytes / row_link.beta_bps) if Q > 1 else zero
    sw = zero
    if P > 1:
        ubytes = jb * nq * 8
        binexch = _log2(P) * (col_link.alpha_s + ubytes / col_link.beta_bps)
        spread = (P - 1) * col_link.alpha_s + 2.0 * (P - 1) / P * ubytes / col_link.beta_bps
        if case.swap == "binexch":
            sw = binexch
        elif case.swap == "spread":
            sw = spread
        else:  # mix: binary exchange up to the threshold of local columns
            sw = np.where(nq <= case.swap_threshold, binexch, spread)
    if case.depth >= 1:
        # a rank's busy time; the chain to the next panel's owner, and to the farthest rank
        work = upd + laswp + sw + pan / Q
        head = 2.0 * mp * np.minimum(np.minimum(jb, m - jb), nq) * jb / rank_rate_k + pan
        exposed = np.maximum(0.0, np.maximum(head + first, head + last) - work)
        t_pan = float(np.sum(pan[:-1] / Q) + pan[-1])
        t_bc = float(np.sum(exposed[:-1]) + last[-1])
    else:
        t_pan, t_bc = float(np.sum(pan)), float(np.sum(last))
    t_upd, t_laswp, t_swap = float(np.sum(upd)), float(np.sum(laswp)), float(np.sum(sw))
    # triangular solve: U streamed once (N^2/2 words over the ranks), one message per block
    steps = math.ceil(n / nb)
    solve = (n * n / 2.0 * 8 / nranks) / bw
    if nranks > 1:
        solve += steps * (row_link.alpha_s + col_link.alpha_s)
    total = t_upd + t_laswp + t_pan + t_bc + t_swap + solve
    words = (n * (n + 1)) / nranks
    return HplPrediction(
        n=n, nb=nb, p=P, q=Q, time_s=total, gflops=hpl_flops(n) / total / 1e9,
        update_s=t_upd, laswp_s=t_laswp, panel_s=t_pan, bcast_s=t_bc, swap_s=t_swap,
        solve_s=solve, memory_fraction=words * 8 / mem, rank_gflops=rank_rate / 1e9)


def grids(nranks: int) -> list[tuple[int, int]]:
    """Every P x Q with P * Q == nranks and P <= Q (HPL's advice: flat or square)."""
    return [(p, nranks // p) for p in range(1, nranks + 1) if nranks % p == 0
            and p <= nranks // p]


def suggest_n(cluster: Cluster, nranks: int, nb: int, fill: float = 0.8) -> int:
    """The largest multiple of NB whose matrix fills ``fill`` of the smallest rank's share.

    HPL spreads the matrix evenly, so the rank with the least memory limits N.
    """
    where = cluster.placement(nranks)
    mem = min(cluster.nodes[i].rates.memory_gb * 1e9 / where.count(i) for i in set(where))
    n = int(math.sqrt(fill * mem * nranks / 8.0))
    return max(nb, n // nb * nb)


def suggest(cluster: Cluster, nranks: int | None = None, n: int | None = None,
            fill: float = 0.8, nbs: tuple[int, ...] = (64, 96, 128, 192, 256, 384),
            depth: int = 1, bcast: str = "1ringM", swap: str = "mix") -> list[HplPrediction]:
    """Predictions for every grid and NB, fastest first; N fills ``fill`` of memory
    unless given."""
    nranks = nranks or cluster.ranks
    out = []
    for nb in nbs:
        nn = n or suggest_n(cluster, nranks, nb, fill)
        for p, q in grids(nranks):
            out.append(predict(cluster, HplCase(nn, nb, p, q, depth, bcast, swap)))
    out.sort(key=lambda r: -r.gflops)
    return out
