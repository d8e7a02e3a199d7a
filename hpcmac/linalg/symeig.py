"""Distributed symmetric/Hermitian eigensolver: ``eigh``, as ``scipy.linalg.eigh`` (as pdsyevr).

1. reduce A to tridiagonal form, distributed (``tridiag.py``): A = Q T Q^H;
2. solve the tridiagonal problem: every rank computes the eigenvalues; the
   first rank of each process column computes the eigenvectors of that
   column's eigenvalues only, by MRRR (LAPACK's stemr, ``select="i"`` on each
   run of its columns; eigenvectors of well-separated index ranges are
   orthogonal without communication, the property ScaLAPACK's pdsyevr relies
   on; a cluster of close eigenvalues is always computed whole, in one call
   every column makes alike), and broadcasts them down its column. On one
   process column, one call computes them all (the fastest LAPACK driver);
3. back-transform X = Q Z on the grid: the reflectors of each column block
   form a block reflector ``I - V T V^T`` (LAPACK's larft), V and T travel
   along the process rows, and ``Z -= V (T (V^T Z))`` with one allreduce of
   ``V^T Z`` down each process column (BLAS-3).
No rank ever holds A or X whole. Real symmetric and complex Hermitian matrices.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import eigh_tridiagonal, eigvalsh_tridiagonal

from hpcmac.linalg import layout
from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import float_dtype, require
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.householder import _apply_block, _larft
from hpcmac.linalg.tridiag import tridiagonalize


def eigh(a: DistMatrix, b=None, *, lower: bool = True, eigvals_only: bool = False,
         overwrite_a: bool = False, overwrite_b: bool = False, type: int = 1,
         check_finite: bool = True, subset_by_index=None, subset_by_value=None, driver=None):
    """Collective over the grid: eigenvalues and eigenvectors of a symmetric (Hermitian) ``a``.

    As ``scipy.linalg.eigh`` for the standard problem: returns ``w``
    (ascending, an ndarray the same on every grid rank) and, unless
    ``eigvals_only``, ``v`` (a DistMatrix in ``a``'s layout whose column i is
    the eigenvector of ``w[i]``; signs may differ from scipy's, as between
    LAPACK drivers). Only the ``lower`` (or upper) triangle of ``a`` is read.
    ``subset_by_index=(lo, hi)`` computes eigenpairs lo..hi only (v is then
    (n, hi - lo + 1)). The generalized problem (``b``), ``subset_by_value``,
    and ``driver`` are not supported.
    """
    require(b is None and type == 1,
            "eigh: the generalized problem (b=...) is not supported; reduce it with "
            "cholesky and solve_triangular first")
    require(subset_by_value is None, "eigh: subset_by_value is not supported; use "
                                     "subset_by_index")
    require(driver in (None, "evr"),
            f"eigh: driver={driver!r}: only 'evr' (tridiagonal reduction + MRRR) is distributed")
    if not a.grid.in_grid:
        return None if eigvals_only else (None, a)
    n, n2 = a.gshape
    require(n == n2, f"eigh: expected a square matrix, got shape {a.gshape}")
    lo, hi = (0, n - 1) if subset_by_index is None else (int(i) for i in subset_by_index)
    require(0 <= lo <= hi < n or n == 0,
            f"eigh: subset_by_index must satisfy 0 <= lo <= hi <= {n - 1}, got {subset_by_index}")
    if check_finite:
        _check_finite(a, "a")
    work = _symmetric_copy(a, lower)
    d, e, tau = tridiagonalize(work)
    wall = d.copy() if n <= 1 else eigvalsh_tridiagonal(d, e)   # ascending, real
    w = wall[lo:hi + 1]
    if eigvals_only:
        return w
    z = _tridiagonal_vectors(d, e, wall, lo, hi, work)
    _back_transform(work, tau, z)
    if (z.mb, z.nb) != (a.mb, a.nb):
        z = z.redistribute(a.grid, a.mb, a.nb)
    return w, z


def _symmetric_copy(a: DistMatrix, lower: bool) -> DistMatrix:
    """Collective: the full symmetric matrix from ``a``'s lower (upper) triangle, in
    square ``a.nb`` blocks (a transpose of square blocks has the same layout)."""
    dtype = float_dtype(a.dtype)
    nb = a.nb
    work = a.redistribute(a.grid, nb, nb) if a.mb != nb else a
    work = work.astype(dtype)
    t = work.transpose(conj=True)
    i, j = work.rows[:, None], work.cols[None, :]
    keep = (i >= j) if lower else (i <= j)
    work.local[...] = np.where(keep, work.local, t.local)
    if work.dtype.kind == "c":   # a Hermitian matrix's diagonal is real (LAPACK ignores Im)
        work.local[i == j] = work.local[i == j].real
    return work


def clusters(w: np.ndarray) -> np.ndarray:
    """Pure: the cluster number of each ascending eigenvalue: neighbours closer than
    1e-3 relative (MRRR's minimum relative gap) or than ~n eps ||T|| share a cluster."""
    if w.size == 0:
        return np.zeros(0, dtype=np.int64)
    scale = float(np.abs(w).max())
    gap = np.diff(w)
    near = gap <= 1e-3 * np.maximum(np.abs(w[:-1]), np.abs(w[1:])) + \
        1e3 * w.size * np.finfo(w.dtype).eps * scale
    return np.concatenate([[0], np.cumsum(~near)])


def _calls(g0: int, g1: int, cid: np.ndarray) -> list[tuple[int, int]]:
    """Pure: index ranges of the stemr calls that give eigenvectors g0..g1.

    A cluster is always computed whole and, when it reaches outside [g0, g1],
    in a call of its own: every rank that needs part of it makes the same
    call and gets the same basis of its eigenspace, so vectors from different
    ranks stay orthogonal. The clusters inside [g0, g1] share one call
    (separate calls on well-separated ranges are orthogonal by MRRR).
    """
    first = int(np.searchsorted(cid, cid[g0], side="left"))
    last = int(np.searchsorted(cid, cid[g1], side="right")) - 1
    out = []
    lo, hi = g0, g1
    if first < g0:                                   # the first cluster sticks out in front
        head_end = int(np.searchsorted(cid, cid[g0], side="right")) - 1
        out.append((first, head_end))
        lo = head_end + 1
    tail = None
    if last > g1 and lo <= g1:                       # the last one sticks out behind
        tail_start = int(np.searchsorted(cid, cid[g1], side="left"))
        tail = (max(tail_start, lo), last)
        hi = tail[0] - 1
    if lo <= hi:
        out.append((lo, hi))
    if tail is not None:
        out.append(tail)
    return out


def _tridiagonal_vectors(d, e, wall, lo: int, hi: int, like: DistMatrix) -> DistMatrix:
    """Collective over the grid: eigenvectors lo..hi of tridiag(e, d, e) as an
    (n, hi - lo + 1) DistMatrix in ``like``'s blocks.

    The first rank of each process column computes the vectors of that
    column's eigenvalues only (all rows) and broadcasts them down the column,
    so every rank of a column holds rows of the same vectors; ``wall`` are all
    eigenvalues, ascending (for the clusters).
    """
    n = d.size
    grid = like.grid
    z = DistMatrix.zeros((n, hi - lo + 1), grid, like.nb, like.nb, like.dtype)
    cols, rows = z.cols, z.rows
    if cols.size == 0:
        return z
    mine = np.zeros((n, cols.size), dtype=like.dtype, order="F")   # Z[:, my columns]
    if grid.myrow == 0:
        if n == 1:
            mine[...] = 1.0
        elif cols.size == n:      # one process column: every vector, the fastest driver
            mine[...] = eigh_tridiagonal(d, e)[1]
        else:
            _vectors_of(d, e, clusters(wall), lo + cols, mine)
    if grid.nprow > 1:
        grid.col.bcast(mine, 0)
    z.local[...] = mine[rows]
    return z


def _vectors_of(d, e, cid: np.ndarray, want: np.ndarray, out: np.ndarray) -> None:
    """Not collective: eigenvectors ``want`` (ascending global indices) into ``out``'s
    columns, by MRRR on each contiguous run (clusters computed whole, see ``_calls``)."""
    starts = np.flatnonzero(np.diff(want, prepend=want[0] - 2) != 1)   # contiguous runs
    for s, t in zip(starts, list(starts[1:]) + [want.size]):
        g0, g1 = int(want[s]), int(want[t - 1])
        for c0, c1 in _calls(g0, g1, cid):
            _, vec = eigh_tridiagonal(d, e, select="i", select_range=(c0, c1),
                                      lapack_driver="stemr")
            a0, a1 = max(c0, g0), min(c1, g1)                # the part this run needs
            dst = s + (a0 - g0)
            out[:, dst:dst + a1 - a0 + 1] = vec[:, a0 - c0:a1 - c0 + 1]


def _back_transform(x: DistMatrix, tau: np.ndarray, z: DistMatrix) -> None:
    """Collective: ``z = Q z`` in place, Q from the reflectors stored in ``x``'s columns
    (column k holds v_k in rows k+1..; ``Q = H_0 ... H_{n-2}``), last block first."""
    grid = x.grid
    nb = x.nb
    P, Q = grid.nprow, grid.npcol
    nref = tau.size
    lm = x.lshape[0]
    rows = x.rows
    for k0 in reversed(range(0, nref, nb)):
        k1 = min(nref, k0 + nb)
        w = k1 - k0
        qk = int(layout.owner(k0, nb, Q))
        buf = np.zeros(lm * w + w * w, dtype=x.dtype)
        if grid.mycol == qk:
            lc = int(layout.g2l(k0, nb, Q))
            j = k0 + np.arange(w)[None, :]
            v = np.where(rows[:, None] > j, x.local[:, lc:lc + w], 0).astype(x.dtype, order="F")
            g = np.ascontiguousarray(v.conj().T @ v)
            if P > 1:
                grid.col.allreduce(g, out=g)
            buf[:lm * w] = v.ravel(order="F")
            buf[lm * w:] = _larft(g, tau[k0:k1]).ravel()
        if Q > 1:
            grid.row.bcast(buf, qk)
        v = buf[:lm * w].reshape((lm, w), order="F")
        t = buf[lm * w:].reshape(w, w)
        _apply_block(z.local, v, t, grid)
