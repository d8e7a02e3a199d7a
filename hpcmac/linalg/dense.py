"""scipy.linalg's dense solver names over DistMatrix: ``lu_factor``, ``lu_solve``, ``solve``.

The LU is the one HPL runs (``hpcmac.linalg.lu``: right-looking, partial
pivoting, panel broadcasts and row swaps as netlib HPL); this module adds
scipy's argument conventions, checks and error messages around it.
"""

from __future__ import annotations

import re

import numpy as np
from scipy.linalg import LinAlgError

from hpcmac.linalg.checks import check_finite as _check_finite
from hpcmac.linalg.checks import require
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.rhs import as_dist as _as_dist

_TRANS = {0: 0, 1: 1, 2: 2, "N": 0, "T": 1, "C": 2}


def lu_factor(a: DistMatrix, overwrite_a: bool = False, check_finite: bool = True,
              opts=None) -> tuple[DistMatrix, np.ndarray]:
    """Collective over the grid: LU with partial pivoting, as ``scipy.linalg.lu_factor``.

    Returns ``(lu, piv)``: ``lu`` (global (n, n)) holds U and the unit lower
    L, with square ``a.nb`` blocks (``a`` is redistributed first when
    ``a.mb != a.nb``); ``piv`` (global, the same int array on every rank,
    0-based) says row i was interchanged with row ``piv[i]``. The LU works
    in float64 (float32 input is promoted; complex is not supported here:
    ``solve`` handles complex systems through the real form, ``cho_factor``
    Hermitian positive definite ones).
    Unlike scipy, which warns, an exactly singular matrix raises LinAlgError
    naming the zero pivot's global index on every rank. ``opts``
    (``hpcmac.linalg.lu.LUOptions``) selects HPL's variants.
    """
    from hpcmac.linalg.lu import lu_factor_dist

    if not a.grid.in_grid:   # ranks outside the grid take no part (and may not know shapes)
        return a.copy(), np.zeros(0, dtype=np.int64)
    require(a.gshape[0] == a.gshape[1],
            f"lu_factor: expected a square matrix, got shape {a.gshape}")
    require(not np.iscomplexobj(a.local) and a.dtype.kind != "c",
            f"lu_factor: complex matrices ({a.dtype}) are not supported by the distributed LU; "
            f"use gmres, or cho_factor for Hermitian positive definite ones")
    grid = a.grid
    if check_finite:
        _check_finite(a, "a")
    if a.mb != a.nb:
        work = a.redistribute(grid, a.nb, a.nb).astype(np.float64)
    elif overwrite_a and a.dtype == np.float64 and a.local.flags.f_contiguous:
        work = a
    else:
        work = a.astype(np.float64)
    lu, piv = lu_factor_dist(work, opts)
    return lu, np.asarray(piv, dtype=np.int64)


def lu_solve(lu_and_piv: tuple[DistMatrix, np.ndarray], b, trans=0, overwrite_b: bool = False,
             check_finite: bool = True):
    """Collective over the grid: solve ``op(a) x = b`` from ``lu_factor(a)``, as scipy.

    ``b`` is a DistMatrix (n, nrhs) on the factor's grid (x comes back in
    ``b``'s layout) or an ndarray (n,) or (n, nrhs) holding the whole
    right-hand side on every rank (x comes back whole on every grid rank).
    """
    from hpcmac.linalg.lu import lu_solve_dist

    lu, piv = lu_and_piv
    if not lu.grid.in_grid:
        return None if not isinstance(b, DistMatrix) else b
    require(trans in _TRANS, f"lu_solve: trans must be 0, 1, 2, 'N', 'T' or 'C', got {trans!r}")
    bd, back = _as_dist(b, lu, "lu_solve")
    require(bd.gshape[0] == lu.gshape[0],
            f"lu_solve: incompatible dimensions: factor {lu.gshape}, b {bd.gshape}")
    require(bd.dtype.kind != "c", "lu_solve: complex right-hand sides are not supported")
    if check_finite:
        _check_finite(bd, "b")
    x = lu_solve_dist((lu, piv), bd if bd.dtype == np.float64 else bd.astype(np.float64),
                      trans=_TRANS[trans])
    out_dtype = np.result_type(bd.dtype, np.float32)
    if x.dtype != out_dtype:
        x = x.astype(out_dtype)
    return back(x)


