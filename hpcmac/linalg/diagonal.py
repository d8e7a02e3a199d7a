"""The diagonal of a DistMatrix (``diag``, ``trace``) and a DistMatrix from a diagonal.

Each diagonal entry lives on exactly one rank, so gathering a diagonal is one
sum-allreduce of an O(n) vector over the grid; ``trace`` reduces one number.
"""

from __future__ import annotations

import numpy as np

from hpcmac.comm.grid import Grid
from hpcmac.linalg.checks import require
from hpcmac.linalg.distmatrix import DistMatrix


def _diag_length(shape: tuple[int, int], k: int) -> int:
    m, n = shape
    return max(0, min(m + min(k, 0), n - max(k, 0)))


def diag(v, k: int = 0, grid: Grid | None = None, mb: int = 64, nb: int = 64):
    """As ``numpy.diag`` (``scipy``'s ``np.diag``), both ways.

    A DistMatrix ``v``: collective over its grid; its ``k``-th diagonal as a
    1-D ndarray, the same on every grid rank (None elsewhere).
    A 1-D array ``v`` (the same on every rank) with ``grid`` given: not
    collective; the square DistMatrix with ``v`` on its ``k``-th diagonal,
    ``mb`` × ``nb`` blocks.
    """
    k = int(k)
    if isinstance(v, DistMatrix):
        if not v.grid.in_grid:
            return None
        length = _diag_length(v.gshape, k)
        out = np.zeros(length, dtype=v.dtype)
        if v.local.size and length:
            i, j = v.rows[:, None], v.cols[None, :]
            li, lj = np.nonzero(i + k == j)
            out[v.rows[li] - max(0, -k)] = v.local[li, lj]
        return v.grid.all.allreduce(out) if v.grid.all.size > 1 else out
    arr = np.asarray(v)
    require(arr.ndim == 1, f"diag: expected a DistMatrix or a 1-D array, got shape {arr.shape}")
    require(grid is not None, "diag: building a DistMatrix from a 1-D array needs grid=")
    n = arr.size + abs(k)
    lo = max(0, -k)

    def entries(i, j):
        hit = i + k == j                      # (lm, ln)
        out = np.zeros(hit.shape, dtype=arr.dtype)
        out[hit] = arr[np.broadcast_to(i, hit.shape)[hit] - lo]
        return out

    return DistMatrix.from_function(entries, (n, n), grid, mb, nb, arr.dtype)


def trace(a: DistMatrix, offset: int = 0):
    """Collective over the grid: the sum of the ``offset``-th diagonal, as ``numpy.trace``;
    the same number on every grid rank (None elsewhere)."""
    if not a.grid.in_grid:
        return None
    dtype = a.dtype if a.dtype.kind in "fc" else np.dtype(np.int64)   # numpy's sum types
    part = np.zeros(1, dtype=dtype)
    if a.local.size:
        hit = a.rows[:, None] + int(offset) == a.cols[None, :]
        part[0] = a.local[hit].sum()
    total = a.grid.all.allreduce(part) if a.grid.all.size > 1 else part
    return total[0]
