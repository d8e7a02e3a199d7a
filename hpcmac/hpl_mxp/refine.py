"""FP64 iterative refinement for HPL-MxP: flexible GMRES preconditioned by the low-precision LU.

The low-precision factors give a first solution ``x0 = U^-1 L^-1 b``; from it,
restarted flexible GMRES (FGMRES, right-preconditioned) works in float64
against the original float64 A until HPL's scaled residual

    ||b - A x||_oo / ((||A||_oo ||x||_oo + ||b||_oo) N eps),   eps = 2**-53,

is below the threshold (16), measured on the true residual at every restart.
Each GMRES iteration is one FP64 matrix-vector product and one application
of the preconditioner (the two distributed triangular solves, in the
factors' precision). Flexible GMRES keeps the preconditioned vectors, so the
update of x is formed in float64 from them (the preconditioner's own
rounding then does not cap the accuracy).

Vectors of length N are replicated on every grid rank: the products and the
triangular solves end in one allreduce each, and the Gram-Schmidt steps are
local. Collective over the grid: every rank calls with the same arguments and
takes the same decisions (the numbers deciding them are agreed by allreduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.triangular import block_trsv

#: the unit round-off of float64, as HPL's check uses it
EPS = 2.0**-53


def norm_inf(a: DistMatrix) -> float:
    """Collective over ``a.grid``: ``||A||_oo`` (largest row sum of magnitudes)."""
    g = a.grid
    A = a.local
    sums = np.zeros(A.shape[0])
    for c0 in range(0, A.shape[1], 256):
        sums += np.abs(A[:, c0:c0 + 256]).sum(axis=1)
    if g.npcol > 1 and sums.size:
        g.row.allreduce(sums, op="sum", out=sums)
    top = np.array([sums.max() if sums.size else 0.0])
    return float(g.all.allreduce(top, op="max")[0])


def matvec(a: DistMatrix, x: np.ndarray) -> np.ndarray:
    """Collective over ``a.grid``: ``A @ x`` for replicated ``x`` (N,), replicated, float64."""
    y = np.zeros(a.gshape[0])
    if a.local.size:
        y[a.rows] = a.local @ x[a.cols]
    if a.grid.nprow * a.grid.npcol > 1:
        a.grid.all.allreduce(y, op="sum", out=y)
    return y


def lu_apply(lu: DistMatrix, v: np.ndarray, lower: bool = True) -> np.ndarray:
    """Collective over ``lu.grid``: ``U^-1 L^-1 v`` with the factors of ``lu`` (no pivoting),
    computed in the factors' precision; returns float64 (N,), replicated.
    ``lower=False``: ``v`` is already ``L^-1 b``, only U is solved."""
    n = lu.gshape[0]
    x = v.astype(lu.dtype).reshape(n, 1)
    if lower:
        block_trsv(lu, x, n, lower=True, unit=True, trans=False)
    block_trsv(lu, x, n, lower=False, unit=False, trans=False)
    return x[:, 0].astype(np.float64)


def factored_rhs(lu: DistMatrix) -> np.ndarray:
    """Collective over ``lu.grid``: column N of the factored N x (N+1) ``[A | b]`` (which
    then holds ``L^-1 b``, as in HPL), replicated, float64."""
    n, g = lu.gshape[0], lu.grid
    y = np.zeros(n)
    cols = lu.cols
    here = np.flatnonzero(cols == n)
    if here.size:
        y[lu.rows] = lu.local[:, here[0]]
    if g.nprow * g.npcol > 1:
        g.all.allreduce(y, op="sum", out=y)
    return y


@dataclass
class Check:
    """HPL's scaled residual of one x; every field global."""

    residual: float
    resid0: float  # ||b - A x||_oo
    norm_a_inf: float
    norm_x_inf: float
    norm_b_inf: float


def scaled_residual(a: DistMatrix, b: np.ndarray, x: np.ndarray, norm_a: float
                    ) -> tuple[Check, np.ndarray]:
    """Collective: HPL's check of ``x`` and the residual ``r = b - A x`` (replicated)."""
    n = a.gshape[0]
    r = b - matvec(a, x)
    nx = float(np.abs(x).max()) if n else 0.0
    nb_ = float(np.abs(b).max()) if n else 0.0
    nr = float(np.abs(r).max()) if n else 0.0
    # one agreed number decides: the same verdict on every rank
    nr, nx = (float(v) for v in a.grid.all.allreduce(np.array([nr, nx]), op="max"))
    denom = EPS * (norm_a * nx + nb_) * n
    if n == 0:
        res = 0.0
    elif denom > 0 and np.isfinite(nr):
        res = nr / denom
    else:
        res = float("nan") if not np.isfinite(nr) else float("inf")
    return Check(res, nr, norm_a, nx, nb_), r


