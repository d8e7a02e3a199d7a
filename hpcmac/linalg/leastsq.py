"""Least squares by distributed Householder QR: ``lstsq``, as ``scipy.linalg.lstsq``.

m >= n: ``a = Q R``, ``x = R^-1 (Q^H b)[:n]``; the squared residual norms are
the sums of squares of ``(Q^H b)[n:]``. m < n (the minimum-norm solution):
``a^H = Q R``, ``x = Q [R^-H b; 0]``. Both use the QR of ``householder.py``
and the triangular solve of ``trisolve.py``; nothing is gathered. The QR
has no column pivoting, so a rank-deficient ``a`` (a diagonal entry of R at
most ``cond`` times the largest) raises LinAlgError instead of returning a
minimum-norm solution.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import LinAlgError

from hpcmac.linalg import layout
from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import require
from hpcmac.linalg.diagonal import diag
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.householder import apply_q, qr_factor
from hpcmac.linalg.rhs import as_dist
from hpcmac.linalg.trisolve import solve_triangular


def _leading_rows(x: DistMatrix, k: int) -> DistMatrix:
    """Rows [0, k) of ``x`` as a DistMatrix in the same layout (no communication:
    they are a prefix of every rank's local rows)."""
    g = x.grid
    lk = layout.numroc(k, x.mb, g.myrow, g.nprow) if g.in_grid else 0
    return DistMatrix(np.asfortranarray(x.local[:lk]), (k, x.gshape[1]), x.mb, x.nb, g)


def lstsq(a: DistMatrix, b, cond: float | None = None, overwrite_a: bool = False,
          overwrite_b: bool = False, check_finite: bool = True, lapack_driver: str | None = None):
    """Collective over the grid: least-squares solution of ``a x = b``, as scipy.

    Returns ``(x, residues, rank, s)`` as ``scipy.linalg.lstsq`` with
    ``lapack_driver="gelsy"`` (a QR-based driver, which also returns
    ``s = None``). ``a`` is an (m, n) DistMatrix (real or complex); ``b`` a DistMatrix
    (m, k) on the same grid (x comes back (n, k) in ``b``'s blocking) or an
    ndarray (m,) or (m, k) whole on every rank (x comes back whole on every
    grid rank, (n,) or (n, k)). ``residues``: the squared 2-norm of each
    column of ``b - a x`` when m > n (a float for 1-D ``b``), else an empty
    array. ``rank`` is min(m, n): a rank-deficient ``a`` (some ``|R_ii| <=
    cond * max |R_jj|``, ``cond`` default ``eps * max(m, n)``) raises
    LinAlgError on every grid rank.
    """
    require(lapack_driver in (None, "gelsy"),
            f"lstsq: lapack_driver={lapack_driver!r}: only the QR driver ('gelsy', the "
            f"default here) is distributed")
    if not a.grid.in_grid:
        return None if not isinstance(b, DistMatrix) else b, None, None, None
    m, n = a.gshape
    bd, back = as_dist(b, a, "lstsq")
    require(bd.gshape[0] == m, f"lstsq: incompatible dimensions: a {a.gshape}, b {bd.gshape}")
    if check_finite:
        _check_finite(a, "a")
        _check_finite(bd, "b")
    k = bd.gshape[1]
    grid = a.grid
    if m >= n:
        f = qr_factor(a, overwrite_a=overwrite_a)
    else:
        f = qr_factor(a.transpose(conj=True), overwrite_a=True)
    p = min(m, n)
    r = _leading_rows(f.qr, p)                              # R: p x p (p = the QR's n)
    _check_rank(diag(r), cond, m, n)
    if m >= n:
        c = apply_q(f, bd, trans=True)                      # Q^H b, rows blocked as a's
        x = solve_triangular(r, _leading_rows(c, n), lower=False, check_finite=False)
        residues = _tail_sums(c, n) if m > n else np.zeros(0, dtype=c.local.real.dtype)
    else:
        y = solve_triangular(r, bd.redistribute(grid, f.qr.mb, bd.nb), trans="C",
                             lower=False, check_finite=False)   # R^H y = b
        z = DistMatrix.zeros((n, k), grid, f.qr.mb, bd.nb, y.dtype)
        z.local[: y.lshape[0]] = y.local                    # rows [0, m) are a prefix
        x = apply_q(f, z, trans=False)
        residues = np.zeros(0, dtype=x.local.real.dtype)
    if (x.mb, x.nb) != (bd.mb, bd.nb):
        x = x.redistribute(grid, bd.mb, bd.nb)
    if not isinstance(b, DistMatrix) and np.ndim(b) == 1 and residues.size:
        residues = residues[0]
    return back(x), residues, p, None


def _check_rank(d: np.ndarray, cond: float | None, m: int, n: int) -> None:
    """LinAlgError (the same on every rank: ``d`` is) when R's diagonal shows rank deficiency."""
    if d.size == 0:
        return
    mags = np.abs(d)
    tol = (np.finfo(d.dtype).eps * max(m, n) if cond is None else float(cond)) * mags.max()
    bad = np.flatnonzero(mags <= tol)
    if mags.max() == 0 or bad.size:
        first = int(bad[0]) if bad.size else 0
        raise LinAlgError(f"lstsq: a is rank deficient (column {first} of R: |R_ii| = "
                          f"{mags[first]:.3g} <= {tol:.3g}); the distributed QR has no column "
                          f"pivoting")


def _tail_sums(c: DistMatrix, n: int) -> np.ndarray:
    """Sum of squares of rows [n, m) of each column of ``c``, the same array on every rank."""
    g = c.grid
    out = np.zeros(c.gshape[1], dtype=c.local.real.dtype)
    if c.local.size:
        r0 = layout.first_local_at_or_after(n, c.mb, g.myrow, g.nprow)
        out[c.cols] = np.sum(np.abs(c.local[r0:]) ** 2, axis=0)
    return g.all.allreduce(out) if g.all.size > 1 else out
