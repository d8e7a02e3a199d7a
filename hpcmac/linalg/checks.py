"""Argument checks shared by the distributed solvers.

Shape and layout checks look only at global values (``gshape``, ``mb``,
``nb``, the grid), so every rank reaches the same verdict and raises the same
error without communicating. The finiteness check is a collective: one
reduction, then every rank of the grid raises the same ``ValueError``.
"""

from __future__ import annotations

import numpy as np


def require(cond: bool, msg: str) -> None:
    """Raise ``ValueError(msg)`` when ``cond`` is false (same on every rank: ``cond`` is global)."""
    if not cond:
        raise ValueError(msg)


def same_grid(what: str, *mats) -> None:
    """All DistMatrix operands live on one grid (global check)."""
    g = mats[0].grid
    for m in mats[1:]:
        if m.grid is not g and (m.grid.group is not g.group or m.grid.shape != g.shape
                                or m.grid.order != g.order):
            raise ValueError(
                f"{what}: operands are on different process grids "
                f"({g.nprow}x{g.npcol} {g.order} and {m.grid.nprow}x{m.grid.npcol} {m.grid.order})"
            )


def check_finite(a, name: str = "array") -> None:
    """Collective over ``a.grid``: ValueError on every grid rank if any entry is inf or NaN."""
    grid = a.grid
    bad = 0.0 if (a.local.size == 0 or np.isfinite(a.local).all()) else 1.0
    flag = grid.all.allreduce(np.array([bad]), op="max")
    if flag[0] > 0:
        raise ValueError(f"{name} must not contain infs or NaNs")


def float_dtype(*dtypes) -> np.dtype:
    """The LAPACK dtype for operands of these dtypes (ints and bools become float64)."""
    dt = np.result_type(*dtypes)
    if dt.kind not in "fc":
        return np.dtype(np.float64)
    if dt == np.float16:
        return np.dtype(np.float32)
    if dt.itemsize > 16 or dt == np.longdouble:
        return np.dtype(np.complex128 if dt.kind == "c" else np.float64)
    return dt
