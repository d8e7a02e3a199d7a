"""Distributed triangular solve ``op(T) X = B`` with many right-hand sides (blocked substitution).

For each diagonal block k (forward for lower, backward for upper):
the process column holding T's block column k broadcasts it along the
process rows; the process row holding B's block row k solves with the
diagonal block (every rank there has it now) and broadcasts the solved rows
down the process columns; every rank subtracts ``T[:, k] X_k`` from its
remaining rows of B. A zero on the diagonal travels with the solved rows, so
every rank raises the same LinAlgError at the same step.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
from scipy.linalg.blas import get_blas_funcs

from hpcmac.linalg import layout
from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import float_dtype, require
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.kernels import gemm_update
from hpcmac.linalg.rhs import as_dist

_TRANS = {0: 0, 1: 1, 2: 2, "N": 0, "T": 1, "C": 2}


def solve_triangular(a: DistMatrix, b, trans=0, lower: bool = False,
                     unit_diagonal: bool = False, overwrite_b: bool = False,
                     check_finite: bool = True):
    """Collective over the grid: solve ``op(a) x = b`` for x, as ``scipy.linalg.solve_triangular``.

    Parameters
    ----------
    a : DistMatrix
        Global (n, n); only the triangle named by ``lower`` is read.
    b : DistMatrix or ndarray
        Global (n, nrhs) on the same grid; any block sizes (moved to ``a``'s
        row blocking for the solve and back). Or an ndarray (n,) or (n, nrhs)
        holding the whole right-hand side on every rank.
    trans : {0, 1, 2, 'N', 'T', 'C'}
        ``op(a)`` is ``a``, ``a.T`` or ``a.conj().T``.

    Returns
    -------
    DistMatrix or ndarray
        x, global (n, nrhs), in ``b``'s layout (an ndarray ``b``: the whole x
        on every grid rank, in ``b``'s shape). Raises LinAlgError naming the
        first zero diagonal entry (global index, 0-based) on every grid rank.
    """
    if not a.grid.in_grid:   # ranks outside the grid take no part
        return b if isinstance(b, DistMatrix) else None
    b, back = as_dist(b, a, "solve_triangular")
    require(trans in _TRANS,
            f"solve_triangular: trans must be 0, 1, 2, 'N', 'T' or 'C', got {trans!r}")
    n, n2 = a.gshape
    require(n == n2, f"solve_triangular: expected a square matrix, got shape {a.gshape}")
    require(b.gshape[0] == n,
            f"solve_triangular: shapes of a {a.gshape} and b {b.gshape} are incompatible")
    grid = a.grid
    dtype = float_dtype(a.dtype, b.dtype)
    if check_finite:
        _check_finite(a, "a")
        _check_finite(b, "b")
    t = _TRANS[trans]
    if t:  # solve with the explicit (conjugate) transpose: a triangle of the other kind
        a = a.transpose(conj=(t == 2))
        lower = not lower
    nb = a.nb
    if a.mb != a.nb:
        a = a.redistribute(grid, nb, nb)
    x = b.redistribute(grid, nb, b.nb) if b.mb != nb else (b if overwrite_b else b.copy())
    if x.dtype != dtype:
        x = x.astype(dtype)
    al = a.local if a.dtype == dtype else a.local.astype(dtype, order="F")
    _substitute(al, x, a.gshape[0], nb, lower, unit_diagonal)
    if x.mb != b.mb:
        x = x.redistribute(grid, b.mb, b.nb)
    return back(x)


def _substitute(al: np.ndarray, x: DistMatrix, n: int, nb: int, lower: bool, unit: bool) -> None:
    """Blocked substitution in place on ``x.local``; ``al`` is T's local piece (nb×nb blocks)."""
    grid = x.grid
    P, Q, myrow, mycol = grid.nprow, grid.npcol, grid.myrow, grid.mycol
    rows = layout.global_indices(n, nb, myrow, P)
    lm = rows.size
    ln = x.lshape[1]
    dtype = x.dtype
    trsm = get_blas_funcs("trsm", dtype=dtype)
    nblk = (n + nb - 1) // nb
    order = range(nblk) if lower else range(nblk - 1, -1, -1)
    for k in order:
        k0, k1 = k * nb, min(n, (k + 1) * nb)
        w = k1 - k0
        pk, qk = k % P, k % Q
        # my rows still to update: after block k (lower) or before it (upper)
        if lower:
            r0 = layout.first_local_at_or_after(k1, nb, myrow, P)
            r1 = lm
        else:
            r0 = 0
            r1 = layout.first_local_at_or_after(k0, nb, myrow, P)
        dk = layout.g2l(k0, nb, P) if myrow == pk else None   # local row of block k
        # 1. T's block column k (my rows: the ones to update, plus the diagonal block)
        lo = min(r0, dk) if dk is not None else r0
        hi = max(r1, dk + w) if dk is not None else r1
        hi = max(hi, lo)
        tpan = np.empty((hi - lo) * w, dtype=dtype)
        tview = tpan.reshape((hi - lo, w), order="F")
        if mycol == qk and hi > lo:
            lc = layout.g2l(k0, nb, Q)
            tview[...] = al[lo:hi, lc:lc + w]
        if Q > 1 and hi > lo:
            grid.row.bcast(tpan, qk)
        # 2. process row pk solves the diagonal block; the solved rows go down the columns
        xk = np.empty(w * ln + 1, dtype=dtype)
        if myrow == pk:
            tkk = tview[dk - lo: dk - lo + w, :]
            diag = np.diagonal(tkk)
            zero = np.flatnonzero(diag == 0) if not unit else np.zeros(0, dtype=np.int64)
            xk[-1] = (k0 + zero[0] + 1) if zero.size else 0
            if not zero.size and ln:
                sol = trsm(1.0, tkk, np.asfortranarray(x.local[dk:dk + w, :]), side=0,
                           lower=int(lower), diag=int(unit))
                x.local[dk:dk + w, :] = sol
            xk[:-1].reshape((w, ln), order="F")[...] = x.local[dk:dk + w, :]
        if P > 1:
            grid.col.bcast(xk, pk)
        info = int(xk[-1].real)
        if info:
            raise scipy.linalg.LinAlgError(
                f"singular matrix: resolution failed at diagonal {info - 1}")
        # 3. update the rows still to solve
        if r1 > r0 and ln:
            gemm_update(x.local[r0:r1, :], tview[r0 - lo: r1 - lo, :],
                        xk[:-1].reshape((w, ln), order="F"), alpha=-1.0, beta=1.0)
