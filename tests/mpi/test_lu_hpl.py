"""hpl_solve against numpy's solve on every grid that fits, every variant of every phase."""

import numpy as np
import pytest

from hpcmac.comm.grid import Grid
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.lu import LUOptions, hpl_solve
from hpcmac.testing import parallel_allclose, parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

FACTS = ("left", "crout", "right")
BCASTS = ("1ring", "1ringM", "2ring", "2ringM", "long", "longM")
SWAPS = ("binexch", "spread", "mix")


def grids(size):
    return [(p, q) for p in range(1, size + 1) for q in range(1, size + 1) if p * q <= size]


def combos():
    """Every value of every option at least twice, every PFACT x RFACT pair once."""
    out = []
    for i in range(9):
        out.append(LUOptions(
            pfact=FACTS[i % 3], rfact=FACTS[i // 3], nbmin=1 + i % 3, ndiv=2 + i % 2,
            bcast=BCASTS[i % 6], depth=i % 2, swap=SWAPS[(i + i // 3) % 3],
            swap_threshold=(0, 4, 64)[i % 3], l1_transposed=bool(i % 2),
            u_transposed=bool((i // 2) % 2), equil=bool((i // 4) % 2), align=(1, 8, 4)[i % 3]))
    for i, b in enumerate(BCASTS):
        out.append(LUOptions(bcast=b, depth=(i + 1) % 2, swap=SWAPS[i % 3]))
    return out


def system(n, grid, seed):
    rng = np.random.default_rng(seed)
    ab = rng.standard_normal((n, n + 1))
    return ab


@pytest.mark.parametrize("n,nb", [(37, 8), (5, 8), (24, 4)])
def test_solution_equals_numpy(n, nb):
    g = world()
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        ab = system(n, grid, n + 7 * p + q)
        ref = np.linalg.solve(ab[:, :n], ab[:, n])
        for opts in combos():
            a = DistMatrix.from_global(ab if g.rank == 0 else None, grid, nb, nb)
            x = hpl_solve(a, opts)
            if grid.in_grid:
                parallel_allclose(x, ref, rtol=1e-9, atol=1e-9,
                                  msg=f"{p}x{q} n={n} nb={nb} {opts}", group=grid.all)
            else:
                assert x is None


def test_progress_and_after_panel_hooks():
    g = world()
    n, nb = 21, 4
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        ab = system(n, grid, 1)
        a = DistMatrix.from_global(ab if g.rank == 0 else None, grid, nb, nb)
        seen, done = [], []
        hpl_solve(a, LUOptions(depth=1), progress=lambda c, t, d=done: d.append((c, t)),
                  after_panel=lambda j, m, s=seen: s.append(j))
        if grid.in_grid:
            parallel_assert(seen == list(range(0, n, nb)), f"after_panel saw {seen}", grid.all)
            parallel_assert(done[-1] == (n, n) and len(done) == len(seen), f"{done}", grid.all)


def test_corrupting_the_matrix_mid_run_changes_the_answer():
    g = world()
    n, nb = 30, 4
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        ab = system(n, grid, 2)
        ref = np.linalg.solve(ab[:, :n], ab[:, n])
        a = DistMatrix.from_global(ab if g.rank == 0 else None, grid, nb, nb)

        def flip(j, m):
            if j == 8 and m.local.size:  # every rank with data corrupts its last entry
                m.local[-1, -2] += 1.0

        x = hpl_solve(a, LUOptions(), after_panel=flip)
        if grid.in_grid:
            parallel_assert(not np.allclose(x, ref), "corruption went unnoticed", grid.all)


@pytest.mark.parametrize("depth", [0, 1])
def test_singular_raises_on_every_rank(depth):
    g = world()
    n, nb = 19, 4
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        ab = system(n, grid, 3)
        ab[:, 9] = 0.0
        a = DistMatrix.from_global(ab if g.rank == 0 else None, grid, nb, nb)
        msg = ""
        try:
            hpl_solve(a, LUOptions(depth=depth))
        except np.linalg.LinAlgError as exc:
            msg = str(exc)
        if grid.in_grid:
            parallel_assert("global index 9" in msg, f"got {msg!r}", grid.all)


def test_bad_input_is_a_value_error():
    g = world()
    grid = Grid(g, 1, 1)
    if grid.in_grid:
        a = DistMatrix.zeros((4, 4), grid, 2, 2)
        with pytest.raises(ValueError, match="N x \\(N\\+1\\)"):
            hpl_solve(a)
        with pytest.raises(ValueError, match="square blocks"):
            hpl_solve(DistMatrix.zeros((4, 5), grid, 2, 3))
    g.barrier()
