"""Distributed LU with partial pivoting: netlib HPL 2.3's right-looking algorithm.

One implementation, two callers: the HPL benchmark (:func:`hpl_solve` on
``[A | b]``) and the scipy-style solvers (:func:`lu_factor_dist`,
:func:`lu_solve_dist`). Each phase lives in its own module:

* :mod:`~hpcmac.linalg.panel` recursive panel factorisation (PFACT, RFACT, NBMIN, NDIV)
* :mod:`~hpcmac.linalg.pivot` pivot search down the process column
* :mod:`~hpcmac.linalg.broadcast` panel broadcast along the process row (BCAST)
* :mod:`~hpcmac.linalg.swap` row interchanges and U down the process column (SWAP)
* :mod:`~hpcmac.linalg.update` U = L1^-1 U, trailing A -= L U
* :mod:`~hpcmac.linalg.triangular` the final distributed triangular solves

Look-ahead (``depth=1``): the process column that owns the next panel first
updates only that panel's columns, factors it and starts broadcasting it, then
updates the rest of its columns; every other process updates its columns in
chunks, advancing the in-flight broadcast between chunks. ``depth=0`` does
update, then factor, then broadcast.

Without pivoting (``LUOptions(pivoting=False)``, HPL-MxP's LU of a diagonally
dominant matrix) the same phases run with the diagonal as every pivot
(:class:`~hpcmac.linalg.pivot.NoPivot`): no pivot search, and the swap phase
only carries U down the process column.

Supported: float64, float32 (the precision of the matrix; BLAS by address in
that precision), square blocks (``mb == nb``), any M, N, any P x Q grid. The
trailing update ``C -= L U`` may be handed to another kernel (``gemm=``: HPL-MxP's
MLX update in float16 or bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpcmac.linalg import _blas as blas
from hpcmac.linalg import layout
from hpcmac.linalg.broadcast import VARIANTS as BCASTS
from hpcmac.linalg.broadcast import RowBcast
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.panel import VARIANTS as FACTS
from hpcmac.linalg.panel import PanelFactor
from hpcmac.linalg.pivot import ColumnPivot, LocalPivot, NoPivot
from hpcmac.linalg.swap import VARIANTS as SWAPS
from hpcmac.linalg.swap import swap_column
from hpcmac.linalg.triangular import block_trsv
from hpcmac.linalg.update import gemm_update, solve_u

__all__ = ["LUOptions", "hpl_solve", "lu_factor_dist", "lu_solve_dist"]

#: ``gemm(c, l, u, poll)``: ``c -= l @ u`` in place on local arrays (c: (m, n) view of the
#: local piece, l: (m, jb), u: (jb, n)), calling ``poll()`` now and then until it returns True
Gemm = Callable[[np.ndarray, np.ndarray, np.ndarray, Callable[[], bool] | None], None]


@dataclass(frozen=True)
class LUOptions:
    """The algorithm's knobs, named as in netlib HPL's HPL.dat (all global)."""

    pfact: str = "right"          # panel factorisation of the NBMIN-wide leaves: left|crout|right
    nbmin: int = 4                # recursion stops at this many columns (>= 1)
    ndiv: int = 2                 # panels split into this many pieces per level (>= 2)
    rfact: str = "crout"          # recursive panel factorisation: left|crout|right
    bcast: str = "1ringM"         # 1ring|1ringM|2ring|2ringM|long|longM
    depth: int = 1                # look-ahead depth: 0 or 1
    swap: str = "mix"             # binexch|spread|mix
    swap_threshold: int = 64      # mix: binary exchange up to this many local columns
    l1_transposed: bool = True    # L1 kept transposed in the panel buffer
    u_transposed: bool = True     # U kept transposed in its buffer (P > 1)
    equil: bool = True            # spread-roll: spread U rows evenly before rolling
    align: int = 8                # buffers aligned to this many doubles (>= 1)
    pivoting: bool = True         # False: no row interchanges (HPL-MxP, diagonally dominant A)

    def __post_init__(self) -> None:
        def bad(field: str, expected: str) -> None:
            got = getattr(self, field)
            raise ValueError(f"LUOptions.{field}: expected {expected}, got {got!r}")

        choices = (("pfact", FACTS), ("rfact", FACTS), ("bcast", BCASTS), ("swap", SWAPS))
        for field, allowed in choices:
            if getattr(self, field) not in allowed:
                bad(field, "one of " + ", ".join(allowed))
        for field, lo in (("nbmin", 1), ("ndiv", 2), ("swap_threshold", 0), ("align", 1)):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                bad(field, f"an integer >= {lo}")
        if isinstance(self.depth, bool) or self.depth not in (0, 1):
            bad("depth", "0 or 1")
        for field in ("l1_transposed", "u_transposed", "equil", "pivoting"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                bad(field, "True or False")


def _aligned(nwords: int, align: int, dtype=np.float64) -> np.ndarray:
    """1-D buffer whose first element is aligned to ``align`` doubles (8 * align bytes)."""
    isz = np.dtype(dtype).itemsize
    raw = np.empty(nwords + 8 * align // isz, dtype=dtype)
    off = ((-blas.addr(raw)) % (8 * align)) // isz
    return raw[off:off + nwords]


class _Panel:
    """One factored (or arriving) panel, as every process of its process row sees it.

    ``w`` (M x jb) is L below the diagonal block; ``l1`` holds L1 (or L1^T);
    ``buf`` is the broadcast message ``[W | L1 | ipiv | zero]``.
    """

    def __init__(self, j, jb, m, w, wptr, ld, buf, l1):
        self.j, self.jb, self.m = j, jb, m
        self.w, self.wptr, self.ld = w, wptr, ld
        self.buf, self.l1 = buf, l1
        self.l1ptr = blas.addr(l1)
        self.ipiv = np.zeros(jb, dtype=np.int64)
        self.zero = -1
        self.bc: RowBcast | None = None
        self.received = False  # True once ipiv/zero must be read from buf

    def poll(self) -> bool:
        """Advance the broadcast; True once this rank's part of it is done."""
        return self.bc is None or self.bc.test()

    def complete(self) -> None:
        if self.bc is not None:
            self.bc.wait()
            self.bc = None
        if self.received:
            o = self.m * self.jb + self.jb * self.jb
            self.ipiv = self.buf[o:o + self.jb].astype(np.int64)
            self.zero = int(self.buf[o + self.jb])
            self.received = False


