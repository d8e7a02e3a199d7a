"""HPL under a memory limit of 1.3x its local piece of [A | b] (run by test_hpl_memory_cap.py
in a fresh MPI job, so that no earlier test has left the allocator holding freed memory).

Each rank caps its own address space (RLIMIT_AS, as ``ulimit -v`` / ``prlimit --as``)
at what it uses after start-up (a small HPL run first, so BLAS and MPI
have their buffers) plus 1.3x its piece of [A | b], shows that a second
copy of the piece is then refused, and runs one full HPL (generate, factor, solve,
check), which must PASS inside the cap. Linux only (macOS does not enforce RLIMIT_AS).
"""

import ctypes
import resource
import sys

import numpy as np

from hpcmac import comm
from hpcmac.comm.grid import Grid
from hpcmac.hpl import config, driver
from hpcmac.linalg import layout
from hpcmac.linalg.lu import LUOptions, hpl_solve
from hpcmac.testing import parallel_assert

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


def _exact_accounting() -> None:
    """Large allocations straight from mmap and back to the OS when freed (glibc), so the
    address space measured is what is in use: glibc's dynamic mmap threshold would serve
    later arrays from the heap, whose freed holes stay mapped (counted in VmSize) and could
    take a copy without growing it. One malloc arena, too: a thread's own arena (HPL's
    per-phase memory sampler has one) reserves 64 MiB counted in VmSize, and glibc falls
    back to it when the main arena's mmap is refused, so a copy would fit there."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, fixed at glibc's initial value
        libc.mallopt(-8, 1)  # M_ARENA_MAX
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to adjust
        pass


if sys.platform.startswith("linux"):
    _exact_accounting()


def _grid_shape(size: int) -> tuple[int, int]:
    p = int(size**0.5)
    while size % p:
        p -= 1
    return p, size // p


def main() -> None:
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
    _exact_accounting()
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


if __name__ == "__main__":
    main()
    print("capped HPL PASSED", flush=True)
