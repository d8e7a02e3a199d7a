"""Matrix norms of a DistMatrix: 1 (max column sum), inf (max row sum), Frobenius, max."""

from __future__ import annotations

import numpy as np

from hpcmac.linalg.distmatrix import DistMatrix


def norm(a: DistMatrix, ord=None) -> float | None:
    """Collective over ``a.grid``: a matrix norm, the same float on every grid rank.

    ``ord`` as in ``scipy.linalg.norm`` for 2-D arrays: None or "fro"
    (Frobenius), 1, inf, -1, -inf, or "max" (largest ``|a_ij|``, ScaLAPACK's
    ``M`` norm). Ranks outside the grid get None.
    """
    grid = a.grid
    if not grid.in_grid:
        return None
    if ord not in (None, "fro", 1, -1, np.inf, -np.inf, "max"):
        raise ValueError(f"norm: ord must be None, 'fro', 1, -1, inf, -inf or 'max', got {ord!r}")
    mag = np.abs(a.local)
    if ord in (None, "fro"):
        s = grid.all.allreduce(np.array([float(np.sum(mag.astype(np.float64) ** 2))]))
        return float(np.sqrt(s[0]))
    if ord == "max":
        local = float(mag.max()) if mag.size else 0.0
        return float(grid.all.allreduce(np.array([local]), op="max")[0])
    axis, sub = (0, grid.col) if ord in (1, -1) else (1, grid.row)
    # sums along my piece, completed over the ranks that share these columns (rows)
    part = np.ascontiguousarray(mag.sum(axis=axis, dtype=np.float64))
    full = sub.allreduce(part) if sub.size > 1 else part
    if ord in (1, np.inf):
        local = float(full.max()) if full.size else 0.0
        return float(grid.all.allreduce(np.array([local]), op="max")[0])
    if a.gshape[0] == 0 or a.gshape[1] == 0:
        return 0.0
    local = float(full.min()) if full.size else np.inf
    return float(grid.all.allreduce(np.array([local]), op="min")[0])
