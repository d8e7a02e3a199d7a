"""hpcmac.linalg: distributed dense and iterative solvers under scipy's names.

Matrices are :class:`DistMatrix` (2-D block-cyclic over a process grid, as
ScaLAPACK); vectors for the iterative solvers are :class:`BlockVector`
(contiguous pieces, one per rank) or (n, 1) DistMatrix. Every function is
collective over the grid (or the vector's group) unless its docstring says
otherwise. Importing this package does not start MPI.

    from hpcmac.linalg import Grid, DistMatrix, lu_factor, lu_solve, solve, inv, det, slogdet
    from hpcmac.linalg import cholesky, cho_factor, cho_solve, solve_triangular, lstsq, eigh
    from hpcmac.linalg import matmul, norm, diag, trace, transpose, cg, gmres, bicgstab, minres

Sparse matrices (DistCSR) and their solvers and preconditioners live in
``hpcmac.linalg.sparse``.

No submodule is named like a function (``hpcmac.linalg.cholesky`` is the
function; the Cholesky code lives in ``chol.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from numpy.linalg import LinAlgError  # scipy.linalg.LinAlgError is this class

from hpcmac.comm.grid import Grid

# name -> submodule: imported on first use, so that `import hpcmac.linalg.lu` (HPL) does not
# pay for scipy.linalg and every solver at start-up (PEP 562)
_LAZY = {
    "cho_factor": "chol", "cho_solve": "chol", "cholesky": "chol",
    "lu_factor": "dense", "lu_solve": "dense", "solve": "dense",
    "diag": "diagonal", "trace": "diagonal",
    "DistMatrix": "distmatrix",
    "det": "inverse", "inv": "inverse", "slogdet": "inverse",
    "KrylovResult": "krylov", "cg": "krylov", "gmres": "krylov", "jacobi": "krylov",
    "bicgstab": "lanczos", "minres": "lanczos",
    "lstsq": "leastsq", "norm": "norms", "matmul": "summa", "eigh": "symeig",
    "solve_triangular": "trisolve", "BlockVector": "vectors",
}

if TYPE_CHECKING:
    from hpcmac.linalg.distmatrix import DistMatrix


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcmac.linalg' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpcmac.linalg.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def transpose(a: DistMatrix, conj: bool = False) -> DistMatrix:
    """Collective over the grid: ``a.T`` (``conj``: ``a.conj().T``) on ``a``'s grid,
    blocks ``a.nb`` × ``a.mb``."""
    return a.transpose(conj=conj)


__all__ = [
    "BlockVector", "DistMatrix", "Grid", "KrylovResult", "LinAlgError", "bicgstab", "cg",
    "cho_factor", "cho_solve", "cholesky", "det", "diag", "eigh", "gmres", "inv", "jacobi",
    "lstsq", "lu_factor", "lu_solve", "matmul", "minres", "norm", "slogdet", "solve",
    "solve_triangular", "trace", "transpose",
]
