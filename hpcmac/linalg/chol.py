"""Distributed Cholesky (right-looking, blocked, as ScaLAPACK's pxpotrf) and its solves.

Step k on block column k (width nb):
1. the rank holding the diagonal block factors it (LAPACK potrf) and sends
   L_kk down its process column, whose ranks solve their panel rows
   ``L_ik = A_ik L_kk^-H``;
2. the panel is assembled down that process column and broadcast along the
   process rows, so every rank holds L's rows for its local rows and columns;
3. every rank updates its part of the lower trailing matrix,
   ``A_ij -= L_i L_j^H``, in column chunks: one large GEMM below each
   chunk, block GEMMs on the diagonal band. With look-ahead (depth one),
   block column k+1 is updated, factored and its broadcast started before
   the rest of step k's update.
A failed potrf travels with the panel: every rank raises the same
LinAlgError naming the order of the leading minor (global, 1-based as scipy).
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
from scipy.linalg.lapack import get_lapack_funcs

from hpcmac.linalg import layout
from hpcmac.linalg.broadcast import RowBcast
from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import float_dtype, require
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.kernels import gemm_update, trsm_right
from hpcmac.linalg.rhs import as_dist
from hpcmac.linalg.trisolve import solve_triangular

#: local columns updated by one GEMM below the diagonal band
CHUNK = 512
#: tags of the panel broadcasts (two alternate: one may still be finishing)
BCAST_TAG = 61


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
    by its Cholesky factor L; entries above the diagonal are left arbitrary.

    Look-ahead of depth one, as HPL's: at step k the process column that owns
    block column k+1 first updates that block column alone, factors it and
    starts its broadcast along the process rows, and only then updates the
    rest of its trailing matrix; the other columns receive panel k+1 while
    they update. Nobody waits for a panel that could have been made earlier.
    """
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

    def make_panel(k: int) -> np.ndarray:
        """L[k1:, k0:k1] (Fortran order) then the failure flag, on process column k % Q;
        zeros elsewhere (filled by the row broadcast). Collective over that column."""
        k0, k1 = k * nb, min(n, (k + 1) * nb)
        w, rest = k1 - k0, n - k1
        pk, qk = k % P, k % Q
        pan = np.zeros(rest * w + 1, dtype=dtype)
        if mycol != qk:
            return pan
        r1 = layout.first_local_at_or_after(k1, nb, myrow, P)
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
        return pan

    def share(k: int, pan: np.ndarray):
        """Start panel k's broadcast along the process rows (None on one column)."""
        if Q == 1:
            return None
        return RowBcast(grid.row, k % Q, pan, "1ring", tag=BCAST_TAG + k % 2).start()

    def received(k: int, pan: np.ndarray, bc) -> np.ndarray:
        if bc is not None:
            bc.wait()
        failed = int(pan[-1].real)
        if failed:
            raise scipy.linalg.LinAlgError(
                f"{failed}-th leading minor of the array is not positive definite")
        return pan

    def operands(k: int, pan: np.ndarray):
        """(r1, c1, L rows for my rows below block k, L rows for my columns right of it)."""
        k1 = min(n, (k + 1) * nb)
        r1 = layout.first_local_at_or_after(k1, nb, myrow, P)
        c1 = layout.first_local_at_or_after(k1, nb, mycol, Q)
        full = pan[:-1].reshape((n - k1, k1 - k * nb), order="F")
        # no copy when contiguous
        lr = full if P == 1 else np.asfortranarray(full[rows[r1:] - k1])
        lcol = full if Q == 1 else full[cols[c1:] - k1]
        return r1, c1, lr, lcol

    def update(ops, lo: int, hi: int, bc) -> None:
        """A_ij -= L_i L_j^H on my local columns [lo, hi) right of block k (block-aligned)."""
        r1, c1, lr, lcol = ops
        if lm <= r1 or hi <= lo:
            return
        for ca in range(lo, hi, chunk):
            cb = min(hi, ca + chunk)
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
            if bc is not None:
                bc.test()   # forward the next panel while the update goes on

    pan = make_panel(0)
    pan = received(0, pan, share(0, pan))
    for k in range(nblk):
        k1 = min(n, (k + 1) * nb)
        ops = operands(k, pan)
        c1 = ops[1]   # my first column right of block k
        nxt_pan = bc = None
        start = c1
        if k + 1 < nblk:
            if mycol == (k + 1) % Q:   # block column k+1 is my first local block right of k
                start = min(ln, c1 + min(nb, n - k1))
                update(ops, c1, start, None)
            nxt_pan = make_panel(k + 1)
            bc = share(k + 1, nxt_pan)
        update(ops, start, ln, bc)
        if nxt_pan is not None:
            pan = received(k + 1, nxt_pan, bc)


def cho_solve(c_and_lower: tuple[DistMatrix, bool], b, overwrite_b: bool = False,
              check_finite: bool = True):
    """Collective over the grid: solve ``a x = b`` given ``cho_factor(a)``, as in scipy.

    ``b`` is global (n, nrhs) on the factor's grid, any block sizes (x comes
    back in ``b``'s layout), or an ndarray (n,) or (n, nrhs) holding the whole
    right-hand side on every rank (x comes back whole on every grid rank).
    """
    c, lower = c_and_lower
    if not c.grid.in_grid:
        return b if isinstance(b, DistMatrix) else None
    require(c.gshape[0] == c.gshape[1], f"cho_solve: the factor must be square, got {c.gshape}")
    bd, back = as_dist(b, c, "cho_solve")
    require(bd.gshape[0] == c.gshape[0],
            f"cho_solve: incompatible dimensions: factor {c.gshape}, b {bd.gshape}")
    if lower:
        y = solve_triangular(c, bd, trans=0, lower=True, overwrite_b=overwrite_b,
                             check_finite=check_finite)
        return back(solve_triangular(c, y, trans="C", lower=True, overwrite_b=True,
                                     check_finite=False))
    y = solve_triangular(c, bd, trans="C", lower=False, overwrite_b=overwrite_b,
                         check_finite=check_finite)
    return back(solve_triangular(c, y, trans=0, lower=False, overwrite_b=True,
                                 check_finite=False))


def cholesky(a: DistMatrix, lower: bool = False, overwrite_a: bool = False,
             check_finite: bool = True) -> DistMatrix:
    """Collective over the grid: the Cholesky factor, as ``scipy.linalg.cholesky``.

    Returns U with ``a = U^H U`` (or L with ``a = L L^H`` when ``lower``),
    the other triangle zeroed, in ``a``'s layout. Only that triangle of ``a``
    is read. Raises LinAlgError naming the failing leading minor on every
    grid rank when ``a`` is not positive definite.
    """
    c, _ = cho_factor(a, lower=lower, overwrite_a=overwrite_a, check_finite=check_finite)
    if c.grid.in_grid and c.local.size:
        i, j = c.rows[:, None], c.cols[None, :]
        c.local[(i < j) if lower else (i > j)] = 0
    return c
