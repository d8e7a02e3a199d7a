"""Distributed Householder QR over the block-cyclic layout (as ScaLAPACK's pxgeqrf), and Q.

Panel k (global columns ``[k0, k1)``, at most ``nb`` wide) lives on process
column ``k % Q``:

1. column by column, the ranks of that process column form the reflector
   ``H_j = I - tau_j v_j v_j^H`` that zeroes column j below the diagonal
   (one allreduce of two numbers down the column: the diagonal entry and the
   squared norm below it) and apply it to the rest of the panel (one
   allreduce of ``v_j^T A``), as LAPACK's geqr2/larfg;
2. they form the panel's triangular factor T, ``H_k0 ... H_k1-1 = I - V T V^H``
   (LAPACK's larft; one allreduce of ``V^H V``);
3. V (their local rows) and T travel along the process rows, and every rank
   updates its columns right of the panel, ``A -= V (T^H (V^H A))``: one
   allreduce of ``V^H A`` down each process column, the rest local BLAS-3.

R overwrites the upper triangle and V (unit diagonal implied) the part below
it, as LAPACK's geqrf stores them; tau and the T factors are kept, the same
on every rank. ``apply_q`` multiplies any DistMatrix with A's row blocking by
Q or Q^H panel by panel in the same way. Real and complex dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcmac.linalg import layout
from hpcmac.linalg.checks import float_dtype, require, same_grid
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.kernels import gemm_update


@dataclass
class QRFactors:
    """``qr``: R and V in A's layout; ``tau`` (min(m, n),) and ``ts`` (one (w, w) T per
    panel) are global: the same on every grid rank."""

    qr: DistMatrix
    tau: np.ndarray
    ts: list[np.ndarray]


def qr_factor(a: DistMatrix, overwrite_a: bool = False) -> QRFactors:
    """Collective over the grid: Householder QR of an (m, n) ``a``, any m, n, mb, nb."""
    grid = a.grid
    if not grid.in_grid:
        return QRFactors(a, np.zeros(0), [])
    dtype = float_dtype(a.dtype)
    x = a if (overwrite_a and a.dtype == dtype and a.local.flags.f_contiguous) \
        else a.astype(dtype)
    m, n = x.gshape
    kmax = min(m, n)
    tau = np.zeros(kmax, dtype=dtype)
    ts = []
    for k0 in range(0, kmax, x.nb):
        k1 = min(kmax, k0 + x.nb)
        v, t, taus = _share_panel(x, k0, k1, factor=True)
        tau[k0:k1] = taus
        ts.append(t)
        r0 = layout.first_local_at_or_after(k0, x.mb, grid.myrow, grid.nprow)
        c1 = layout.first_local_at_or_after(k1, x.nb, grid.mycol, grid.npcol)
        _apply_block(x.local[r0:, c1:], v, t.conj().T, grid)     # Q_k^H A
    return QRFactors(x, tau, ts)


def apply_q(f: QRFactors, b: DistMatrix, trans: bool = True) -> DistMatrix:
    """Collective over the grid: ``Q^H b`` (``trans``) or ``Q b`` as a new DistMatrix.

    ``b`` is global (m, k) on the factor's grid; it is moved to A's row
    blocking (``f.qr.mb``) when its own differs, and the result keeps that
    layout.
    """
    x = f.qr
    grid = x.grid
    if not grid.in_grid:
        return b
    same_grid("apply_q", x, b)
    require(b.gshape[0] == x.gshape[0],
            f"apply_q: b has {b.gshape[0]} rows, Q is {x.gshape[0]} x {x.gshape[0]}")
    dtype = float_dtype(x.dtype, b.dtype)
    out = b.redistribute(grid, x.mb, b.nb) if b.mb != x.mb else b.copy()
    if out.dtype != dtype:
        out = out.astype(dtype)
    starts = list(range(0, min(x.gshape), x.nb))
    for i in (range(len(starts)) if trans else range(len(starts) - 1, -1, -1)):
        k0 = starts[i]
        k1 = min(min(x.gshape), k0 + x.nb)
        v, _, _ = _share_panel(x, k0, k1, factor=False)
        t = f.ts[i]
        r0 = layout.first_local_at_or_after(k0, x.mb, grid.myrow, grid.nprow)
        _apply_block(out.local[r0:, :], v, t.conj().T if trans else t, grid)
    return out


def _apply_block(c: np.ndarray, v: np.ndarray, t: np.ndarray, grid) -> None:
    """``c -= v (t (v^H c))`` in place: my rows (from the panel's first row on) of some
    columns; ``v^T c`` is summed down the process column. Collective over ``grid.col``."""
    if v.shape[1] == 0:
        return
    w = np.ascontiguousarray(v.conj().T @ c) if c.size else np.zeros((v.shape[1], c.shape[1]),
                                                                dtype=c.dtype)
    if grid.nprow > 1:
        grid.col.allreduce(w, out=w)
    if c.size:
        gemm_update(c, v, t @ w, alpha=-1.0, beta=1.0)


def _share_panel(x: DistMatrix, k0: int, k1: int, factor: bool):
    """Collective over the grid: (V for my rows from k0 on, T, taus) of panel [k0, k1).

    ``factor``: the panel's process column factors it first (and forms T);
    else V is read from the stored factor. V and the numbers go along the
    process rows from that column.
    """
    grid = x.grid
    P, Q, myrow, mycol = grid.nprow, grid.npcol, grid.myrow, grid.mycol
    w = k1 - k0
    qk = int(layout.owner(k0, x.nb, Q))
    r0 = layout.first_local_at_or_after(k0, x.mb, myrow, P)
    lm = x.lshape[0]
    nv = (lm - r0) * w
    buf = np.zeros(nv + w * w + w, dtype=x.dtype)
    if mycol == qk:
        lc = int(layout.g2l(k0, x.nb, Q))
        panel = x.local[r0:, lc:lc + w]                  # (lm - r0, w) view
        prow = x.rows[r0:]
        if factor:
            taus = _factor_panel(panel, prow, k0, grid)
            v = _unit_lower(panel, prow, k0)
            g = np.ascontiguousarray(v.conj().T @ v)
            if P > 1:
                grid.col.allreduce(g, out=g)
            buf[nv:nv + w * w] = _larft(g, taus).ravel()
            buf[nv + w * w:] = taus
        else:
            v = _unit_lower(panel, prow, k0)
        buf[:nv] = v.ravel(order="F")
    if Q > 1:
        grid.row.bcast(buf, qk)
    v = buf[:nv].reshape((lm - r0, w), order="F")
    return v, buf[nv:nv + w * w].reshape(w, w), buf[nv + w * w:]


def _unit_lower(panel: np.ndarray, prow: np.ndarray, k0: int) -> np.ndarray:
    """V from the stored panel: entries below the diagonal, 1 on it, 0 above (a copy)."""
    j = k0 + np.arange(panel.shape[1])[None, :]
    i = prow[:, None]
    v = np.where(i > j, panel, 0).astype(panel.dtype, order="F")
    v[i[:, 0][:, None] == j] = 1
    return v


def _factor_panel(panel: np.ndarray, prow: np.ndarray, k0: int, grid) -> np.ndarray:
    """Householder QR of the panel in place (R above, v below the diagonal); its taus.
    Collective over ``grid.col`` (the panel's process column)."""
    P = grid.nprow
    w = panel.shape[1]
    cplx = panel.dtype.kind == "c"
    taus = np.zeros(w, dtype=panel.dtype)
    sums = np.zeros(2, dtype=np.complex128 if cplx else np.float64)
    for lj in range(w):
        j = k0 + lj
        s = int(np.searchsorted(prow, j))               # my first row >= j
        mine = s < prow.size and prow[s] == j           # I hold the diagonal entry
        col = panel[s:, lj]
        below = col[1:] if mine else col
        sums[0] = col[0] if mine else 0.0
        sums[1] = np.vdot(below, below).real
        if P > 1:
            grid.col.allreduce(sums, out=sums)
        alpha, sq = sums[0] if cplx else float(sums[0].real), float(sums[1].real)
        if sq == 0.0 and alpha.imag == 0:               # nothing to do: H = I (LAPACK's larfg)
            continue
        beta = -np.copysign(np.sqrt(abs(alpha) ** 2 + sq), alpha.real)
        taus[lj] = (beta - alpha) / beta
        below *= 1.0 / (alpha - beta)
        if mine:
            col[0] = beta
        if lj + 1 < w:                                  # H_j to the rest of the panel
            v = col.copy()
            if mine:
                v[0] = 1.0
            rest = panel[s:, lj + 1:]
            wv = v.conj() @ rest
            if P > 1:
                grid.col.allreduce(wv, out=wv)
            rest -= np.outer(np.conj(taus[lj]) * v, wv)          # H_j^H: as geqr2
    return taus


def _larft(g: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """T with ``H_1 ... H_w = I - V T V^H`` from ``g = V^H V`` (LAPACK's larft, forward)."""
    w = taus.size
    t = np.zeros((w, w), dtype=g.dtype)
    for i in range(w):
        t[i, i] = taus[i]
        if i:
            t[:i, i] = -taus[i] * (t[:i, :i] @ g[:i, i])
    return t
