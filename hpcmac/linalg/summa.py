"""Distributed matrix product C = A @ B by SUMMA (van de Geijn and Watts, 1997).

The inner dimension is walked in panels. For each panel, the process column
owning those columns of A broadcasts its piece along its process rows, the
process row owning those rows of B broadcasts down its process columns, and
every rank adds the outer product of what it received to its piece of C.
C has A's row blocking and B's column blocking; A's column blocks and B's row
blocks need not agree (a panel is cut wherever either has a block edge).
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg import layout
from hpcmac.linalg.arith import matmul_dense
from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import float_dtype, require, same_grid
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.kernels import gemm_update

#: inner-dimension width of one local update (several blocks per GEMM, so C is
#: streamed through memory fewer times)
PANEL = 1024


def _segments(k0: int, k1: int, anb: int, bmb: int) -> list[tuple[int, int]]:
    """Cut [k0, k1) at every block edge of A's columns and of B's rows."""
    cuts = {k0, k1}
    for step in (anb, bmb):
        cuts.update(range((k0 // step + 1) * step, k1, step))
    edges = sorted(cuts)
    return list(zip(edges[:-1], edges[1:]))


def matmul(a, b, check_finite: bool = False):
    """Collective over the grid: ``a @ b`` as a DistMatrix with blocks ``a.mb`` × ``b.nb``.

    Parameters
    ----------
    a, b : DistMatrix
        Global shapes (m, k) and (k, n) on the same grid. Any block sizes.
        One of them may be an ndarray held whole on every rank: the product
        is then an ndarray, whole on every grid rank (as ``a @ b``).
    check_finite : bool
        Check both operands for infs and NaNs first (one reduction each).
    """
    if not isinstance(b, DistMatrix):
        return matmul_dense(a, b)
    if not isinstance(a, DistMatrix):
        return matmul_dense(b, a, reflected=True)
    same_grid("matmul", a, b)
    grid = a.grid
    if not grid.in_grid:   # ranks outside the grid take no part (and may not know shapes)
        return DistMatrix(np.zeros((0, 0), dtype=float_dtype(a.dtype, b.dtype), order="F"),
                          (a.gshape[0], b.gshape[1]), a.mb, b.nb, grid)
    m, k = a.gshape
    k2, n = b.gshape
    require(k == k2, f"matmul: shapes {a.gshape} and {b.gshape} not aligned: "
                     f"{k} (dim 1) != {k2} (dim 0)")
    dtype = float_dtype(a.dtype, b.dtype)
    c = DistMatrix.zeros((m, n), grid, a.mb, b.nb, dtype)
    if check_finite:
        _check_finite(a, "a")
        _check_finite(b, "b")
    al = a.local if a.dtype == dtype else a.local.astype(dtype, order="F")
    bl = b.local if b.dtype == dtype else b.local.astype(dtype, order="F")
    lm, ln = c.lshape
    if grid.nprow == 1 and grid.npcol == 1:   # one rank holds everything: one GEMM
        gemm_update(c.local, al, bl, alpha=1.0, beta=0.0)
        return c
    acol_g = a.cols          # global column indices of my A columns
    brow_g = b.rows          # global row indices of my B rows
    width = max(PANEL, a.nb, b.mb)
    abuf = np.empty(lm * width, dtype=dtype)   # A panel, (lm, w) in Fortran order
    bbuf = np.empty(width * ln, dtype=dtype)   # B panel, (w, ln) in C order
    for p0 in range(0, k, width):
        p1 = min(k, p0 + width)
        for s0, s1 in _segments(p0, p1, a.nb, b.mb):
            w, off = s1 - s0, s0 - p0
            qa = int(layout.owner(s0, a.nb, grid.npcol))
            pb = int(layout.owner(s0, b.mb, grid.nprow))
            aseg = abuf[lm * off: lm * (off + w)]
            if grid.mycol == qa and lm:
                j = int(np.searchsorted(acol_g, s0))
                aseg.reshape((lm, w), order="F")[...] = al[:, j:j + w]
            if grid.npcol > 1 and lm:
                grid.row.bcast(aseg, qa)
            bseg = bbuf[ln * off: ln * (off + w)]
            if grid.myrow == pb and ln:
                i = int(np.searchsorted(brow_g, s0))
                bseg.reshape((w, ln))[...] = bl[i:i + w, :]
            if grid.nprow > 1 and ln:
                grid.col.bcast(bseg, pb)
        pw = p1 - p0
        if lm and ln:
            gemm_update(c.local, abuf[: lm * pw].reshape((lm, pw), order="F"),
                        bbuf[: pw * ln].reshape((pw, ln)), alpha=1.0, beta=1.0)
    return c
