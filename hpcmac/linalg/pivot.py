"""Pivot search for one column of a panel, and the row interchange it implies.

The panel being factored is held as a work array ``W`` (Fortran order, ``M``
rows by ``jb`` columns, leading dimension ``ld``) on every process of the
panel's process column:

* rows ``0 .. jb-1`` are the panel's diagonal block (global rows
  ``j .. j+jb-1``), *replicated* on every process of the column (only the
  process row that owns them, ``owns_top``, offers them as pivot candidates);
* rows ``jb .. M-1`` are this process's own (local) rows below that block.

After ``pivot(k)`` row ``k`` of ``W`` holds the pivot row on every process of
the column, and the row it replaced sits where the pivot came from. Two
implementations: :class:`LocalPivot` (one process row: no communication) and
:class:`ColumnPivot` (one allgather per column carrying the candidate rows, so
the winner's whole row arrives with the reduction, as netlib's HPL_pdmxswp).
:class:`NoPivot` keeps the diagonal as the pivot (HPL-MxP's LU without
pivoting, for diagonally dominant matrices): no search, no swap, no message.
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg import _blas as blas


class LocalPivot:
    """Pivot search when the process column has a single process row (P == 1).

    ``glob[r]`` is the global row index of ``W`` row ``r`` (local to this rank).
    """

    def __init__(self, w: np.ndarray, wptr: int, ld: int, jb: int, glob: np.ndarray):
        self.w, self.ptr, self.ld, self.jb, self.glob = w, wptr, ld, jb, glob
        self.m = w.shape[0]

    def pivot(self, k: int) -> tuple[int, float]:
        """Local: swap the largest |W[r, k]|, r >= k, into row k; return (global row, value)."""
        ptr, ld, b = self.ptr, self.ld, blas.for_dtype(self.w.dtype)
        sz = b.itemsize
        r = k + b.iamax(self.m - k, ptr + sz * (k + k * ld), 1)
        if r != k:
            b.swap(self.jb, ptr + sz * r, ld, ptr + sz * k, ld)
        return int(self.glob[r]), float(self.w[k, k])


class ColumnPivot:
    """Pivot search down a process column of P > 1 process rows.

    Collective over ``group`` (the grid's column group): every process of the
    column calls ``pivot(k)`` for the same ``k`` in the same order.
    ``glob`` (local) maps ``W`` rows to global rows; ``j`` (global) is the
    panel's first row; ``owns_top`` (local) says this process owns rows
    ``j .. j+jb-1``.
    """

    def __init__(self, w, wptr, ld, jb, glob, j, owns_top, group):
        self.w, self.ptr, self.ld, self.jb, self.glob = w, wptr, ld, jb, glob
        self.m = w.shape[0]
        self.j, self.owns_top, self.group = j, owns_top, group
        self.send = np.empty(jb + 2, dtype=np.float64)  # (|value|, global row, row[0:jb])
        self.recv = np.empty((group.size, jb + 2), dtype=np.float64)

    def pivot(self, k: int) -> tuple[int, float]:
        """Collective over the column group: see the class docstring."""
        w, ptr, ld, jb = self.w, self.ptr, self.ld, self.jb
        b = blas.for_dtype(w.dtype)
        sz = b.itemsize
        start = k if self.owns_top else jb
        send = self.send
        if start < self.m:
            r = start + b.iamax(self.m - start, ptr + sz * (start + k * ld), 1)
            send[0] = abs(w[r, k])
            send[1] = self.glob[r]
            send[2:] = w[r, :]
        else:  # no candidate here: can never win
            r = -1
            send[0] = -1.0
            send[1] = np.inf
        got = self.group.allgather(send, out=self.recv)
        # largest magnitude, ties to the smallest global row: all ranks agree
        best = 0
        for q in range(1, got.shape[0]):
            if got[q, 0] > got[best, 0] or (got[q, 0] == got[best, 0] and got[q, 1] < got[best, 1]):
                best = q
        g = int(got[best, 1])
        row = got[best, 2:]
        top = self.j + k
        if g != top:
            if g < self.j + jb:  # inside the replicated block: every process swaps
                t = g - self.j
                b.swap(jb, ptr + sz * t, ld, ptr + sz * k, ld)
            else:
                if best == self.group.rank:
                    w[r, :] = w[k, :]
                w[k, :] = row
        return g, float(row[k])


class NoPivot:
    """No pivoting: row ``k`` of ``W`` (global row ``j + k``) is the pivot row.

    For matrices whose LU is stable without interchanges (diagonally dominant,
    as HPL-MxP's). ``W``'s top ``jb`` rows are the diagonal block on every
    process of the column, so each reads the pivot locally: no communication.
    """

    def __init__(self, w: np.ndarray, j: int):
        self.w, self.j = w, j

    def pivot(self, k: int) -> tuple[int, float]:
        """Local: (global row ``j + k``, ``W[k, k]``); nothing moves."""
        return self.j + k, float(self.w[k, k])
