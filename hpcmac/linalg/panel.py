"""Panel factorisation: netlib HPL's recursive PFACT/RFACT scheme.

The panel is the ``M x jb`` work array described in :mod:`hpcmac.linalg.pivot`
(diagonal block on top, replicated down the process column; local rows below).
``rfact`` splits the columns into ``ndiv`` pieces, recursively, until a piece
has at most ``nbmin`` columns; those are factored column by column by
``pfact``. Both are one of:

* ``"left"``  left-looking: a piece (column) is brought up to date with the
  pieces (columns) to its left just before it is factored;
* ``"crout"`` Crout: as left-looking for the part below, and the piece's rows
  of U to the right are computed as soon as it is factored;
* ``"right"`` right-looking: after a piece (column) is factored, everything
  to its right is updated at once.

Every pivot swaps whole rows of the panel (all ``jb`` columns), so the
variants only differ in the order of the floating-point work. All work is
BLAS on the panel in place; the only communication is the pivot search.
Collective over the panel's process column (through the pivot object).
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg import _blas as blas

VARIANTS = ("left", "crout", "right")


class PanelFactor:
    """Factor one panel ``W`` in place.

    ``pivoter`` is a :class:`~hpcmac.linalg.pivot.LocalPivot` or
    :class:`~hpcmac.linalg.pivot.ColumnPivot` over the same ``W``. After
    ``run()``: ``W`` holds L (unit lower, below the diagonal) and U (on and
    above it, rows ``0 .. jb-1``), ``ipiv[k]`` the global row swapped with
    global row ``j + k`` (global, agrees down the column), and ``zero`` the
    global index of the first exactly-zero pivot, or -1.
    """

    def __init__(self, w: np.ndarray, wptr: int, ld: int, jb: int, j: int, pivoter,
                 pfact: str, rfact: str, nbmin: int, ndiv: int):
        self.w, self.ptr, self.ld, self.jb, self.j = w, wptr, ld, jb, j
        self.m = w.shape[0]
        self.pivoter = pivoter
        # the plain function, not a bound method: a bound method stored on self is a
        # reference cycle, which would keep W (a view of the broadcast buffer) alive until
        # the cyclic GC runs, i.e. dozens of panel buffers at once
        self.pfact = {"left": PanelFactor._pfact_left, "crout": PanelFactor._pfact_crout,
                      "right": PanelFactor._pfact_right}[pfact]
        self.rfact = rfact
        self.nbmin, self.ndiv = max(1, nbmin), max(2, ndiv)
        self.ipiv = np.empty(jb, dtype=np.int64)
        self.zero = -1
        self.blas = blas.for_dtype(w.dtype)  # float64 (HPL) or float32 (HPL-MxP)

    def run(self) -> None:
        self._rfact(0, self.jb)

    # -- helpers ------------------------------------------------------------------
    def _a(self, i: int, j: int) -> int:
        return self.ptr + self.blas.itemsize * (i + j * self.ld)

    def _pivot_scale(self, k: int) -> None:
        g, v = self.pivoter.pivot(k)
        self.ipiv[k] = g
        if v != 0.0:
            self.blas.scal(self.m - k - 1, 1.0 / v, self._a(k + 1, k), 1)
        elif self.zero < 0:
            self.zero = self.j + k

    # -- recursion ----------------------------------------------------------------
    def _pieces(self, c: int, n: int) -> list[tuple[int, int]]:
        count = min(self.ndiv, n // self.nbmin)
        size = n // count
        out, start = [], c
        for i in range(count):
            width = size if i < count - 1 else c + n - start
            out.append((start, width))
            start += width
        return out

    def _rfact(self, c: int, n: int) -> None:
        if n <= self.nbmin or n // self.nbmin < 2:
            self.pfact(self, c, n)
            return
        a, ld, m, b = self._a, self.ld, self.m, self.blas
        end = c + n
        for ci, ni in self._pieces(c, n):
            r0 = ci + ni
            if self.rfact == "left":
                if ci > c:
                    b.trsm("L", "L", "N", "U", ci - c, ni, 1.0, a(c, c), ld, a(c, ci), ld)
                    b.gemm("N", "N", m - ci, ni, ci - c, -1.0, a(ci, c), ld,
                               a(c, ci), ld, 1.0, a(ci, ci), ld)
                self._rfact(ci, ni)
            elif self.rfact == "crout":
                if ci > c:
                    b.gemm("N", "N", m - ci, ni, ci - c, -1.0, a(ci, c), ld,
                               a(c, ci), ld, 1.0, a(ci, ci), ld)
                self._rfact(ci, ni)
                if r0 < end:
                    if ci > c:
                        b.gemm("N", "N", ni, end - r0, ci - c, -1.0, a(ci, c), ld,
                                   a(c, r0), ld, 1.0, a(ci, r0), ld)
                    b.trsm("L", "L", "N", "U", ni, end - r0, 1.0, a(ci, ci), ld, a(ci, r0), ld)
            else:  # right
                self._rfact(ci, ni)
                if r0 < end:
                    b.trsm("L", "L", "N", "U", ni, end - r0, 1.0, a(ci, ci), ld, a(ci, r0), ld)
                    b.gemm("N", "N", m - r0, end - r0, ni, -1.0, a(r0, ci), ld,
                               a(ci, r0), ld, 1.0, a(r0, r0), ld)

    # -- column-by-column base cases ------------------------------------------------
    def _pfact_right(self, c: int, n: int) -> None:
        a, ld, m, b = self._a, self.ld, self.m, self.blas
        for k in range(c, c + n):
            self._pivot_scale(k)
            b.ger(m - k - 1, c + n - k - 1, -1.0, a(k + 1, k), 1, a(k, k + 1), ld,
                      a(k + 1, k + 1), ld)

    def _pfact_left(self, c: int, n: int) -> None:
        a, ld, m, b = self._a, self.ld, self.m, self.blas
        for k in range(c, c + n):
            if k > c:
                b.trsv("L", "N", "U", k - c, a(c, c), ld, a(c, k), 1)
                b.gemv("N", m - k, k - c, -1.0, a(k, c), ld, a(c, k), 1, 1.0, a(k, k), 1)
            self._pivot_scale(k)

    def _pfact_crout(self, c: int, n: int) -> None:
        a, ld, m, b = self._a, self.ld, self.m, self.blas
        end = c + n
        for k in range(c, end):
            if k > c:
                b.gemv("N", m - k, k - c, -1.0, a(k, c), ld, a(c, k), 1, 1.0, a(k, k), 1)
            self._pivot_scale(k)
            if k > c and k + 1 < end:
                b.gemv("T", k - c, end - k - 1, -1.0, a(c, k + 1), ld, a(k, c), ld,
                           1.0, a(k, k + 1), ld)
