"""Krylov solvers on distributed vectors: conjugate gradients and restarted GMRES.

The operator is a square DistMatrix or a user function
``matvec(x_local) -> y_local`` acting on BlockVector pieces (for stencils and
sparse codes that never form a matrix; the function does its own halo
exchange). Vectors are BlockVectors; dot products are the only
communication the solvers add (CG: one reduction of two numbers per step;
GMRES: classical Gram-Schmidt with one re-orthogonalisation, two reductions
per step). As ``scipy.sparse.linalg``: stop when
``||b - A x|| <= max(rtol * ||b||, atol)``; ``info`` is 0 on success and the
iteration count when ``maxiter`` ran out (no exception).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.vectors import BlockVector

Matvec = Callable[[np.ndarray], np.ndarray]


class KrylovResult(tuple):
    """``(x, info)`` as scipy returns it, plus ``iterations`` and ``residuals``.

    ``residuals[0]`` is the initial residual norm, then one per iteration (for
    GMRES the Arnoldi estimate, replaced by the true residual at each restart).
    """

    def __new__(cls, x, info: int, iterations: int, residuals: list[float]):
        self = super().__new__(cls, (x, info))
        self.x, self.info, self.iterations, self.residuals = x, info, iterations, residuals
        return self


def dense_matvec(a: DistMatrix, template: BlockVector) -> Matvec:
    """``x_local -> (a @ x)_local`` for BlockVectors split like ``template``.

    Collective per call over the grid: the input is gathered whole (n
    numbers), each rank multiplies its block-cyclic piece, and the partial
    rows are summed and cut back into pieces.
    """
    rows, cols = a.rows, a.cols
    grid = a.grid
    m = a.gshape[0]

    def matvec(x_local: np.ndarray) -> np.ndarray:
        x = template.like(x_local).allgather()
        dtype = np.result_type(a.dtype, x.dtype)
        y = np.zeros(m, dtype=dtype)
        if a.local.size:
            y[rows] = a.local @ x[cols]
        y = grid.all.allreduce(y, out=y)
        o = template.offset
        return y[o: o + x_local.size]

    return matvec


def jacobi(diag) -> Matvec:
    """The Jacobi preconditioner ``r -> r / diag(A)``.

    ``diag`` is a DistMatrix (its diagonal is taken; collective over its
    grid), a BlockVector, or this rank's local piece of the diagonal
    (ndarray). Pieces are split as the solver's vectors.
    """
    if isinstance(diag, DistMatrix):
        diag = _diagonal(diag)
    d = diag.local if isinstance(diag, BlockVector) else np.asarray(diag)
    if d.size and np.any(d == 0):
        raise ValueError("jacobi: the diagonal has a zero entry")
    inv = 1.0 / d
    return lambda r: inv * r


def _diagonal(a: DistMatrix) -> BlockVector:
    """Collective over ``a.grid``: the diagonal of ``a`` as a BlockVector over the grid's ranks."""
    n = min(a.gshape)
    d = np.zeros(n, dtype=a.dtype)
    if a.local.size:
        ri, cj = np.nonzero(a.rows[:, None] == a.cols[None, :])
        d[a.rows[ri]] = a.local[ri, cj]
    d = a.grid.all.allreduce(d, out=d)
    return BlockVector.from_global(d, a.grid.all)