class _LU:
    """State of one factorisation of the first ``kmax`` columns of ``a`` (local)."""

    def __init__(self, a: DistMatrix, opts: LUOptions, kmax: int, swap_left: bool,
                 gemm: Gemm | None = None):
        self.a, self.opts, self.kmax, self.swap_left = a, opts, kmax, swap_left
        self.b = blas.for_dtype(a.dtype)
        self.gemm = gemm
        g = self.g = a.grid
        self.nb = a.nb
        self.P, self.Q, self.myrow, self.mycol = g.nprow, g.npcol, g.myrow, g.mycol
        A = self.A = a.local
        self.lm, self.ln = A.shape
        self.lda = max(1, self.lm)
        self.base = blas.addr(A)
        self.grows = a.rows
        self.piv = np.zeros(kmax, dtype=np.int64)
        self.zero = -1
        self.count = 0

    def _at(self, i: int, j: int) -> int:
        return self.base + self.b.itemsize * (i + j * self.lda)

    def _geom(self, j: int):
        nb = self.nb
        jb = min(nb, self.kmax - j)
        prow, pcol = int(layout.owner(j, nb, self.P)), int(layout.owner(j, nb, self.Q))
        ii = layout.first_local_at_or_after(j, nb, self.myrow, self.P)
        jj = layout.first_local_at_or_after(j, nb, self.mycol, self.Q)
        top = self.myrow == prow
        m = jb + self.lm - ii - (jb if top else 0)
        return jb, prow, pcol, ii, jj, top, m

    def _buffer(self, m: int, jb: int) -> np.ndarray:
        return _aligned(m * jb + jb * jb + jb + 1, self.opts.align, self.A.dtype)

    # -- panel: factor or receive, and broadcast ---------------------------------------
    def _factor(self, j: int) -> _Panel:
        """Collective over the process column that owns global column ``j``."""
        o = self.opts
        jb, prow, pcol, ii, jj, top, m = self._geom(j)
        A, P, Q = self.A, self.P, self.Q
        buf = None
        if P == 1:
            w, wptr, ld = A[ii:, jj:jj + jb], self._at(ii, jj), self.lda
            piv = (LocalPivot(w, wptr, ld, jb, self.grows[ii:]) if o.pivoting
                   else NoPivot(w, j))
        else:
            buf = self._buffer(m, jb)
            w = buf[:m * jb].reshape((m, jb), order="F")
            wptr, ld = blas.addr(buf), m
            below = ii + (jb if top else 0)
            w[jb:] = A[below:, jj:jj + jb]
            t = np.empty(jb * jb, dtype=A.dtype)
            t2 = t.reshape((jb, jb), order="F")
            if top:
                t2[...] = A[ii:ii + jb, jj:jj + jb]
            self.g.col.bcast(t, prow)
            w[:jb] = t2
            glob = np.concatenate([np.arange(j, j + jb, dtype=np.int64), self.grows[below:]])
            piv = (ColumnPivot(w, wptr, ld, jb, glob, j, top, self.g.col) if o.pivoting
                   else NoPivot(w, j))
        f = PanelFactor(w, wptr, ld, jb, j, piv, o.pfact, o.rfact, o.nbmin, o.ndiv)
        f.run()
        if P > 1:
            A[ii:, jj:jj + jb] = w[0 if top else jb:]
        elif Q > 1:
            buf = self._buffer(m, jb)
            buf[:m * jb].reshape((m, jb), order="F")[...] = w
        if buf is None:
            l1 = np.empty((jb, jb), order="F", dtype=A.dtype)
        else:
            l1 = buf[m * jb:m * jb + jb * jb].reshape((jb, jb), order="F")
            buf[m * jb + jb * jb:m * jb + jb * jb + jb] = f.ipiv
            buf[-1] = f.zero
        l1[...] = w[:jb, :jb].T if o.l1_transposed else w[:jb, :jb]
        pan = _Panel(j, jb, m, w, wptr, ld, buf, l1)
        pan.ipiv, pan.zero = f.ipiv, f.zero
        return pan

    def _expect(self, j: int) -> _Panel:
        jb, prow, pcol, ii, jj, top, m = self._geom(j)
        buf = self._buffer(m, jb)
        w = buf[:m * jb].reshape((m, jb), order="F")
        l1 = buf[m * jb:m * jb + jb * jb].reshape((jb, jb), order="F")
        pan = _Panel(j, jb, m, w, blas.addr(buf), m, buf, l1)
        pan.received = True
        return pan

    def _start(self, j: int) -> _Panel:
        """Factor (panel's process column) or expect (others) panel ``j``; start its broadcast."""
        pcol = int(layout.owner(j, self.nb, self.Q))
        pan = self._factor(j) if self.mycol == pcol else self._expect(j)
        if self.Q > 1:
            tag = 1000 + self.count % 2
            pan.bc = RowBcast(self.g.row, pcol, pan.buf, self.opts.bcast, tag).start()
        self.count += 1
        return pan

    # -- updates --------------------------------------------------------------------------
    def _update(self, pan: _Panel, c0: int, c1: int, poll: Callable | None = None) -> None:
        """Swap, U = L1^-1 U, A -= L U on local columns c0:c1 (collective over the column)."""
        nc = c1 - c0
        if nc <= 0:
            if poll is not None:
                poll()
            return
        o = self.opts
        jb, prow, pcol, ii, jj, top, m = self._geom(pan.j)
        if self.P == 1:
            if o.pivoting:
                rel = (pan.ipiv - pan.j + 1).astype(np.int32)
                self.b.laswp(nc, self._at(ii, c0), self.lda, 1, jb, rel)
            U = None
            uptr, ldu, ut = self._at(ii, c0), self.lda, False
        else:
            U = swap_column(self.A, self.g, self.nb, pan.j, jb, pan.ipiv, c0, c1, o.swap,
                            o.swap_threshold, o.equil, write_u=False)
            if o.u_transposed:
                uptr, ldu, ut = blas.addr(U), nc, True
            else:
                U = np.asfortranarray(U)
                uptr, ldu, ut = blas.addr(U), jb, False
        solve_u(pan.l1ptr, o.l1_transposed, jb, uptr, ldu, nc, ut, self.b)
        if U is not None and top:
            self.A[ii:ii + jb, c0:c1] = U
        ib = ii + (jb if top else 0)
        if self.gemm is not None:
            self.gemm(self.A[ib:, c0:c1], pan.w[jb:], self.A[ii:ii + jb, c0:c1] if U is None
                      else U, poll)
            return
        gemm_update(self.lm - ib, nc, jb, pan.wptr + self.b.itemsize * jb, pan.ld, uptr, ldu,
                    ut, self._at(ib, c0), self.lda, chunk=max(self.nb, 128), poll=poll, b=self.b)

    def _swap_left(self, pan: _Panel) -> None:
        """Apply the panel's interchanges to the columns left of it (lu_factor's L)."""
        jb, prow, pcol, ii, jj, top, m = self._geom(pan.j)
        if (jj <= 0 and self.P == 1) or not self.opts.pivoting:
            return
        if self.P == 1:
            rel = (pan.ipiv - pan.j + 1).astype(np.int32)
            self.b.laswp(jj, self._at(ii, 0), self.lda, 1, jb, rel)
        else:
            o = self.opts
            swap_column(self.A, self.g, self.nb, pan.j, jb, pan.ipiv, 0, jj, o.swap,
                        o.swap_threshold, o.equil, write_u=True)

    # -- the loop -------------------------------------------------------------------------
    def run(self, progress=None, after_panel=None) -> None:
        nb, kmax = self.nb, self.kmax
        starts = list(range(0, kmax, nb))
        if not starts:
            return
        cur = self._start(0)
        for idx, j in enumerate(starts):
            pan = cur
            pan.complete()
            self.piv[j:j + pan.jb] = pan.ipiv
            if pan.zero >= 0 and self.zero < 0:
                self.zero = pan.zero
            if after_panel is not None:
                after_panel(j, self.a)
            jt = layout.first_local_at_or_after(j + pan.jb, nb, self.mycol, self.Q)
            nxt = starts[idx + 1] if idx + 1 < len(starts) else None
            if nxt is not None and self.opts.depth >= 1:
                if self.mycol == int(layout.owner(nxt, nb, self.Q)):
                    jb2 = min(nb, kmax - nxt)
                    self._update(pan, jt, jt + jb2)
                    cur = self._start(nxt)
                    self._update(pan, jt + jb2, self.ln, cur.poll)
                else:
                    cur = self._start(nxt)
                    self._update(pan, jt, self.ln, cur.poll)
            else:
                self._update(pan, jt, self.ln)
                if nxt is not None:
                    cur = self._start(nxt)
            if self.swap_left:
                self._swap_left(pan)
            if progress is not None:
                progress(min(j + pan.jb, kmax), kmax)


