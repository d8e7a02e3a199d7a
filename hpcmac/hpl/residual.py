"""Netlib HPL's check, blocked: norms of A, x, b and ``||Ax - b||_oo`` in O(rows) memory.

Netlib's ``HPL_pdtest`` regenerates [A | b] after the solve and computes
``||A||_oo``, ``||A||_1``, ``||b||_oo`` and ``r = A x - b``. Here the local piece
is visited a few columns at a time: either views of a stored piece
(:func:`check_solution`) or blocks regenerated on the fly and never stored
(:func:`check_regenerated`), so the check needs no copy of the matrix, only
O(local rows x block width) scratch. The communication (one sum along the
process row or column, one max over the grid per norm) happens at the end.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.comm.grid import Grid
from hpcmac.hpl import matgen
from hpcmac.linalg import layout
from hpcmac.linalg.distmatrix import DistMatrix

#: bytes of float64 scratch for |A| of one block of columns
_SCRATCH = 1 << 21


def _max(group: Group, value: float) -> float:
    return float(group.allreduce(np.array([value], dtype=np.float64), op="max")[0])


def _width(lm: int) -> int:
    return max(1, _SCRATCH // (8 * max(lm, 1)))


def _local_norms(blocks: Iterable[tuple[int, int, np.ndarray]], cols: np.ndarray, n: int,
                 lm: int, x: np.ndarray, owned: bool) -> tuple[np.ndarray, np.ndarray,
                                                                  float, np.ndarray]:
    """Local partial sums over this rank's columns, block by block (not collective).

    ``blocks`` yields ``(j0, j1, block)``: local columns j0..j1 of [A | b] as an
    (lm, j1 - j0) array; ``owned`` says the block is scratch that may be overwritten.

    Returns (row sums of |A|, column sums of |A| per local column of A, max |b|,
    the local part of A x - b).
    """
    n_a = int(np.count_nonzero(cols < n))  # local columns of A: a prefix (cols ascend)
    rows_abs = np.zeros(lm)  # (lm,)
    cols_abs = np.zeros(n_a)  # (local columns of A,)
    r = np.zeros(lm)  # (lm,)
    b_max = 0.0
    scratch = None
    for j0, j1, block in blocks:
        k = max(0, min(j1, n_a) - j0)  # columns of A in this block
        a_part = block[:, :k]  # (lm, k)
        if k:
            r += a_part @ x[cols[j0:j0 + k]]
            if owned:
                absa = np.abs(a_part, out=a_part)
            else:
                if scratch is None:
                    scratch = np.empty((lm, j1 - j0), order="F")
                absa = np.abs(a_part, out=scratch[:, :k])
            rows_abs += absa.sum(axis=1)
            cols_abs[j0:j0 + k] = absa.sum(axis=0)
        if k < j1 - j0:  # b, the last global column, lives here
            bcol = block[:, k]
            r -= bcol
            b_max = float(np.abs(bcol).max()) if lm else 0.0
    return rows_abs, cols_abs, b_max, r


def _reduce(grid: Grid, x: np.ndarray, rows_abs: np.ndarray, cols_abs: np.ndarray,
            b_max: float, r: np.ndarray) -> dict[str, float]:
    """Collective over ``grid``: the global norms from every rank's partial sums."""
    lm = rows_abs.size
    out = {"norm_x_inf": float(np.abs(x).max()) if x.size else 0.0,
           "norm_x_1": float(np.abs(x).sum())}
    # ||A||_oo: row sums over the process row, then the max down the process column
    if lm:
        grid.row.allreduce(rows_abs, op="sum", out=rows_abs)
    out["norm_a_inf"] = _max(grid.all, float(rows_abs.max()) if lm else 0.0)
    # ||A||_1: column sums down the process column, then the max along the row
    if cols_abs.size:
        grid.col.allreduce(cols_abs, op="sum", out=cols_abs)
    out["norm_a_1"] = _max(grid.all, float(cols_abs.max()) if cols_abs.size else 0.0)
    out["norm_b_inf"] = _max(grid.all, b_max)
    # r = A x - b: local partial products summed along the process row
    if lm:
        grid.row.allreduce(r, op="sum", out=r)
    out["resid0"] = _max(grid.all, float(np.abs(r).max()) if lm else 0.0)
    return out


def check_solution(a: DistMatrix, x: np.ndarray) -> dict[str, float]:
    """Collective over ``a.grid``: netlib's norms of A, x, b and ``||Ax - b||_oo``.

    Parameters
    ----------
    a : DistMatrix, N x (N+1)
        The *original* [A | b] (regenerated, not the factored one); not modified.
    x : (N,) float64, the solution, replicated (the same on every grid rank).

    Returns
    -------
    dict with norm_a_inf, norm_a_1, norm_x_inf, norm_x_1, norm_b_inf, resid0;
    the same on every rank of the grid.
    """
    n = a.gshape[0]
    x = np.asarray(x, dtype=np.float64)
    cols = a.cols
    lm, ln = a.local.shape
    w = _width(lm)
    blocks = ((j0, min(j0 + w, ln), a.local[:, j0:j0 + w]) for j0 in range(0, ln, w))
    parts = _local_norms(blocks, cols, n, lm, x, owned=False)
    return _reduce(a.grid, x, *parts)


def check_regenerated(n: int, nb: int, grid: Grid, x: np.ndarray,
                      seed: int = matgen.SEED) -> dict[str, float]:
    """Collective over ``grid``: :func:`check_solution` of netlib's [A | b], regenerated
    block by block and never stored (the factored matrix may be freed first).

    ``n``, ``nb``, ``seed`` global; ``x`` (N,) replicated. Same result as
    ``check_solution(matgen.generate(n, nb, grid, seed), x)``.
    """
    x = np.asarray(x, dtype=np.float64)
    if grid.in_grid:
        rows = layout.global_indices(n, nb, grid.myrow, grid.nprow)
        cols = layout.global_indices(n + 1, nb, grid.mycol, grid.npcol)
    else:
        rows = cols = np.zeros(0, dtype=np.int64)
    blocks = matgen.column_blocks(rows, cols, n, seed, width=_width(rows.size))
    parts = _local_norms(blocks, cols, n, rows.size, x, owned=True)
    return _reduce(grid, x, *parts)