def _setup(A, b, x0, M):
    """Normalise operator, vectors and preconditioner; returns what the loops need."""
    back = lambda v: v  # noqa: E731
    if isinstance(b, DistMatrix):
        layout_of_b = b
        b = BlockVector.from_distmatrix(b)

        def back(v):  # noqa: F811
            full = v.allgather()
            return DistMatrix.from_function(lambda i, j: full[i], layout_of_b.gshape,
                                            layout_of_b.grid, layout_of_b.mb, layout_of_b.nb,
                                            full.dtype)
    elif isinstance(b, np.ndarray):
        if not isinstance(A, DistMatrix):
            raise ValueError("with a matvec function, b must be a BlockVector (each rank's piece)")
        if b.ndim == 2 and b.shape[1] == 1:
            b = b[:, 0]
        b = BlockVector.from_global(b, A.grid.all)
        back = lambda v: v.allgather()  # noqa: E731
    elif not isinstance(b, BlockVector):
        raise ValueError(f"b must be a BlockVector, an (n, 1) DistMatrix or an ndarray, "
                         f"got {type(b).__name__}")
    if isinstance(A, DistMatrix):
        if A.gshape[0] != A.gshape[1] or A.gshape[0] != b.n:
            raise ValueError(f"operator of shape {A.gshape} does not match b of length {b.n}")
        matvec = dense_matvec(A, b)
    elif callable(A):
        matvec = A
    else:
        raise ValueError(f"A must be a DistMatrix or a matvec function, got {type(A).__name__}")
    if M is None:
        prec = lambda r: r  # noqa: E731
    elif isinstance(M, str):
        if M != "jacobi" or not isinstance(A, DistMatrix):
            raise ValueError(f"M={M!r}: 'jacobi' names the built-in preconditioner for a "
                             f"DistMatrix; for a matvec pass M=jacobi(diagonal)")
        prec = jacobi(A)
    elif callable(M):
        prec = M
    else:
        raise ValueError(f"M must be None, 'jacobi' or a function, got {type(M).__name__}")
    if x0 is None:
        x = np.zeros(b.local.size, dtype=np.result_type(b.dtype, np.float64))
    else:
        if isinstance(x0, DistMatrix):
            x0 = BlockVector.from_distmatrix(x0)
        elif isinstance(x0, np.ndarray):
            x0 = b.like(np.asarray(x0).reshape(-1)[b.offset: b.offset + b.local.size])
        if x0.n != b.n:
            raise ValueError(f"x0 has length {x0.n}, b has {b.n}")
        x = np.array(x0.local, dtype=np.result_type(b.dtype, x0.dtype, np.float64))
    return b, matvec, prec, x, back