def _check(a: DistMatrix, who: str) -> None:
    if not isinstance(a, DistMatrix):
        raise TypeError(f"{who}: expected a DistMatrix, got {type(a).__name__}")
    if a.mb != a.nb:
        raise ValueError(f"{who}: needs square blocks (mb == nb), got {a.mb}x{a.nb}")
    if a.dtype not in (np.float64, np.float32):
        raise ValueError(f"{who}: needs float64 or float32, got {a.dtype}")
    if a.dtype == np.float32 and max(a.gshape) > 2**24:  # pivot rows travel in the panel
        raise ValueError(f"{who}: float32 holds row numbers up to 2**24, got {a.gshape}")
    if a.grid.in_grid and not a.local.flags.f_contiguous:
        raise ValueError(f"{who}: the local piece must be Fortran-contiguous")


def _singular(z: int) -> np.linalg.LinAlgError:
    return np.linalg.LinAlgError(
        f"singular matrix: U[{z}, {z}] is exactly zero (zero pivot at global index {z})")


def hpl_solve(a: DistMatrix, opts: LUOptions | None = None,
              progress: Callable[[int, int], None] | None = None,
              after_panel: Callable[[int, DistMatrix], None] | None = None) -> np.ndarray | None:
    """Solve A x = b with ``a`` = [A | b] (N x N+1, square blocks), as netlib HPL does.

    Collective over the grid. ``a`` is overwritten (L applied to b during the
    factorisation, then U x = y). Returns ``x`` (N,) float64, the same on every
    grid rank; ranks outside the grid return None. ``progress(cols_done, n)``
    and ``after_panel(j, a)`` run on every grid rank after each panel. Raises
    ``numpy.linalg.LinAlgError`` on every rank for an exactly singular A.
    """
    opts = LUOptions() if opts is None else opts
    _check(a, "hpl_solve")
    g = a.grid
    if not g.in_grid:
        return None
    n = a.gshape[0]
    if a.gshape[1] != n + 1:
        raise ValueError(f"hpl_solve: expected an N x (N+1) matrix [A | b], got {a.gshape}")
    lu = _LU(a, opts, n, swap_left=False)
    lu.run(progress, after_panel)
    if lu.zero >= 0:
        raise _singular(lu.zero)
    # y = L^-1 P b sits in column n: replicate it
    y = np.zeros((n, 1))
    if g.mycol == int(layout.owner(n, a.nb, g.npcol)):
        lc = int(layout.g2l(n, a.nb, g.npcol))
        y[a.rows, 0] = a.local[:, lc]
    if g.nprow * g.npcol > 1:
        g.all.allreduce(y, "sum", out=y)
    return block_trsv(a, y, n, lower=False, unit=False, trans=False)[:, 0]