@dataclass
class Refinement:
    """What the refinement did (global)."""

    x: np.ndarray
    check: Check
    converged: bool
    iterations: int = 0  # GMRES iterations: one product with A and one LU solve each
    restarts: int = 0
    history: list[float] = field(default_factory=list)  # scaled residual at each restart


def refine(a: DistMatrix, lu: DistMatrix, b: np.ndarray, *, threshold: float = 16.0,
           maxit: int = 50, restart: int = 30, norm_a: float | None = None) -> Refinement:
    """Collective over ``a.grid``: solve ``A x = b`` to HPL's FP64 residual threshold.

    Parameters
    ----------
    a : the original N x N float64 matrix (global, unchanged).
    lu : its LU without pivoting in low precision (same grid and blocks); N x N, or
        N x (N+1) when b was factored with A (column N then holds ``L^-1 b``, which
        spares the first forward solve).
    b : (N,) float64, replicated.
    threshold : pass when HPL's scaled residual is below it.
    maxit : at most this many GMRES iterations in all (>= 0).
    restart : GMRES restarts after this many iterations (>= 1).

    Returns
    -------
    Refinement; ``converged`` False when ``maxit`` ran out first or the numbers
    stopped being finite (the check then fails: it is a result, not an error).
    """
    norm_a = norm_inf(a) if norm_a is None else norm_a
    n = a.gshape[0]
    if lu.gshape[1] == n + 1:
        x = lu_apply(lu, factored_rhs(lu), lower=False)
    else:
        x = lu_apply(lu, b)
    out = Refinement(x, None, False)  # type: ignore[arg-type]
    while True:
        chk, r = scaled_residual(a, b, x, norm_a)
        out.x, out.check = x, chk
        out.history.append(chk.residual)
        if chk.residual < threshold:
            out.converged = True
            return out
        if out.iterations >= maxit or not np.isfinite(chk.residual) or n == 0:
            return out
        # stop the inner iterations once the 2-norm estimate would pass the oo-norm check
        tol = 0.5 * threshold * EPS * n * (norm_a * chk.norm_x_inf + chk.norm_b_inf)
        k = _fgmres_cycle(a, lu, x, r, min(restart, maxit - out.iterations), tol)
        out.iterations += k
        out.restarts += 1


def _fgmres_cycle(a: DistMatrix, lu: DistMatrix, x: np.ndarray, r: np.ndarray, m: int,
                  tol: float) -> int:
    """One restart cycle of FGMRES from residual ``r``; updates ``x`` in place; returns
    the iterations done (1 .. m)."""
    n = r.size
    V = np.zeros((m + 1, n))  # Arnoldi basis, one row per vector
    Z = np.zeros((m, n))  # preconditioned basis: A Z = V H
    H = np.zeros((m + 1, m))
    cs, sn = np.zeros(m), np.zeros(m)
    g = np.zeros(m + 1)
    beta = float(np.linalg.norm(r))
    g[0] = beta
    V[0] = r / beta
    k = 0
    for k in range(m):
        Z[k] = lu_apply(lu, V[k])
        w = matvec(a, Z[k])
        # classical Gram-Schmidt, twice (local: the vectors are replicated)
        h = V[:k + 1] @ w
        w -= V[:k + 1].T @ h
        h2 = V[:k + 1] @ w
        w -= V[:k + 1].T @ h2
        H[:k + 1, k] = h + h2
        hn = float(np.linalg.norm(w))
        H[k + 1, k] = hn
        for i in range(k):  # earlier rotations
            t = cs[i] * H[i, k] + sn[i] * H[i + 1, k]
            H[i + 1, k] = -sn[i] * H[i, k] + cs[i] * H[i + 1, k]
            H[i, k] = t
        cs[k], sn[k] = _givens(H[k, k], H[k + 1, k])
        H[k, k] = cs[k] * H[k, k] + sn[k] * H[k + 1, k]
        H[k + 1, k] = 0.0
        g[k + 1] = -sn[k] * g[k]
        g[k] = cs[k] * g[k]
        # the numbers that decide, agreed: every rank leaves the loop at the same step
        est, hn = (float(v) for v in a.grid.all.allreduce(np.array([abs(g[k + 1]), hn]),
                                                          op="max"))
        if est <= tol or hn == 0.0 or not np.isfinite(est):
            break
        V[k + 1] = w / hn
    k += 1
    y = _upper_solve(H[:k, :k], g[:k])
    x += Z[:k].T @ y
    return k


def _givens(a: float, b: float) -> tuple[float, float]:
    if b == 0.0:
        return 1.0, 0.0
    rr = float(np.hypot(a, b))
    return a / rr, b / rr


def _upper_solve(R: np.ndarray, g: np.ndarray) -> np.ndarray:
    y = np.zeros_like(g)
    for i in range(g.size - 1, -1, -1):
        y[i] = (g[i] - R[i, i + 1:] @ y[i + 1:]) / R[i, i] if R[i, i] != 0 else 0.0
    return y
