"""Distributed Cholesky factorisation (right-looking, blocked, as ScaLAPACK's pxpotrf) and solve.

Step k on block column k (width nb):
1. the rank holding the diagonal block factors it (LAPACK potrf) and sends
   L_kk down its process column, whose ranks solve their panel rows
   ``L_ik = A_ik L_kk^-H``;
2. the panel is assembled down that process column and broadcast along the
   process rows, so every rank holds L's rows for its local rows and columns;
3. every rank updates its part of the lower trailing matrix,
   ``A_ij -= L_i L_j^H``, in column chunks: one large GEMM below each
   chunk, block GEMMs on the diagonal band.
A failed potrf travels with the panel: every rank raises the same
LinAlgError naming the order of the leading minor (global, 1-based as scipy).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
from scipy.linalg.lapack import get_lapack_funcs

from hpcmac.linalg import layout
from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import float_dtype, require
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.kernels import gemm_update, trsm_right
from hpcmac.linalg.trisolve import solve_triangular

#: local columns updated by one GEMM below the diagonal band
CHUNK = 512


def cho_factor(a: DistMatrix, lower: bool = False, overwrite_a: bool = False,
               check_finite: bool = True) -> tuple[DistMatrix, bool]:
    """Collective over the grid: Cholesky factor of a Hermitian positive definite matrix.

    As ``scipy.linalg.cho_factor``: returns ``(c, lower)`` where the ``lower``
    (or upper) triangle of ``c`` holds L (``a = L L^H``) or U (``a = U^H U``);
    the other triangle holds arbitrary data. Only that triangle of ``a`` is
    read. ``c`` has ``a``'s layout; ``mb != nb`` is handled by a
    redistribution to square blocks and back.
    """
    if not a.grid.in_grid:   # ranks outside the grid take no part
        return a, lower
    n, n2 = a.gshape
    require(n == n2, f"cho_factor: expected a square matrix, got shape {a.gshape}")
    grid = a.grid
    if check_finite:
        _check_finite(a, "a")
    dtype = float_dtype(a.dtype)
    nb = a.nb
    work = a if lower else a.transpose(conj=True)   # its lower triangle holds the input
    if work.mb != nb or work.nb != nb:
        work = work.redistribute(grid, nb, nb)
    elif work is a and not (overwrite_a and a.dtype == dtype):
        work = a.astype(dtype)
    if work.dtype != dtype:
        work = work.astype(dtype)
    factor_lower(work)
    c = work if lower else work.transpose(conj=True)
    if (c.mb, c.nb) != (a.mb, a.nb):
        c = c.redistribute(grid, a.mb, a.nb)
    if overwrite_a and c is not a and a.dtype == c.dtype:
        a.local[...] = c.local
        c = a
    return c, lower


def factor_lower(x: DistMatrix) -> None:
    """Collective over the grid: overwrite the lower triangle of ``x`` (square, mb == nb)
    by its Cholesky factor L; entries above the diagonal are left arbitrary."""
    n, nb = x.gshape[0], x.nb
    grid = x.grid
    P, Q, myrow, mycol = grid.nprow, grid.npcol, grid.myrow, grid.mycol
    rows, cols = x.rows, x.cols
    lm, ln = x.lshape
    dtype = x.dtype
    cplx = np.iscomplexobj(x.local)
    potrf = get_lapack_funcs("potrf", dtype=dtype)
    tb = "C" if cplx else "T"
    chunk = max(nb, (CHUNK // nb) * nb)
    nblk = (n + nb - 1) // nb
    for k in range(nblk):
        k0, k1 = k * nb, min(n, (k + 1) * nb)
        w, rest = k1 - k0, n - k1
        pk, qk = k % P, k % Q
        r1 = layout.first_local_at_or_after(k1, nb, myrow, P)   # my rows below block k
        c1 = layout.first_local_at_or_after(k1, nb, mycol, Q)   # my columns right of it
        pan = np.zeros(rest * w + 1, dtype=dtype)   # L[k1:, k0:k1] in Fortran order, then info
        if mycol == qk:
            lc = layout.g2l(k0, nb, Q)
            dbuf = np.empty(w * w + 1, dtype=dtype)
            if myrow == pk:
                dk = layout.g2l(k0, nb, P)
                lkk, info = potrf(x.local[dk:dk + w, lc:lc + w], lower=1, clean=0)
                x.local[dk:dk + w, lc:lc + w] = lkk
                dbuf[:-1] = lkk.ravel(order="F")
                dbuf[-1] = k0 + info if info > 0 else 0
            if P > 1:
                grid.col.bcast(dbuf, pk)
            failed = int(dbuf[-1].real)
            if not failed and lm > r1:
                lkk = dbuf[:-1].reshape((w, w), order="F")
                sol = x.local[r1:, lc:lc + w]
                trsm_right(sol, lkk, lower=True, trans=tb)       # L_ik = A_ik L_kk^-H
                if P == 1:   # my rows below k are exactly rows k1.. of the panel
                    pan[:-1].reshape((rest, w), order="F")[...] = sol
                else:
                    pan[:-1].reshape((rest, w), order="F")[rows[r1:] - k1, :] = sol
            if myrow == pk:
                pan[-1] = failed
            if P > 1:
                grid.col.allreduce(pan, out=pan)
        if Q > 1:
            grid.row.bcast(pan, qk)
        failed = int(pan[-1].real)
        if failed:
            raise scipy.linalg.LinAlgError(
                f"{failed}-th leading minor of the array is not positive definite")
        if lm <= r1 or ln <= c1:
            continue
        full = pan[:-1].reshape((rest, w), order="F")
        # (my rows below k, w) and (my columns right of k, w): no copy when contiguous
        lr = full if P == 1 else np.asfortranarray(full[rows[r1:] - k1])
        lcol = full if Q == 1 else full[cols[c1:] - k1]
        for ca in range(c1, ln, chunk):
            cb = min(ln, ca + chunk)
            band_end = int(cols[cb - 1]) + 1     # rows from here on lie below every chunk column
            rb = layout.first_local_at_or_after(band_end, nb, myrow, P)
            # diagonal band, one local column block at a time
            for ja in range(ca, cb, nb):
                jb = min(cb, ja + nb)
                ra = layout.first_local_at_or_after(int(cols[ja]), nb, myrow, P)
                if rb > ra:
                    gemm_update(x.local[ra:rb, ja:jb], lr[ra - r1: rb - r1],
                                lcol[ja - c1: jb - c1], trans_b=tb)
            if lm > rb:
                gemm_update(x.local[rb:, ca:cb], lr[rb - r1:], lcol[ca - c1: cb - c1], trans_b=tb)


def cho_solve(c_and_lower: tuple[DistMatrix, bool], b: DistMatrix, overwrite_b: bool = False,
              check_finite: bool = True) -> DistMatrix:
    """Collective over the grid: solve ``a x = b`` given ``cho_factor(a)``, as in scipy.

    ``b`` is global (n, nrhs) on the factor's grid, any block sizes; x comes
    back in ``b``'s layout.
    """
    c, lower = c_and_lower
    if not c.grid.in_grid:
        return b
    require(c.gshape[0] == c.gshape[1], f"cho_solve: the factor must be square, got {c.gshape}")
    require(b.gshape[0] == c.gshape[0],
            f"cho_solve: incompatible dimensions: factor {c.gshape}, b {b.gshape}")
    if lower:
        y = solve_triangular(c, b, trans=0, lower=True, overwrite_b=overwrite_b,
                             check_finite=check_finite)
        return solve_triangular(c, y, trans="C", lower=True, overwrite_b=True, check_finite=False)
    y = solve_triangular(c, b, trans="C", lower=False, overwrite_b=overwrite_b,
                         check_finite=check_finite)
    return solve_triangular(c, y, trans=0, lower=False, overwrite_b=True, check_finite=False)