def lu_factor_dist(a: DistMatrix, opts: LUOptions | None = None,
                   progress: Callable[[int, int], None] | None = None,
                   gemm: Gemm | None = None) -> tuple[DistMatrix, np.ndarray | None]:
    """LU with partial pivoting of an M x N DistMatrix (square blocks), in place.

    Collective over the grid. Returns ``(a, piv)`` as scipy's ``lu_factor``:
    ``a`` holds L (unit, below the diagonal) and U; ``piv`` (min(M, N),) int64
    global 0-based pivot rows, the same on every grid rank (None outside the
    grid). Raises ``LinAlgError`` on every rank when a pivot is exactly zero.
    With ``opts.pivoting`` False no rows move (``piv[k] == k``). ``a`` may be
    float32 (the factorisation then runs in float32). ``progress(cols_done, n)``
    runs on every grid rank after each panel; ``gemm`` (local) replaces the
    trailing update's BLAS call (see :data:`Gemm`).
    """
    opts = LUOptions() if opts is None else opts
    _check(a, "lu_factor_dist")
    if not a.grid.in_grid:
        return a, None
    m, n = a.gshape
    lu = _LU(a, opts, min(m, n), swap_left=True, gemm=gemm)
    lu.run(progress)
    if lu.zero >= 0:
        raise _singular(lu.zero)
    return a, lu.piv


