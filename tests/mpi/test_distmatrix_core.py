"""DistMatrix scatter/gather/from_function against the global array, every grid that fits."""

import numpy as np
import pytest

from hpcmac.comm.grid import Grid
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def grids(size):
    return [(p, q) for p in range(1, size + 1) for q in range(1, size + 1) if p * q <= size]


@pytest.mark.parametrize("m,n,mb,nb", [(7, 5, 2, 3), (16, 16, 4, 4), (3, 9, 5, 2), (0, 4, 2, 2)])
def test_scatter_gather_roundtrip(m, n, mb, nb):
    g = world()
    for p, q in grids(g.size):
        for order in ("row", "col"):
            grid = Grid(g, p, q, order)
            a = np.arange(m * n, dtype=np.float64).reshape(m, n) if g.rank == 0 else None
            d = DistMatrix.from_global(a, grid, mb, nb)
            f = DistMatrix.from_function(lambda i, j: i * n + j, (m, n), grid, mb, nb)
            same = (not grid.in_grid) or np.array_equal(d.local, f.local)
            parallel_assert(same, f"scatter != from_function on {p}x{q} {order}", g)
            back = d.gather()
            ok = back is None or np.array_equal(back, np.arange(m * n).reshape(m, n))
            parallel_assert(ok, f"gather mismatch on {p}x{q} {order}", g)
