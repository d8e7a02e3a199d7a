"""HPL-MxP's matrix: HPL's random entries, the diagonal made dominant, per block.

The HPL-MxP rules keep the HPL harness and change its generator: the matrix
is non-symmetric and each diagonal entry is the sum of the magnitudes of its
row's off-diagonal entries, so every row is diagonally dominant and LU without
pivoting is stable. Here:

* off the diagonal, entry (i, j) of A and the right-hand side b are netlib
  HPL's (``hpcmac.hpl.matgen``: the same LCG, the same [A | b] layout, b is
  column N), each rank generating only its own blocks;
* ``a[i, i] = diag * sum_{j != i} |a[i, j]|`` with ``diag = 1`` (the rules).
  Any other ``diag`` is not an HPL-MxP matrix: ``diag < 1`` gives up
  dominance, which is how a test makes a matrix that LU without pivoting in
  low precision cannot precondition.

The row sums are the only communication: one allreduce of the local row
sums along the process row.
"""

from __future__ import annotations

import numpy as np

from hpcmac.comm.grid import Grid
from hpcmac.hpl import matgen as hpl_matgen
from hpcmac.linalg.distmatrix import DistMatrix

_CHUNK = 256


def generate(n: int, nb: int, grid: Grid, diag: float = 1.0,
             seed: int = hpl_matgen.SEED) -> tuple[DistMatrix, np.ndarray]:
    """Collective over ``grid.all`` (in-grid ranks): this rank's blocks of A, and b.

    Returns ``(a, b)``: ``a`` the N x N float64 DistMatrix (NB x NB blocks),
    ``b`` (N,) float64, replicated (every grid rank generates all of it: N
    numbers). Ranks outside the grid get an empty piece and an empty b.
    """
    a = DistMatrix.empty((n, n), grid, nb, nb)
    if not grid.in_grid:
        return a, np.zeros(0)
    rows, cols = a.rows, a.cols
    A = a.local
    if A.size:
        A[...] = hpl_matgen.entries(rows, cols, n, seed)
    # sum of |a_ij| over the row, minus the diagonal's own magnitude where it is local
    sums = np.zeros(A.shape[0])
    for c0 in range(0, A.shape[1], _CHUNK):  # bounded temporaries: no |A| copy
        sums += np.abs(A[:, c0:c0 + _CHUNK]).sum(axis=1)
    li, lj = _local_diagonal(rows, cols)
    sums[li] -= np.abs(A[li, lj])
    if grid.npcol > 1 and sums.size:
        grid.row.allreduce(sums, op="sum", out=sums)
    A[li, lj] = diag * sums[li]
    b = hpl_matgen.entries(np.arange(n), np.array([n]), n, seed)[:, 0]
    return a, b


def _local_diagonal(rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Local (row, column) positions of the diagonal entries this rank holds."""
    common, li, lj = np.intersect1d(rows, cols, assume_unique=True, return_indices=True)
    return li, lj
