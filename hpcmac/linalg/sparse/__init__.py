"""hpcmac.linalg.sparse: distributed sparse matrices and solvers under scipy.sparse's names.

    from hpcmac.linalg.sparse import DistCSR, cg, gmres, bicgstab, minres
    A = DistCSR.from_scipy(a, world)            # a: scipy.sparse matrix on rank 0
    x, info = cg(A, b, rtol=1e-8, M="amg")      # b: BlockVector in A's layout, or the whole vector

Matrices: :class:`DistCSR` (rows in contiguous blocks, PETSc's MPIAIJ).
Solvers: ``cg``, ``gmres``, ``bicgstab``, ``minres``; preconditioners
``jacobi``, ``block_jacobi``, ``asm``, ``amg`` (smoothed aggregation). Every
function is collective over the matrix's group.
"""

from __future__ import annotations

from hpcmac.linalg.sparse import build as _build
from hpcmac.linalg.sparse import files as _files
from hpcmac.linalg.sparse.build import assemble, assemble_vector
from hpcmac.linalg.sparse.distcsr import DistCSR, Transposed
from hpcmac.linalg.sparse.multigrid import SmoothedAggregation, amg
from hpcmac.linalg.sparse.precond import (
           AdditiveSchwarz,
           BlockJacobi,
           Jacobi,
           asm,
           block_jacobi,
           jacobi,
)
from hpcmac.linalg.sparse.solvers import (
           LinearOperator,
           aslinearoperator,
           bicgstab,
           cg,
           gmres,
           minres,
)

# constructors as classmethods, so the type carries its ways in (as scipy's)
DistCSR.from_scipy = staticmethod(_build.from_scipy)
DistCSR.from_rows = staticmethod(_build.from_rows)
DistCSR.from_coo = staticmethod(_build.from_coo)
DistCSR.mmread = staticmethod(_files.mmread)
DistCSR.read_hdf5 = staticmethod(_files.read_hdf5)
DistCSR.write_hdf5 = _files.write_hdf5

from_scipy, from_rows, from_coo = _build.from_scipy, _build.from_rows, _build.from_coo
mmread, read_hdf5, write_hdf5 = _files.mmread, _files.read_hdf5, _files.write_hdf5

__all__ = ["AdditiveSchwarz", "BlockJacobi", "DistCSR", "Jacobi", "LinearOperator",
           "SmoothedAggregation", "Transposed", "amg", "aslinearoperator", "asm", "assemble",
           "assemble_vector",
           "bicgstab", "block_jacobi", "cg", "from_coo", "from_rows", "from_scipy", "gmres",
           "jacobi", "minres", "mmread", "read_hdf5", "write_hdf5"]