def _axpy(a, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a * x`` in place (BLAS axpy when the dtypes allow, else numpy)."""
    if x.dtype == y.dtype and x.dtype.kind in "fc" and y.flags.c_contiguous and \
            x.flags.c_contiguous and (np.isrealobj(a) or y.dtype.kind == "c"):
        from scipy.linalg.blas import get_blas_funcs

        get_blas_funcs("axpy", (y,))(x, y, a=a)
    else:
        y += a * x


def _sums(group, *values) -> np.ndarray:
    """Collective: the elementwise sums of a few local numbers, in one reduction."""
    return group.allreduce(np.array(values))


def cg(A, b, x0=None, *, rtol: float = 1e-5, atol: float = 0.0, maxiter: int | None = None,
       M=None, callback=None) -> KrylovResult:
    """Collective: preconditioned conjugate gradients for Hermitian positive definite A.

    Parameters
    ----------
    A : DistMatrix or callable
        The operator: a square DistMatrix or ``matvec(x_local) -> y_local``.
    b : BlockVector, (n, 1) DistMatrix, or ndarray
        Right-hand side; x comes back of the same kind (an ndarray b is the
        whole vector on every rank, and so is x; only with a DistMatrix A).
    x0 : same kind as b, optional
        Starting guess (zeros).
    rtol, atol, maxiter : as scipy (``maxiter`` defaults to 10 n).
    M : None, "jacobi" or callable
        Preconditioner ``z_local = M(r_local)`` approximating ``A^-1 r``.
    callback : callable, optional
        ``callback(x_local)`` after every iteration.

    Returns
    -------
    KrylovResult
        ``x, info = cg(...)``; also ``.iterations`` and ``.residuals``.
    """
    if isinstance(A, DistMatrix) and not A.grid.in_grid:
        return KrylovResult(None, 0, 0, [])
    b, matvec, prec, x, back = _setup(A, b, x0, M)
    group = b.group
    maxiter = 10 * b.n if maxiter is None else int(maxiter)
    bnorm = b.norm()
    tol = max(rtol * bnorm, atol)
    r = b.local - matvec(x) if x0 is not None else b.local.astype(x.dtype, copy=True)
    z = prec(r)
    rr, rz = _sums(group, np.vdot(r, r).real, np.vdot(r, z))
    history = [float(np.sqrt(rr.real))]
    if bnorm == 0.0:
        return KrylovResult(back(b.like(np.zeros_like(x))), 0, 0, history)
    p = z.copy()
    it = 0
    while history[-1] > tol and it < maxiter:
        q = matvec(p)
        pq = _sums(group, np.vdot(p, q))[0]
        if pq == 0:
            break  # breakdown: A is not definite along p
        alpha = rz / pq
        _axpy(alpha, p, x)                   # in place: no temporaries of length n
        _axpy(-alpha, q, r)
        z = prec(r)
        rr, rz_new = _sums(group, np.vdot(r, r).real, np.vdot(r, z))
        it += 1
        history.append(float(np.sqrt(rr.real)))
        if callback is not None:
            callback(x)
        beta = rz_new / rz
        rz = rz_new
        p *= beta
        p += z
    info = 0 if history[-1] <= tol else max(it, 1)
    return KrylovResult(back(b.like(x)), info, it, history)


def gmres(A, b, x0=None, *, rtol: float = 1e-5, atol: float = 0.0, restart: int | None = None,
          maxiter: int | None = None, M=None, callback=None) -> KrylovResult:
    """Collective: restarted GMRES(``restart``) with right preconditioning, for any square A.

    Arguments as ``cg``; ``restart`` (default None: 20, as scipy) is the
    number of inner steps per cycle. ``maxiter`` counts restart cycles, as in scipy
    (default 10 n); ``iterations`` counts inner steps. The residual tested is
    the true one, ``||b - A x||`` (right preconditioning does not change it).
    """
    if isinstance(A, DistMatrix) and not A.grid.in_grid:
        return KrylovResult(None, 0, 0, [])
    b, matvec, prec, x, back = _setup(A, b, x0, M)
    group = b.group
    maxiter = 10 * b.n if maxiter is None else int(maxiter)
    restart = max(1, min(20 if restart is None else int(restart), b.n))
    bnorm = b.norm()
    tol = max(rtol * bnorm, atol)
    r = b.local - matvec(x) if x0 is not None else b.local.astype(x.dtype, copy=True)
    beta = float(np.sqrt(_sums(group, np.vdot(r, r).real)[0]))
    history = [beta]
    if bnorm == 0.0:
        return KrylovResult(back(b.like(np.zeros_like(x))), 0, 0, history)
    dtype = np.result_type(x.dtype, r.dtype)
    total = cycles = 0
    while beta > tol and cycles < maxiter:
        cycles += 1
        nloc = r.size
        V = np.zeros((restart + 1, nloc), dtype=dtype)   # Krylov basis, rows are vectors
        Z = np.zeros((restart, nloc), dtype=dtype)       # preconditioned basis
        H = np.zeros((restart + 1, restart), dtype=dtype)
        g = np.zeros(restart + 1, dtype=dtype)
        cs = np.zeros(restart)
        sn = np.zeros(restart, dtype=dtype)
        V[0] = r / beta
        g[0] = beta
        k = 0
        for j in range(restart):
            Z[j] = prec(V[j])
            w = np.asarray(matvec(Z[j]), dtype=dtype)
            h = np.zeros(j + 1, dtype=dtype)
            for _ in range(2):  # classical Gram-Schmidt, twice
                hj = group.allreduce(V[: j + 1].conj() @ w)
                w = w - hj @ V[: j + 1]
                h += hj
            hn = float(np.sqrt(_sums(group, np.vdot(w, w).real)[0]))
            col = np.concatenate([h, [hn]])
            for i in range(j):  # earlier rotations
                a_, b_ = col[i], col[i + 1]
                col[i] = cs[i] * a_ + sn[i] * b_
                col[i + 1] = -np.conj(sn[i]) * a_ + cs[i] * b_
            a_, b_ = col[j], col[j + 1]
            d = np.hypot(abs(a_), abs(b_))
            if d == 0:
                cs[j], sn[j] = 1.0, 0.0
            elif a_ == 0:
                cs[j], sn[j] = 0.0, 1.0
            else:
                cs[j] = abs(a_) / d
                sn[j] = (a_ / abs(a_)) * np.conj(b_) / d
            col[j] = cs[j] * a_ + sn[j] * b_
            col[j + 1] = 0
            H[: j + 2, j] = col
            g[j + 1] = -np.conj(sn[j]) * g[j]
            g[j] = cs[j] * g[j]
            k = j + 1
            total += 1
            history.append(float(abs(g[j + 1])))
            if hn != 0:
                V[j + 1] = w / hn
            if abs(g[j + 1]) <= tol or hn == 0:
                break
        y = _upper_solve(H[:k, :k], g[:k])
        x = x + y @ Z[:k]
        r = b.local - matvec(x)
        beta = float(np.sqrt(_sums(group, np.vdot(r, r).real)[0]))
        history[-1] = beta
        if callback is not None:
            callback(x)
    info = 0 if beta <= tol else cycles
    return KrylovResult(back(b.like(x)), info, total, history)


def _upper_solve(R: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Back substitution with a small upper triangle (replicated on every rank)."""
    k = R.shape[0]
    y = np.zeros(k, dtype=np.result_type(R.dtype, g.dtype))
    for i in range(k - 1, -1, -1):
        s = g[i] - R[i, i + 1:] @ y[i + 1:]
        y[i] = s / R[i, i] if R[i, i] != 0 else 0
    return y
