"""hpcmac.linalg: distributed dense and iterative solvers under scipy's names.

Matrices are :class:`DistMatrix` (2-D block-cyclic over a process grid, as
ScaLAPACK); vectors for the iterative solvers are :class:`BlockVector`
(contiguous pieces, one per rank) or (n, 1) DistMatrix. Every function is
collective over the grid (or the vector's group) unless its docstring says
otherwise. Importing this package does not start MPI.

    from hpcmac.linalg import DistMatrix, lu_factor, lu_solve, solve, cho_factor, cho_solve
    from hpcmac.linalg import solve_triangular, matmul, norm, transpose, cg, gmres
"""

from scipy.linalg import LinAlgError

from hpcmac.linalg.cholesky import cho_factor, cho_solve
from hpcmac.linalg.dense import lu_factor, lu_solve, solve
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.krylov import KrylovResult, cg, gmres, jacobi
from hpcmac.linalg.norms import norm
from hpcmac.linalg.summa import matmul
from hpcmac.linalg.trisolve import solve_triangular
from hpcmac.linalg.vectors import BlockVector


def transpose(a: DistMatrix, conj: bool = False) -> DistMatrix:
    """Collective over the grid: ``a.T`` (``conj``: ``a.conj().T``) on ``a``'s grid,
    blocks ``a.nb`` × ``a.mb``."""
    return a.transpose(conj=conj)


__all__ = [
    "BlockVector", "DistMatrix", "KrylovResult", "LinAlgError", "cg", "cho_factor", "cho_solve",
    "gmres", "jacobi", "lu_factor", "lu_solve", "matmul", "norm", "solve", "solve_triangular",
    "transpose",
]
