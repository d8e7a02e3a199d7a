"""Smoothed-aggregation algebraic multigrid over DistCSR (as PETSc's GAMG, as a preconditioner).

Setup, level by level (collective over A's group):

1. each rank aggregates its own rows (pyamg's strength of connection and
   standard aggregation on its diagonal block: aggregates never cross
   ranks) and builds the tentative prolongator T from the constant vector;
2. ``P = (I - omega D^-1 A) T``, ``omega = 4 / (3 rho(D^-1 A))`` (rho by a few
   power steps);
3. ``A_c = P^T A P``: ``A P`` as a distributed product, then each rank's
   ``P_local^T (A P)_local`` assembled (entries summed onto their owners).

Coarse rows stay with the rank that owns their aggregate while there are
more than ``rows_per_rank`` of them per rank; below that, neighbouring
ranks' aggregates merge onto fewer ranks, and the coarsest level
(``max_coarse`` rows or fewer) lives on rank 0 alone, factored by splu.

Each application is one V-cycle with Chebyshev(``degree``)-Jacobi pre- and
post-smoothing on the interval ``[0.1, 1.1] rho`` (PETSc's default): a
symmetric preconditioner, so it serves ``cg`` and ``minres`` too.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from hpcmac.linalg.sparse import rows as rowpart
from hpcmac.linalg.sparse.build import assemble
from hpcmac.linalg.sparse.distcsr import DistCSR, agree


def _tentative(A: DistCSR, theta: float):
    """This rank's aggregates of its own rows: (T_local (nlocal x naggs) CSR, naggs)."""
    from pyamg.aggregation.aggregate import standard_aggregation
    from pyamg.aggregation.tentative import fit_candidates
    from pyamg.strength import symmetric_strength_of_connection

    n = A.diag.shape[0]
    if n == 0:
        return sp.csr_matrix((0, 0)), 0
    C = symmetric_strength_of_connection(sp.csr_matrix(A.diag), theta)
    agg, _ = standard_aggregation(C)
    T, _ = fit_candidates(sp.csr_matrix(agg), np.ones((n, 1), dtype=A.dtype))
    return sp.csr_matrix(T), agg.shape[1]


def spectral_radius(A: DistCSR, dinv: np.ndarray, steps: int = 12) -> float:
    """Collective: a power-iteration estimate of rho(D^-1 A) (a lower bound, close for SPD A)."""
    rng = np.random.default_rng(1234 + A.group.rank)
    v = rng.standard_normal(A.diag.shape[0])
    est = 1.0
    for _ in range(steps):
        nv = float(np.sqrt(A.group.allreduce(np.array([v @ v]))[0]))
        if nv == 0:
            break
        v /= nv
        w = dinv * A.matvec(v)
        est = float(A.group.allreduce(np.array([v @ w]))[0])
        v = w
    return abs(est) if est else 1.0


