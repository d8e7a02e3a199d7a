"""Trailing update with one factored panel: U = L1^-1 U, then A2 -= L2 U.

Works in place on the local piece through BLAS by address (no copies of the
trailing matrix). Local: no communication; between column chunks it calls
``poll()`` so a non-blocking broadcast in flight (look-ahead) keeps moving.
"""

from __future__ import annotations

from collections.abc import Callable

from hpcmac.linalg import _blas as blas


def solve_u(l1: int, l1_transposed: bool, jb: int, u: int, ldu: int, nc: int,
            u_transposed: bool, b: blas.Routines = blas.DOUBLE) -> None:
    """U (jb x nc, or its transpose nc x jb) := L1^-1 U with L1 unit lower.

    ``l1`` holds L1 (jb x jb, leading dimension jb), or L1^T when ``l1_transposed``;
    ``b`` is the precision's routines (float64 unless told).
    """
    if nc <= 0 or jb <= 0:
        return
    if not u_transposed:
        if l1_transposed:
            b.trsm("L", "U", "T", "U", jb, nc, 1.0, l1, jb, u, ldu)
        else:
            b.trsm("L", "L", "N", "U", jb, nc, 1.0, l1, jb, u, ldu)
    else:  # Ut := Ut L1^-T
        if l1_transposed:
            b.trsm("R", "U", "N", "U", nc, jb, 1.0, l1, jb, u, ldu)
        else:
            b.trsm("R", "L", "T", "U", nc, jb, 1.0, l1, jb, u, ldu)


def gemm_update(mrows: int, nc: int, jb: int, l2: int, ldl: int, u: int, ldu: int,
                u_transposed: bool, c: int, ldc: int, chunk: int = 0,
                poll: Callable[[], bool] | None = None, b: blas.Routines = blas.DOUBLE) -> None:
    """C (mrows x nc) -= L2 (mrows x jb) U (jb x nc; U^T nc x jb when ``u_transposed``).

    With ``poll`` the columns go in chunks of ``chunk`` and ``poll()`` runs
    between them until it returns True (the broadcast it drives is done);
    the remaining columns then go in one call.
    """
    if mrows <= 0 or nc <= 0 or jb <= 0:
        if poll is not None:
            poll()
        return
    tb = "T" if u_transposed else "N"
    c0 = 0
    while c0 < nc:
        w = nc - c0 if (poll is None or chunk <= 0) else min(chunk, nc - c0)
        uoff = u + b.itemsize * (c0 if u_transposed else c0 * ldu)
        b.gemm("N", tb, mrows, w, jb, -1.0, l2, ldl, uoff, ldu, 1.0, c + b.itemsize * c0 * ldc,
               ldc)
        c0 += w
        if poll is not None and poll():
            poll = None
