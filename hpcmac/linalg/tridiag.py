"""Distributed Householder reduction of a symmetric matrix to tridiagonal form (as pdsytd2).

Step k (k = 0 .. n-2) zeroes column k below the subdiagonal with a reflector
``H_k = I - tau v v^H`` (v[k+1] = 1, v[:k+1] = 0) and leaves a real
subdiagonal entry (as LAPACK's sytd2/hetd2; for a real matrix the last step
is the identity):

1. the process column holding column k forms v from its rows (one allreduce
   of two numbers down the column: the subdiagonal entry and the squared
   norm below it, as LAPACK's larfg);
2. v, beta and tau reach every rank (one O(n) allreduce over the grid);
3. every rank multiplies its piece of the trailing matrix by v, and one O(n)
   allreduce gives ``p = tau A v`` everywhere;
4. with ``w = p - (tau / 2)(p^H v) v``, every rank applies the Hermitian
   rank-2 update ``A -= v w^H + w v^H`` to its own rows and columns > k.

The full matrix is stored and updated (both triangles), so the matrix-vector
product needs no transpose. v overwrites column k below the diagonal
(including its leading 1), as LAPACK keeps reflectors; the diagonal of A is
then the tridiagonal's ``d``. Work per rank O(n^3 / (P Q)) in BLAS-2
operations; communication 3 reductions per column.
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg import layout
from hpcmac.linalg.diagonal import diag
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.kernels import gemm_update


def tridiagonalize(x: DistMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Collective over the grid: reduce the symmetric (Hermitian) ``x`` (full storage,
    square blocks ``mb == nb``) in place; returns ``(d, e, tau)``, global (the same on
    every rank); ``d`` and ``e`` are real.

    Afterwards column k of ``x`` holds the reflector v_k in rows k+1.. (k < n-1):
    ``Q = H_0 H_1 ... H_{n-2}`` and ``Q^H A Q = tridiag(e, d, e)``.
    """
    grid = x.grid
    if not grid.in_grid:   # ranks outside the grid take no part
        return np.zeros(0), np.zeros(0), np.zeros(0)
    n = x.gshape[0]
    nb = x.nb
    P, Q, myrow, mycol = grid.nprow, grid.npcol, grid.myrow, grid.mycol
    rows, cols = x.rows, x.cols
    loc = x.local
    cplx = x.dtype.kind == "c"
    tau = np.zeros(max(n - 1, 0), dtype=x.dtype)
    e = np.zeros(max(n - 1, 0), dtype=x.local.real.dtype)
    sums = np.zeros(2, dtype=np.complex128 if cplx else np.float64)
    vec = np.zeros(n + 2, dtype=x.dtype)          # v, then beta and tau
    p = np.zeros(n, dtype=x.dtype)
    for k in range(n - 1):   # the last step only makes a complex A[n-1, n-2] real
        qk = int(layout.owner(k, nb, Q))
        r1 = layout.first_local_at_or_after(k + 1, nb, myrow, P)   # my rows > k
        c1 = layout.first_local_at_or_after(k + 1, nb, mycol, Q)   # my columns > k
        vec[:] = 0
        if mycol == qk:
            lc = int(layout.g2l(k, nb, Q))
            col = loc[r1:, lc]                                      # rows > k of column k
            mine = r1 < rows.size and rows[r1] == k + 1             # I hold the subdiagonal
            below = col[1:] if mine else col
            sums[0] = col[0] if mine else 0.0
            sums[1] = np.vdot(below, below).real
            if P > 1:
                grid.col.allreduce(sums, out=sums)
            alpha, sq = sums[0] if cplx else float(sums[0].real), float(sums[1].real)
            if sq == 0.0 and alpha.imag == 0:   # nothing to zero, already real: H = I (larfg)
                beta, t = alpha.real, 0.0
                below[:] = 0
            else:
                beta = -np.copysign(np.sqrt(abs(alpha) ** 2 + sq), alpha.real)
                t = (beta - alpha) / beta
                below *= 1.0 / (alpha - beta)
            if mine:
                col[0] = 1.0
            vec[rows[r1:]] = col                                    # my rows of v
            if myrow == 0:
                vec[n], vec[n + 1] = beta, t
        if grid.all.size > 1:
            grid.all.allreduce(vec, out=vec)
        v, beta, t = vec[:n], vec[n].real, vec[n + 1]
        e[k], tau[k] = beta, t
        if t == 0.0:
            continue
        # p = tau A v over the trailing matrix: my rows' partial sums, then the grid's
        p[:] = 0
        if loc.size and r1 < rows.size and c1 < cols.size:
            p[rows[r1:]] = loc[r1:, c1:] @ v[cols[c1:]]
        if grid.all.size > 1:
            grid.all.allreduce(p, out=p)
        p *= t
        w = p - (0.5 * t * np.vdot(p, v)) * v                     # zhetd2: x + alpha v
        if r1 < rows.size and c1 < cols.size:
            left = np.empty((rows.size - r1, 2), dtype=x.dtype, order="F")
            left[:, 0], left[:, 1] = v[rows[r1:]], w[rows[r1:]]
            right = np.empty((2, cols.size - c1), dtype=x.dtype, order="F")
            right[0], right[1] = np.conj(w[cols[c1:]]), np.conj(v[cols[c1:]])
            gemm_update(loc[r1:, c1:], left, right, alpha=-1.0, beta=1.0)
    d = diag(x).real
    return d, e, tau