def solve(a: DistMatrix, b, lower: bool = False, overwrite_a: bool = False,
          overwrite_b: bool = False, check_finite: bool = True, assume_a: str | None = None,
          transposed: bool = False):
    """Collective over the grid: solve ``a x = b``, as ``scipy.linalg.solve``.

    ``assume_a``: None or "gen"/"general", "sym", "her" (LU), "pos" (Cholesky),
    "lower triangular"/"upper triangular" (substitution). ``b`` as in
    ``lu_solve``. A singular ``a`` raises LinAlgError on every rank. Complex
    ``a`` (general) is solved by the LU of its real 2n x 2n form.
    """
    from hpcmac.linalg.chol import cho_factor, cho_solve
    from hpcmac.linalg.trisolve import solve_triangular

    kinds = {None: "gen", "gen": "gen", "general": "gen", "sym": "gen", "her": "gen",
             "symmetric": "gen", "hermitian": "gen", "pos": "pos", "positive definite": "pos",
             "lower triangular": "lower", "upper triangular": "upper"}
    require(assume_a in kinds, f"solve: assume_a={assume_a!r} is not one of "
                               f"{', '.join(repr(k) for k in kinds if k)}")
    kind = kinds[assume_a]
    if not a.grid.in_grid:
        return None if not isinstance(b, DistMatrix) else b
    require(a.gshape[0] == a.gshape[1], f"solve: expected a square matrix, got shape {a.gshape}")
    bd, back = _as_dist(b, a, "solve")
    require(bd.gshape[0] == a.gshape[0],
            f"solve: incompatible dimensions: a {a.gshape}, b {bd.gshape}")
    if check_finite:
        _check_finite(a, "a")
        _check_finite(bd, "b")
    if kind in ("lower", "upper"):
        x = solve_triangular(a, bd, trans=1 if transposed else 0, lower=(kind == "lower"),
                             overwrite_b=overwrite_b, check_finite=False)
    elif kind == "pos":
        x = cho_solve(cho_factor(a, lower=lower, overwrite_a=overwrite_a, check_finite=False), bd,
                      overwrite_b=overwrite_b, check_finite=False)
    elif np.iscomplexobj(a.local) or bd.dtype.kind == "c":
        x = _solve_complex(a, bd, transposed)
    else:
        x = lu_solve(lu_factor(a, overwrite_a=overwrite_a, check_finite=False), bd,
                     trans=1 if transposed else 0, overwrite_b=overwrite_b, check_finite=False)
    return back(x)


def _solve_complex(a: DistMatrix, b: DistMatrix, transposed: bool) -> DistMatrix:
    """Complex ``a x = b`` (or ``a.T x = b``) by LU of the real form, no communication to build it.

    Entry (i, j) of ``a`` becomes the 2 x 2 block ``[[re, -im], [im, re]]`` at
    rows 2i, 2i+1 and columns 2j, 2j+1; with 2mb x 2nb blocks this is the same
    block on the same rank, so each rank interleaves its own piece. x and b
    interleave real and imaginary parts by rows likewise.
    """
    src = a.local.conj() if transposed else a.local   # M(conj a)^T = M(a^T)
    lm, ln = src.shape
    m = np.empty((2 * lm, 2 * ln), dtype=np.float64, order="F")
    m[0::2, 0::2], m[0::2, 1::2] = src.real, -src.imag
    m[1::2, 0::2], m[1::2, 1::2] = src.imag, src.real
    big = DistMatrix(m, (2 * a.gshape[0], 2 * a.gshape[1]), 2 * a.mb, 2 * a.nb, a.grid)
    rhs = np.empty((2 * b.lshape[0], b.lshape[1]), dtype=np.float64, order="F")
    rhs[0::2], rhs[1::2] = b.local.real, b.local.imag
    bb = DistMatrix(rhs, (2 * b.gshape[0], b.gshape[1]), 2 * b.mb, b.nb, b.grid)
    try:
        fac = lu_factor(big, overwrite_a=True, check_finite=False)
    except LinAlgError as exc:
        found = re.search(r"global index (\d+)", str(exc))
        where = f" at global index {int(found.group(1)) // 2}" if found else ""
        raise LinAlgError(f"singular matrix: zero pivot{where} (complex matrix, factored in "
                          f"its real form)") from None
    xr = lu_solve(fac, bb, trans=1 if transposed else 0, check_finite=False)   # bb's layout
    x = DistMatrix((xr.local[0::2] + 1j * xr.local[1::2]).astype(np.complex128, order="F"),
                   b.gshape, b.mb, b.nb, b.grid)
    return x
