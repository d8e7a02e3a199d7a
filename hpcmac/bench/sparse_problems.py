"""The benchmark's matrices, row by row: 2-D 5-point and 3-D 7-point Poisson. Pure numpy.

Imported by ``hpcmac.bench.sparse`` and, by file path, by the PETSc worker
(``sparse_petsc.py``, which runs under another Python), so both sides build
exactly the same rows. Nothing from hpcmac is imported here.
"""

from __future__ import annotations

import numpy as np


def poisson_rows(dim: int, n: int, lo: int, hi: int):
    """CSR arrays (indptr, indices, data) of rows ``[lo, hi)`` of the ``dim``-D Poisson matrix
    on an n^dim grid (Dirichlet boundary, unscaled: 2*dim on the diagonal, -1 off it)."""
    r = np.arange(lo, hi, dtype=np.int64)
    coords = []
    rest = r.copy()
    for _ in range(dim):              # x fastest
        coords.append(rest % n)
        rest //= n
    offsets, masks = [], []
    for axis in reversed(range(dim)):  # ascending column order: -n^(d-1) ... -1
        offsets.append(-(n ** axis))
        masks.append(coords[axis] > 0)
    offsets.append(0)
    masks.append(np.ones(r.size, dtype=bool))
    for axis in range(dim):
        offsets.append(n ** axis)
        masks.append(coords[axis] < n - 1)
    cols = r[:, None] + np.array(offsets, dtype=np.int64)[None, :]
    mask = np.stack(masks, axis=1)
    vals = np.where(np.array(offsets)[None, :] == 0, 2.0 * dim, -1.0) * np.ones((r.size, 1))
    indptr = np.zeros(r.size + 1, dtype=np.int64)
    np.cumsum(mask.sum(axis=1), out=indptr[1:])
    return indptr, cols[mask], vals[mask]


def nrows(dim: int, n: int) -> int:
    return n ** dim


def even_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """PETSc's PETSC_DECIDE split (and BlockVector's): the first n % size ranks one longer."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
