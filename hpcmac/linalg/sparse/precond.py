"""Preconditioners for DistCSR: Jacobi, block Jacobi (per-rank ILU or LU), additive Schwarz.

Each is an object ``M`` with ``M(r_local) -> z_local`` approximating
``A^-1 r`` on this rank's piece (the form ``M=`` takes). Building one is
collective over A's group; applying ``jacobi`` and ``block_jacobi`` needs no
communication, ``asm`` one ghost exchange each way.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as sla

from hpcmac.linalg.sparse.distcsr import DistCSR, agree


def _square(A: DistCSR, what: str) -> None:
    if A.shape[0] != A.shape[1] or A.row_starts != A.col_starts:
        raise ValueError(f"{what}: A must be square with rows and columns split alike")


class Jacobi:
    """``z = r / diag(A)``."""

    def __init__(self, A: DistCSR):
        _square(A, "jacobi")
        d = A.diagonal().local
        zero = np.flatnonzero(d == 0)
        agree(A.group, f"jacobi: the diagonal of A is zero at row {A.lrange[0] + zero[0]}"
              if zero.size else None)
        self.inv = 1.0 / d

    def __call__(self, r: np.ndarray) -> np.ndarray:
        return self.inv * r


class BlockJacobi:
    """Each rank solves with its diagonal block: ``solver="lu"`` (splu, a direct solve
    of the block: symmetric when A is, so fit for ``cg``) or ``"ilu"`` (scipy's
    spilu, threshold ILU with ``drop_tol``/``fill_factor``: cheaper, but its
    factors are not symmetric, so use it with ``gmres``/``bicgstab``)."""

    def __init__(self, A: DistCSR, solver: str = "lu", drop_tol: float = 1e-4,
                 fill_factor: float = 10.0):
        _square(A, "block_jacobi")
        if solver not in ("ilu", "lu"):
            raise ValueError(f"block_jacobi: solver must be 'ilu' or 'lu', got {solver!r}")
        self.solve = _factor(A.diag, solver, drop_tol, fill_factor, A.group)

    def __call__(self, r: np.ndarray) -> np.ndarray:
        return self.solve(r)


def _factor(block: sp.csr_matrix, solver: str, drop_tol: float, fill_factor: float, group):
    """Collective: a local solve with ``block``; a singular block raises on every rank."""
    msg, f = None, None
    if block.shape[0]:
        try:
            csc = sp.csc_matrix(block)
            f = sla.splu(csc, permc_spec="COLAMD") if solver == "lu" else \
                sla.spilu(csc, drop_tol=drop_tol, fill_factor=fill_factor)
        except RuntimeError as exc:
            msg = f"{solver} of rank {group.rank}'s block failed: {exc}"
    agree(group, msg)
    if f is None:
        return lambda r: np.zeros_like(r)
    return f.solve


class AdditiveSchwarz:
    """One subdomain per rank, grown by ``overlap=1`` layer: its own rows and their ghosts.

    ``z = sum_i R_i^T A_i^-1 R_i r``: the ghost values of r come in through
    A's ghost plan, each rank solves its subdomain (``solver`` as BlockJacobi),
    and the ghost parts of the solution go back and add to their owners.
    ``restrict=True`` drops that return trip (restricted Schwarz, PETSc's
    default; not symmetric, so not for ``cg``/``minres``).
    """

    def __init__(self, A: DistCSR, overlap: int = 1, solver: str = "lu", restrict: bool = False,
                 drop_tol: float = 1e-4, fill_factor: float = 10.0):
        _square(A, "asm")
        if overlap != 1:
            raise ValueError(f"asm: overlap must be 1, got {overlap}")
        self.A, self.restrict = A, restrict
        own = A.local_rows()
        ptr, ind, dat = A.plan.fetch_rows(own.indptr, own.indices, own.data)
        c0, c1 = A.lcols
        nown, ng = c1 - c0, A.ghosts.size

        def to_sub(cols: np.ndarray) -> np.ndarray:
            """Subdomain index of each global column, -1 outside it."""
            out = np.full(cols.size, -1, dtype=np.int64)
            inside = (cols >= c0) & (cols < c1)
            out[inside] = cols[inside] - c0
            pos = np.searchsorted(A.ghosts, cols)
            pos = np.minimum(pos, max(ng - 1, 0))
            hit = ~inside & (ng > 0) & (A.ghosts[pos] == cols) if ng else np.zeros_like(inside)
            out[hit] = nown + pos[hit]
            return out

        ghost_rows = sp.csr_matrix((dat, ind, ptr), shape=(ng, A.shape[1])).tocoo()
        gcols = to_sub(ghost_rows.col)
        keep = gcols >= 0
        top = sp.hstack([A.diag, A.off]).tocoo()
        rows = np.concatenate([top.row, nown + ghost_rows.row[keep]])
        cols = np.concatenate([top.col, gcols[keep]])
        vals = np.concatenate([top.data, ghost_rows.data[keep]])
        sub = sp.csr_matrix((vals, (rows, cols)), shape=(nown + ng, nown + ng))
        self.solve = _factor(sub, solver, drop_tol, fill_factor, A.group)
        self.nown = nown

    def __call__(self, r: np.ndarray) -> np.ndarray:
        A = self.A
        ext = np.empty(self.nown + A.ghosts.size, dtype=np.result_type(r.dtype, A.dtype))
        ext[: self.nown] = r
        reqs = A.plan.start(np.ascontiguousarray(r, dtype=ext.dtype), ext[self.nown:])
        A.plan.finish(reqs)
        z_ext = self.solve(ext)
        z = np.array(z_ext[: self.nown])
        if not self.restrict:
            A.plan.reverse_finish(A.plan.reverse_start(np.ascontiguousarray(z_ext[self.nown:])), z)
        return z


def jacobi(A: DistCSR) -> Jacobi:
    """Collective: the Jacobi preconditioner of A."""
    return Jacobi(A)


def block_jacobi(A: DistCSR, solver: str = "lu", **kw) -> BlockJacobi:
    """Collective: block Jacobi, one block per rank (``solver`` "ilu" or "lu")."""
    return BlockJacobi(A, solver, **kw)


def asm(A: DistCSR, overlap: int = 1, solver: str = "lu", restrict: bool = False,
        **kw) -> AdditiveSchwarz:
    """Collective: additive Schwarz with one subdomain per rank and ``overlap`` 1."""
    return AdditiveSchwarz(A, overlap, solver, restrict, **kw)
