"""hpcmac.linalg: distributed dense and iterative solvers under scipy's names.

Matrices are :class:`DistMatrix` (2-D block-cyclic over a process grid, as
ScaLAPACK); vectors for the iterative solvers are :class:`BlockVector`
(contiguous pieces, one per rank) or (n, 1) DistMatrix. Every function is
collective over the grid (or the vector's group) unless its docstring says
otherwise. Importing this package does not start MPI.

    from hpcmac.linalg import Grid, DistMatrix, lu_factor, lu_solve, solve, inv, det, slogdet
    from hpcmac.linalg import cholesky, cho_factor, cho_solve, solve_triangular, lstsq, eigh
    from hpcmac.linalg import matmul, norm, diag, trace, transpose, cg, gmres

No submodule is named like a function (``hpcmac.linalg.cholesky`` is the
function; the Cholesky code lives in ``chol.py``).
"""

from scipy.linalg import LinAlgError

from hpcmac.comm.grid import Grid
from hpcmac.linalg.chol import cho_factor, cho_solve, cholesky
from hpcmac.linalg.dense import lu_factor, lu_solve, solve
from hpcmac.linalg.diagonal import diag, trace
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.inverse import det, inv, slogdet
from hpcmac.linalg.krylov import KrylovResult, cg, gmres, jacobi
from hpcmac.linalg.leastsq import lstsq
from hpcmac.linalg.norms import norm
from hpcmac.linalg.summa import matmul
from hpcmac.linalg.symeig import eigh
from hpcmac.linalg.trisolve import solve_triangular
from hpcmac.linalg.vectors import BlockVector


def transpose(a: DistMatrix, conj: bool = False) -> DistMatrix:
    """Collective over the grid: ``a.T`` (``conj``: ``a.conj().T``) on ``a``'s grid,
    blocks ``a.nb`` × ``a.mb``."""
    return a.transpose(conj=conj)


__all__ = [
    "BlockVector", "DistMatrix", "Grid", "KrylovResult", "LinAlgError", "cg", "cho_factor",
    "cho_solve", "cholesky", "det", "diag", "eigh", "gmres", "inv", "jacobi", "lstsq", "lu_factor",
    "lu_solve", "matmul", "norm", "slogdet", "solve", "solve_triangular", "trace", "transpose",
]
