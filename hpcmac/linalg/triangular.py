"""Distributed block triangular solves with the right-hand sides replicated.

``T`` is the leading ``n x n`` triangle of a block-cyclic matrix (square
``nb`` blocks); ``X`` (n, nrhs) is the same on every grid rank. Block ``k``
of the solution needs the sum of the blocks already solved times ``T``'s
off-diagonal blocks in its block row (``op = N``) or block column
(``op = T``): each process of that grid row (column) adds its local part, one
``allreduce`` along the row (column) combines them, the diagonal block's
owner solves the small triangle and broadcasts the block down its process
column (row), the only ranks that use it later; one ``allreduce`` at the end
replicates the solution. This is netlib HPL's final ``U x = y`` solve
(HPL_pdtrsv) in its simplest, O(n^2 / (P Q)) work per rank, form: one
reduction and one broadcast per block, none at all on one process.
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg import _blas, layout


def _solve_block(A: np.ndarray, lr: int, lc: int, kb: int, rhs: np.ndarray, out: np.ndarray,
                 lower: bool, unit: bool, trans: bool) -> None:
    """``out = op(T)^-1 rhs`` for the kb x kb diagonal block ``T = A[lr:, lc:]`` (local).

    BLAS trsm by address when the dtypes allow (no scipy.linalg import at start-up);
    scipy's solve_triangular otherwise, and for an exactly zero diagonal, which it
    reports as singular.
    """
    block = A[lr:lr + kb, lc:lc + kb]
    fast = (A.dtype == rhs.dtype == out.dtype and A.dtype in (np.float64, np.float32)
            and A.flags.f_contiguous and out.flags.f_contiguous
            and (unit or np.all(np.diagonal(block) != 0)))
    if fast:
        out[...] = rhs
        b = _blas.for_dtype(A.dtype)
        lda = max(1, A.shape[0])
        b.trsm("L", "L" if lower else "U", "T" if trans else "N", "U" if unit else "N",
               kb, out.shape[1], 1.0, _blas.addr(A) + b.itemsize * (lr + lc * lda), lda,
               _blas.addr(out), kb)
        return
    from scipy.linalg import solve_triangular

    out[...] = solve_triangular(block, rhs, trans=1 if trans else 0, lower=lower,
                                unit_diagonal=unit, check_finite=False)


def block_trsv(a, x: np.ndarray, n: int, lower: bool, unit: bool, trans: bool) -> np.ndarray:
    """Solve ``op(T) X = X`` in place and return ``X``.

    ``a``: DistMatrix holding ``T`` in its leading n x n part (``mb == nb``);
    ``x``: (n, nrhs) float64, replicated (global); ``lower``, ``unit``, ``trans``
    global. Collective over the grid (ranks outside it return ``x`` untouched).
    """
    g = a.grid
    if not g.in_grid or n == 0:
        return x
    nb, p, q, myrow, mycol = a.nb, g.nprow, g.npcol, g.myrow, g.mycol
    A = a.local
    grows, gcols = a.rows, a.cols
    nblk = (n + nb - 1) // nb
    forward = lower != trans
    order = range(nblk) if forward else range(nblk - 1, -1, -1)
    nrhs = x.shape[1]
    for k in order:
        k0 = k * nb
        kb = min(nb, n - k0)
        prow, pcol = int(layout.owner(k0, nb, p)), int(layout.owner(k0, nb, q))
        s = None
        if not trans and myrow == prow:
            lr = int(layout.g2l(k0, nb, p))
            if forward:
                c0, c1 = 0, layout.first_local_at_or_after(k0, nb, mycol, q)
            else:
                c0 = layout.first_local_at_or_after(k0 + kb, nb, mycol, q)
                c1 = layout.first_local_at_or_after(n, nb, mycol, q)
            part = np.zeros((kb, nrhs), dtype=x.dtype)
            if c1 > c0:
                np.matmul(A[lr:lr + kb, c0:c1], x[gcols[c0:c1]], out=part)
            s = g.row.allreduce(part) if q > 1 else part
        elif trans and mycol == pcol:
            lc = int(layout.g2l(k0, nb, q))
            if forward:
                r0, r1 = 0, layout.first_local_at_or_after(k0, nb, myrow, p)
            else:
                r0 = layout.first_local_at_or_after(k0 + kb, nb, myrow, p)
                r1 = layout.first_local_at_or_after(n, nb, myrow, p)
            part = np.zeros((kb, nrhs), dtype=x.dtype)
            if r1 > r0:
                np.matmul(A[r0:r1, lc:lc + kb].T, x[grows[r0:r1]], out=part)
            s = g.col.allreduce(part) if p > 1 else part
        # who keeps x_k: the diagonal block's process column (row for trans)
        if not trans:
            keeper, line, root = mycol == pcol, g.col, prow
        else:
            keeper, line, root = myrow == prow, g.row, pcol
        if not keeper:
            continue
        xk = np.empty((kb, nrhs), dtype=x.dtype, order="F")
        if myrow == prow and mycol == pcol:
            lr, lc = int(layout.g2l(k0, nb, p)), int(layout.g2l(k0, nb, q))
            _solve_block(A, lr, lc, kb, x[k0:k0 + kb] - s, xk, lower, unit, trans)
        if line.size > 1:
            line.bcast(xk, root)
        x[k0:k0 + kb] = xk
    # replicate: each rank contributes the blocks its process column (row) kept
    across, ncoord, mine = (g.row, q, mycol) if not trans else (g.col, p, myrow)
    if ncoord > 1:
        owners = layout.owner(np.arange(n), nb, ncoord)
        x[owners != mine] = 0.0
        across.allreduce(x, "sum", out=x)
    return x
