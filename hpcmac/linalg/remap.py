"""Move a DistMatrix to another block-cyclic layout (and optionally transpose it).

Every source rank sends each destination rank the entries it owns there in
one message (rows and columns in increasing global order on both sides, so no
index lists travel). Collective over the group both grids are built on.
"""

from __future__ import annotations

import numpy as np

from hpcmac.comm.grid import Grid
from hpcmac.linalg import layout

_TAG = 23


def _check_same_group(src: Grid, dst: Grid) -> None:
    if src.group is not dst.group and src.group.size != dst.group.size:
        raise ValueError(
            f"redistribute: grids are over different groups (sizes {src.group.size} and "
            f"{dst.group.size})"
        )


def remap(a, grid: Grid, mb: int, nb: int, transpose: bool = False):
    """Collective: ``a`` (or ``a.T``) laid out on ``grid`` with ``mb``×``nb`` blocks.

    ``grid``, ``mb``, ``nb``, ``transpose`` are global. On the same grid as
    ``a`` only that grid's ranks take part (others get an empty piece at
    once); onto another grid every rank of ``grid.group`` must call.
    """
    from hpcmac.linalg.distmatrix import DistMatrix

    src = a.grid
    _check_same_group(src, grid)
    if mb < 1 or nb < 1:
        raise ValueError(f"redistribute: block sizes must be >= 1, got {mb}x{nb}")
    if grid is src or (grid.group is src.group and grid.shape == src.shape
                       and grid.order == src.order):
        # one grid: only its ranks take part (their ranks in grid.all equal those in grid.group)
        if not src.in_grid:
            return DistMatrix(np.zeros((0, 0), dtype=a.dtype, order="F"), a.gshape, mb, nb, grid)
        group = src.all
        gshape, dtype = a.gshape, a.dtype
    else:
        group = src.group
        # ranks outside the source grid may not know the shape: rank 0 is always inside
        gshape, dtype = group.bcast_obj((a.gshape, a.dtype.str) if group.rank == 0 else None, 0)
        dtype = np.dtype(dtype)
    m, n = gshape
    tm, tn = (n, m) if transpose else (m, n)
    out = DistMatrix.empty((tm, tn), grid, mb, nb, dtype)
    if not out.grid.in_grid:
        out = DistMatrix(np.zeros((0, 0), dtype=dtype, order="F"), (tm, tn), mb, nb, grid)

    sends, recvs, keep = [], [], []
    me = group.rank
    if src.in_grid:
        gi, gj = a.rows, a.cols
        # under the destination layout: which process row / column each of my indices goes to
        if transpose:
            to_prow = layout.owner(gj, mb, grid.nprow)   # my columns become rows
            to_pcol = layout.owner(gi, nb, grid.npcol)
        else:
            to_prow = layout.owner(gi, mb, grid.nprow)
            to_pcol = layout.owner(gj, nb, grid.npcol)
        for d in range(grid.nprow * grid.npcol):
            pr, pc = grid.coords(d)
            if transpose:
                sel_r = np.flatnonzero(to_pcol == pc)
                sel_c = np.flatnonzero(to_prow == pr)
            else:
                sel_r = np.flatnonzero(to_prow == pr)
                sel_c = np.flatnonzero(to_pcol == pc)
            if sel_r.size == 0 or sel_c.size == 0:
                continue
            piece = a.local[np.ix_(sel_r, sel_c)]
            if transpose:
                piece = piece.T
            if d == me:
                keep.append(piece)
                continue
            buf = np.ascontiguousarray(piece.ravel(order="F"))
            sends.append((group.isend(buf, d, tag=_TAG), buf))
    if grid.in_grid:
        ri, cj = out.rows, out.cols
        for s in range(src.nprow * src.npcol):
            pr, pc = src.coords(s)
            if transpose:
                sel_r = np.flatnonzero(layout.owner(ri, a.nb, src.npcol) == pc)
                sel_c = np.flatnonzero(layout.owner(cj, a.mb, src.nprow) == pr)
            else:
                sel_r = np.flatnonzero(layout.owner(ri, a.mb, src.nprow) == pr)
                sel_c = np.flatnonzero(layout.owner(cj, a.nb, src.npcol) == pc)
            if sel_r.size == 0 or sel_c.size == 0:
                continue
            if s == me:
                out.local[np.ix_(sel_r, sel_c)] = keep.pop()
                continue
            buf = np.empty(sel_r.size * sel_c.size, dtype=dtype)
            recvs.append((group.irecv(buf, s, tag=_TAG), buf, sel_r, sel_c))
        for req, buf, sel_r, sel_c in recvs:
            req.wait()
            out.local[np.ix_(sel_r, sel_c)] = buf.reshape((sel_r.size, sel_c.size), order="F")
    for req, _ in sends:
        req.wait()
    return out
