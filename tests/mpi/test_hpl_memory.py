"""HPL runs under a memory limit of 1.3x its local piece of [A | b]: no step copies the matrix.

Each rank caps its own address space (RLIMIT_AS, as ``ulimit -v`` / ``prlimit --as``)
at what it uses after start-up (a small HPL run first, so BLAS and MPI
have their buffers) plus 1.3x its piece of [A | b], shows that a second
copy of the piece is then refused, and runs one full HPL (generate, factor, solve,
check), which must PASS inside the cap. Linux only (macOS does not enforce RLIMIT_AS).
"""

import resource
import sys

import numpy as np
import pytest

from hpcmac import comm
from hpcmac.comm.grid import Grid
from hpcmac.hpl import config, driver
from hpcmac.linalg import layout
from hpcmac.linalg.lu import LUOptions, hpl_solve
from hpcmac.testing import parallel_assert

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's"),
]

# each rank's piece ~32 MB: 0.3x of it (~10 MB) must hold the LU's panels and buffers
# (O(N * NB): ~4 MB measured at 2x2) and what MPI and the allocator add; N grows with the
# ranks (the piece stays the same), a few seconds at np 1, 2 and 4
PIECE_N, NB = 2000, 64


def _vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _grid_shape(size: int) -> tuple[int, int]:
    p = int(size**0.5)
    while size % p:
        p -= 1
    return p, size // p


def test_hpl_passes_with_address_space_capped_at_1_3x_the_matrix():
    world = comm.init("mpi")
    p, q = _grid_shape(world.size)
    grid = Grid(world, p, q)
    N = int(PIECE_N * (p * q) ** 0.5)
    lm = layout.numroc(N, NB, grid.myrow, p)
    ln = layout.numroc(N + 1, NB, grid.mycol, q)
    piece = lm * ln * 8
    opts = dict(pfact="right", nbmin=4, ndiv=2, rfact="crout", bcast="1ringM", depth=1,
                swap="mix", swap_threshold=64, l1_transposed=True, u_transposed=True,
                equil=True, align=8)
    variant = config.Variant(0, 1, 1, 1, 2, 2, 4)
    options = LUOptions(**opts)
    # start-up includes BLAS's own buffers (allocated at its first call) and MPI's
    driver.run_one(grid, 4 * NB, NB, variant, options, 16.0, hpl_solve)
    world.barrier()

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + int(1.3 * piece)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        first = np.ones(piece // 8)  # the matrix fits ...
        try:
            second = np.ones(piece // 8)  # ... a copy of it does not
            copy_refused = False
            del second
        except MemoryError:
            copy_refused = True
        del first
        res = driver.run_one(grid, N, NB, variant, options, 16.0, hpl_solve)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    parallel_assert(copy_refused, f"a second {piece / 2**20:.1f} MiB piece fitted under the "
                    f"cap: the test would not catch a copy", world)
    parallel_assert(res.passed and res.residual < 16.0,
                    f"{p}x{q} N={N}: residual {res.residual}", world)
