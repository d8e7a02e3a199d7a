"""``cg``, ``gmres``, ``bicgstab``, ``minres`` for DistCSR and LinearOperator, as scipy's.

The loops are ``hpcmac.linalg.krylov`` (cg, gmres) and ``hpcmac.linalg.lanczos``
(bicgstab, minres); this module turns the operator, the vectors and ``M``
into what they take:

* ``A``: a DistCSR, a :class:`LinearOperator` (its ``matvec`` maps this
  rank's piece to this rank's piece), or such a function;
* ``b``, ``x0``: a BlockVector split as A's rows, or the whole vector as an
  ndarray on every rank (then x comes back whole on every rank);
* ``M``: None, a name ("jacobi", "block_jacobi", "asm", "amg", built from A
  with their defaults), a preconditioner object from this package, a
  LinearOperator, or a function ``z_local = M(r_local)``.

Results are ``KrylovResult``: ``x, info = cg(...)`` plus ``.iterations``
(the number of times scipy would call ``callback``) and ``.residuals``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hpcmac.linalg import krylov, lanczos
from hpcmac.linalg.sparse.distcsr import DistCSR, agree
from hpcmac.linalg.vectors import BlockVector


class LinearOperator:
    """A distributed operator given by its action on this rank's piece.

    ``shape`` is global; ``matvec(x_local) -> y_local`` (collective, as a
    DistCSR product); ``counts`` is each rank's piece length (default: the
    even split of BlockVector).
    """

    def __init__(self, shape, matvec: Callable, rmatvec: Callable | None = None,
                 dtype=np.float64, counts=None):
        self.shape = (int(shape[0]), int(shape[1]))
        self.matvec, self.rmatvec, self.dtype, self.counts = matvec, rmatvec, np.dtype(dtype), \
            counts

    def __call__(self, x_local):
        return self.matvec(x_local)


def aslinearoperator(A) -> LinearOperator:
    """A DistCSR (or LinearOperator) as a LinearOperator."""
    if isinstance(A, LinearOperator):
        return A
    if isinstance(A, DistCSR):
        return LinearOperator(A.shape, A.matvec, A.rmatvec, A.dtype, A.row_counts)
    raise ValueError(f"A must be a DistCSR or a LinearOperator, got {type(A).__name__}")


_NAMES = ("jacobi", "block_jacobi", "asm", "amg")


def _preconditioner(M, A):
    if M is None or callable(M) and not isinstance(M, LinearOperator):
        return M
    if isinstance(M, LinearOperator):
        return M.matvec
    if isinstance(M, str):
        if M not in _NAMES:
            raise ValueError(f"M={M!r}: expected one of {', '.join(_NAMES)}, a preconditioner "
                             f"or a function")
        if not isinstance(A, DistCSR):
            raise ValueError(f"M={M!r} is built from a DistCSR; with a LinearOperator pass "
                             f"a function z_local = M(r_local)")
        from hpcmac.linalg.sparse import multigrid, precond

        build = {"jacobi": precond.jacobi, "block_jacobi": precond.block_jacobi,
                 "asm": precond.asm, "amg": multigrid.amg}[M]
        return build(A)
    raise ValueError(f"M must be None, a name, a preconditioner or a function, "
                     f"got {type(M).__name__}")


def _vectors(A, b, x0):
    """(matvec, b BlockVector, x0 BlockVector or None, back) for the Krylov loops."""
    if isinstance(A, DistCSR):
        if A.shape[0] != A.shape[1] or A.row_starts != A.col_starts:
            raise ValueError(f"A must be square with rows and columns split alike, got shape "
                             f"{A.shape}")
        matvec, n, counts, group = A.matvec, A.shape[0], A.row_counts, A.group
    elif isinstance(A, LinearOperator) or callable(A):
        matvec = A.matvec if isinstance(A, LinearOperator) else A
        if not isinstance(b, BlockVector):
            raise ValueError("with a LinearOperator or a function, b must be a BlockVector")
        n = A.shape[0] if isinstance(A, LinearOperator) else b.n
        counts = getattr(A, "counts", None) or b.counts
        group = b.group
    else:
        if type(A).__module__.startswith("scipy"):
            raise ValueError("A is a scipy object, which acts on whole vectors: build a "
                             "DistCSR (DistCSR.from_scipy) or a hpcmac LinearOperator")
        raise ValueError(f"A must be a DistCSR, a LinearOperator or a function, "
                         f"got {type(A).__name__}")
    counts = tuple(counts) if counts is not None else BlockVector.zeros(n, group).counts

    def piece(v, name):
        if isinstance(v, BlockVector):
            if v.n != n:
                raise ValueError(f"{name} has length {v.n}, A has shape {(n, n)}")
            if tuple(v.counts) != counts:
                raise ValueError(f"{name} is split {list(v.counts)} but A's rows are split "
                                 f"{list(counts)}: build it with A.vector(...)")
            return v, True
        v = np.asarray(v)
        if v.ndim == 2 and v.shape[1] == 1:
            v = v[:, 0]
        if v.shape != (n,):
            raise ValueError(f"{name} has shape {v.shape}, A has shape {(n, n)}")
        lo = int(sum(counts[: group.rank]))
        return BlockVector(np.ascontiguousarray(v[lo: lo + counts[group.rank]]), n, counts,
                           group), False

    bb, b_block = piece(b, "b")
    bad = bb.local.size and not np.isfinite(bb.local).all()
    agree(group, "b must not contain infs or NaNs" if bad else None)
    xx = piece(x0, "x0")[0] if x0 is not None else None
    back = (lambda v: v) if b_block else (lambda v: v.allgather())  # noqa: E731
    return matvec, bb, xx, back


def _run(loop, A, b, x0, M, **kw):
    matvec, bb, xx, back = _vectors(A, b, x0)
    res = loop(matvec, bb, xx, M=_preconditioner(M, A), **kw)
    return krylov.KrylovResult(back(res.x), res.info, res.iterations, res.residuals)


def cg(A, b, x0=None, *, rtol: float = 1e-5, atol: float = 0.0, maxiter: int | None = None,
       M=None, callback=None) -> krylov.KrylovResult:
    """Collective: conjugate gradients (A symmetric positive definite), as scipy's ``cg``."""
    return _run(krylov.cg, A, b, x0, M, rtol=rtol, atol=atol, maxiter=maxiter,
                callback=callback)


def gmres(A, b, x0=None, *, rtol: float = 1e-5, atol: float = 0.0, restart: int | None = None,
          maxiter: int | None = None, M=None, callback=None) -> krylov.KrylovResult:
    """Collective: restarted GMRES (right preconditioned), as scipy's ``gmres``."""
    return _run(krylov.gmres, A, b, x0, M, rtol=rtol, atol=atol, restart=restart,
                maxiter=maxiter, callback=callback)


def bicgstab(A, b, x0=None, *, rtol: float = 1e-5, atol: float = 0.0,
             maxiter: int | None = None, M=None, callback=None) -> krylov.KrylovResult:
    """Collective: BiCGSTAB, as scipy's ``bicgstab``."""
    return _run(lanczos.bicgstab, A, b, x0, M, rtol=rtol, atol=atol, maxiter=maxiter,
                callback=callback)


def minres(A, b, x0=None, *, rtol: float = 1e-5, shift: float = 0.0,
           maxiter: int | None = None, M=None, callback=None) -> krylov.KrylovResult:
    """Collective: MINRES (A symmetric, M symmetric positive definite), as scipy's ``minres``."""
    return _run(lanczos.minres, A, b, x0, M, rtol=rtol, shift=shift, maxiter=maxiter,
                callback=callback)
