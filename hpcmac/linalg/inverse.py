"""Matrix inverse and determinants from the distributed LU: ``inv``, ``det``, ``slogdet``.

``inv`` solves ``a x = I`` with the LU (complex ``a``: through ``solve``'s
real form). ``det`` and ``slogdet`` multiply U's diagonal (gathered once,
O(n)) and take the sign of the row interchanges from ``piv``, which every
rank holds; the product is formed in the same order on every rank, so every
rank returns the same number.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import LinAlgError

from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import require
from hpcmac.linalg.dense import lu_factor, solve
from hpcmac.linalg.diagonal import diag
from hpcmac.linalg.distmatrix import DistMatrix


def inv(a: DistMatrix, overwrite_a: bool = False, check_finite: bool = True) -> DistMatrix:
    """Collective over the grid: the inverse of a square ``a``, as ``scipy.linalg.inv``.

    The result has ``a``'s layout. A singular ``a`` raises LinAlgError on
    every grid rank (naming the zero pivot).
    """
    if not a.grid.in_grid:
        return a
    n, n2 = a.gshape
    require(n == n2, f"inv: expected a square matrix, got shape {a.gshape}")
    eye = DistMatrix.eye(n, a.grid, a.mb, a.nb, dtype=a.dtype)
    return solve(a, eye, overwrite_a=overwrite_a, overwrite_b=True, check_finite=check_finite)


def _lu_diagonal(a: DistMatrix, what: str, overwrite_a: bool, check_finite: bool):
    """(U's diagonal, row-interchange parity), or None for an exactly singular ``a``."""
    n, n2 = a.gshape
    require(n == n2, f"{what}: expected a square matrix, got shape {a.gshape}")
    require(a.dtype.kind != "c",
            f"{what}: complex matrices ({a.dtype}) are not supported by the distributed LU")
    if check_finite:
        _check_finite(a, "a")
    try:
        lu, piv = lu_factor(a, overwrite_a=overwrite_a, check_finite=False)
    except LinAlgError:   # raised on every grid rank alike: an exactly zero pivot
        return None
    swaps = int(np.count_nonzero(piv != np.arange(n)))
    return diag(lu), swaps % 2


def slogdet(a: DistMatrix, overwrite_a: bool = False, check_finite: bool = True):
    """Collective over the grid: ``(sign, logabsdet)`` of a square real ``a``, as
    ``numpy.linalg.slogdet``; a singular ``a`` gives ``(0.0, -inf)``. The same pair on
    every grid rank (None elsewhere)."""
    if not a.grid.in_grid:
        return None
    got = _lu_diagonal(a, "slogdet", overwrite_a, check_finite)
    if got is None:
        return 0.0, -np.inf
    d, parity = got
    if np.any(d == 0):
        return 0.0, -np.inf
    neg = int(np.count_nonzero(d < 0)) + parity
    return (-1.0 if neg % 2 else 1.0), float(np.sum(np.log(np.abs(d))))


def det(a: DistMatrix, overwrite_a: bool = False, check_finite: bool = True):
    """Collective over the grid: the determinant of a square real ``a``, as
    ``scipy.linalg.det`` (0.0 when singular). The same number on every grid rank
    (None elsewhere). For large n prefer ``slogdet``: the product over- or underflows."""
    if not a.grid.in_grid:
        return None
    got = _lu_diagonal(a, "det", overwrite_a, check_finite)
    if got is None:
        return 0.0
    d, parity = got
    value = float(np.prod(d))
    return -value if parity else value