def lu_solve_dist(lu_and_piv: tuple[DistMatrix, np.ndarray], b: DistMatrix,
                  trans: int = 0) -> DistMatrix:
    """Solve A x = b (``trans=0``) or A^T x = b (1 or 2) from :func:`lu_factor_dist`.

    ``b`` is an N x NRHS DistMatrix on the same grid (any block size); the
    result has ``b``'s layout. Collective over the grid; the right-hand sides
    are replicated on every grid rank during the solve (N x NRHS each).
    """
    lu, piv = lu_and_piv
    _check(lu, "lu_solve_dist")
    if not lu.grid.in_grid:
        return DistMatrix.empty(b.gshape, b.grid, b.mb, b.nb)
    n = lu.gshape[0]
    if lu.gshape[1] != n:
        raise ValueError(f"lu_solve_dist: the factor must be square, got {lu.gshape}")
    if b.gshape[0] != n:
        raise ValueError(f"lu_solve_dist: b has {b.gshape[0]} rows, the factor {n}")
    if b.grid is not lu.grid:
        raise ValueError("lu_solve_dist: b must live on the factor's grid")
    if trans not in (0, 1, 2):
        raise ValueError(f"lu_solve_dist: trans must be 0, 1 or 2, got {trans!r}")
    x = np.array(b.allgather(), dtype=np.float64)
    order = range(n) if trans == 0 else range(n - 1, -1, -1)
    if trans == 0:
        _permute(x, piv, order)
        block_trsv(lu, x, n, lower=True, unit=True, trans=False)
        block_trsv(lu, x, n, lower=False, unit=False, trans=False)
    else:
        block_trsv(lu, x, n, lower=False, unit=False, trans=True)
        block_trsv(lu, x, n, lower=True, unit=True, trans=True)
        _permute(x, piv, order)
    return DistMatrix.from_function(lambda i, j: x[i, j], b.gshape, b.grid, b.mb, b.nb)


def _permute(x: np.ndarray, piv: np.ndarray, order) -> None:
    for i in order:
        p = int(piv[i])
        if p != i:
            x[[i, p]] = x[[p, i]]