def _coarse_starts(naggs: list[int], max_coarse: int, rows_per_rank: int) -> tuple[int, ...]:
    """The coarse partition: each rank its aggregates, or merged onto fewer ranks. Pure."""
    size = len(naggs)
    own = rowpart.from_counts(naggs)
    total = own[-1]
    active = 1 if total <= max_coarse else max(1, min(size, total // max(rows_per_rank, 1)))
    if active == size:
        return own
    cuts = [own[(j * size) // active] for j in range(active)] + [total] * (size - active + 1)
    return tuple(cuts)


class Level:
    def __init__(self, A: DistCSR, P: DistCSR | None, dinv: np.ndarray, rho: float):
        self.A, self.P, self.dinv, self.rho = A, P, dinv, rho


class SmoothedAggregation:
    """The AMG hierarchy; ``M(r_local)`` applies one V-cycle. ``levels[i].A`` are the operators."""

    def __init__(self, A: DistCSR, theta: float = 0.0, max_coarse: int = 500,
                 max_levels: int = 12, degree: int = 2, rows_per_rank: int = 2000):
        if A.shape[0] != A.shape[1] or A.row_starts != A.col_starts:
            raise ValueError("amg: A must be square with rows and columns split alike")
        self.degree = degree
        self.levels: list[Level] = []
        g = A.group
        Ak = A
        while True:
            d = Ak.diagonal().local
            zero = np.flatnonzero(d == 0)
            agree(g, f"amg: the diagonal of level {len(self.levels)} is zero at row "
                  f"{Ak.lrange[0] + zero[0]}" if zero.size else None)
            dinv = 1.0 / d
            rho = spectral_radius(Ak, dinv)
            if Ak.shape[0] <= max_coarse or len(self.levels) + 1 >= max_levels:
                break
            T_loc, nagg = _tentative(Ak, theta)
            naggs = [int(v) for v in g.allgather_obj(nagg)]
            total = sum(naggs)
            if total == 0 or total >= Ak.shape[0]:
                break                                   # no coarsening: stop here
            cstarts = _coarse_starts(naggs, max_coarse, rows_per_rank)
            first = sum(naggs[: g.rank])
            T_loc = sp.csr_matrix((T_loc.data, T_loc.indices + first, T_loc.indptr),
                                  shape=(T_loc.shape[0], total))
            T = DistCSR(T_loc, (Ak.shape[0], total), Ak.row_starts, cstarts, g)
            AT = Ak @ T
            scale = sp.diags(-(4.0 / 3.0) / rho * dinv)
            P = T + AT._like(sp.csr_matrix(scale @ AT.diag), sp.csr_matrix(scale @ AT.off))
            AP = Ak @ P
            part = (P.local_rows().T @ AP.local_rows()).tocoo()
            Ac = assemble(part.row, part.col, part.data, (total, total), g, cstarts, cstarts,
                          check_finite=False)
            self.levels.append(Level(Ak, P, dinv, rho))
            Ak = Ac
        self.levels.append(Level(Ak, None, dinv, rho))
        self._coarse_setup(Ak)

    def _coarse_setup(self, Ac: DistCSR) -> None:
        """The coarsest solve: splu where the rows live on one rank, else redundant on all."""
        g = Ac.group
        holders = [r for r in range(g.size) if Ac.row_starts[r + 1] > Ac.row_starts[r]]
        self.coarse_alone = len(holders) <= 1
        if self.coarse_alone:
            mat = Ac.diag if Ac.diag.shape[0] else None
        else:
            mat = Ac.to_scipy()
        msg = None
        self.coarse = None
        if mat is not None and mat.shape[0]:
            try:
                self.coarse = sla.splu(sp.csc_matrix(mat))
            except RuntimeError as exc:
                msg = f"amg: the coarsest matrix ({mat.shape[0]} rows) is singular ({exc})"
        agree(g, msg)

    @property
    def operator_complexity(self) -> float:
        """Collective: total nonzeros of all levels over those of the finest."""
        nnz = [lv.A.nnz for lv in self.levels]
        return sum(nnz) / nnz[0]

    def _smooth(self, lv: Level, b: np.ndarray, x: np.ndarray | None) -> np.ndarray:
        """Chebyshev(degree) with Jacobi on [0.1, 1.1] rho(D^-1 A), from ``x`` (None: zero)."""
        hi, lo = 1.1 * lv.rho, 0.1 * lv.rho
        theta, delta = (hi + lo) / 2, (hi - lo) / 2
        sigma = theta / delta
        rho_k = 1.0 / sigma
        r = b.copy() if x is None else b - lv.A.matvec(x)
        x = np.zeros_like(b) if x is None else x
        dk = (lv.dinv * r) / theta
        for k in range(self.degree):
            x += dk
            if k + 1 == self.degree:
                break
            r -= lv.A.matvec(dk)
            rho_new = 1.0 / (2 * sigma - rho_k)
            dk *= rho_new * rho_k
            dk += (2 * rho_new / delta) * (lv.dinv * r)
            rho_k = rho_new
        return x

    def _cycle(self, i: int, b: np.ndarray) -> np.ndarray:
        lv = self.levels[i]
        if lv.P is None:
            return self._coarse_solve(lv, b)
        x = self._smooth(lv, b, None)
        r = b - lv.A.matvec(x)
        xc = self._cycle(i + 1, lv.P.rmatvec(r))
        x += lv.P.matvec(xc)
        return self._smooth(lv, b, x)

    def _coarse_solve(self, lv: Level, b: np.ndarray) -> np.ndarray:
        if self.coarse_alone:
            return self.coarse.solve(b) if self.coarse is not None else np.zeros_like(b)
        from hpcmac.linalg.vectors import BlockVector

        full = BlockVector(b, lv.A.shape[0], lv.A.row_counts, lv.A.group).allgather()
        lo, hi = lv.A.lrange
        return self.coarse.solve(full)[lo:hi]

    def __call__(self, r: np.ndarray) -> np.ndarray:
        return self._cycle(0, np.asarray(r, dtype=np.result_type(r.dtype, self.levels[0].A.dtype)))

    def __repr__(self) -> str:
        sizes = " -> ".join(str(lv.A.shape[0]) for lv in self.levels)
        return f"<SmoothedAggregation levels {sizes}>"


def amg(A: DistCSR, **kw) -> SmoothedAggregation:
    """Collective: the smoothed-aggregation AMG preconditioner of A (keywords as the class)."""
    return SmoothedAggregation(A, **kw)
