"""Matrix inverse and determinants from the distributed LU: ``inv``, ``det``, ``slogdet``.

``inv`` solves ``a x = I`` with the LU (complex ``a``: through ``solve``'s
real form). ``det`` and ``slogdet`` multiply U's diagonal (gathered once,
O(n)) and take the sign of the row interchanges from ``piv``, which every
rank holds; the product is formed in the same order on every rank, so every
rank returns the same number. A complex ``a`` (no complex LU here) goes
through the distributed QR instead: ``det(a) = prod(det H_j) prod(R_jj)``,
``det H_j = -tau_j / conj(tau_j)`` for a unitary reflector.
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


def _factors(a: DistMatrix, what: str, overwrite_a: bool, check_finite: bool):
    """``(d, phase)`` with ``det(a) = phase * prod(d)`` (d: U's or R's diagonal; phase:
    +-1 from the row interchanges, or the reflectors' determinants for complex ``a``),
    or None for an exactly singular ``a``."""
    n, n2 = a.gshape
    require(n == n2, f"{what}: expected a square matrix, got shape {a.gshape}")
    if check_finite:
        _check_finite(a, "a")
    if a.dtype.kind == "c":   # no complex LU: a = Q R, det(H) = -tau / conj(tau) per reflector
        from hpcmac.linalg.householder import qr_factor

        f = qr_factor(a, overwrite_a=overwrite_a)
        t = f.tau[f.tau != 0]
        return diag(f.qr), complex(np.prod(-t / np.conj(t)))
    try:
        lu, piv = lu_factor(a, overwrite_a=overwrite_a, check_finite=False)
    except LinAlgError:   # raised on every grid rank alike: an exactly zero pivot
        return None
    swaps = int(np.count_nonzero(piv != np.arange(n)))
    return diag(lu), (-1.0 if swaps % 2 else 1.0)


def slogdet(a: DistMatrix, overwrite_a: bool = False, check_finite: bool = True):
    """Collective over the grid: ``(sign, logabsdet)`` of a square ``a``, as
    ``numpy.linalg.slogdet`` (complex ``a``: ``sign`` is complex of modulus 1); a
    singular ``a`` gives ``(0.0, -inf)``. The same pair on every grid rank (None
    elsewhere)."""
    if not a.grid.in_grid:
        return None
    got = _factors(a, "slogdet", overwrite_a, check_finite)
    if got is None:
        return 0.0, -np.inf
    d, phase = got
    if np.any(d == 0):
        return 0.0, -np.inf
    mag = np.abs(d)
    sign = phase * np.prod(d / mag)
    if not np.iscomplexobj(d):
        sign = float(np.sign(sign))
    return sign, float(np.sum(np.log(mag)))


def det(a: DistMatrix, overwrite_a: bool = False, check_finite: bool = True):
    """Collective over the grid: the determinant of a square ``a``, as
    ``scipy.linalg.det`` (0.0 when singular). The same number on every grid rank
    (None elsewhere). For large n prefer ``slogdet``: the product over- or underflows."""
    if not a.grid.in_grid:
        return None
    got = _factors(a, "det", overwrite_a, check_finite)
    if got is None:
        return 0.0
    d, phase = got
    value = phase * np.prod(d)
    return complex(value) if np.iscomplexobj(d) else float(value)
