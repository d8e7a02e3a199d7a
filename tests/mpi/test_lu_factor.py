"""lu_factor_dist / lu_solve_dist against scipy.linalg on the gathered data, every grid."""

import numpy as np
import pytest
import scipy.linalg as sl

from hpcmac.comm.grid import Grid
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.lu import LUOptions, lu_factor_dist, lu_solve_dist
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

OPTS = [LUOptions(), LUOptions(pfact="left", rfact="right", depth=0, swap="binexch", bcast="2ring"),
        LUOptions(pfact="crout", rfact="left", swap="spread", bcast="long", u_transposed=False)]


def grids(size):
    return [(p, q) for p in range(1, size + 1) for q in range(1, size + 1) if p * q <= size]


@pytest.mark.parametrize("m,n,nb", [(29, 29, 6), (7, 7, 8), (32, 32, 8), (26, 17, 4), (13, 30, 4)])
def test_factor_matches_scipy(m, n, nb):
    g = world()
    rng = np.random.default_rng(m * n)
    a0 = rng.standard_normal((m, n))
    lu0, piv0 = sl.lu_factor(a0)
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        for opts in OPTS:
            a = DistMatrix.from_global(a0 if g.rank == 0 else None, grid, nb, nb)
            lu, piv = lu_factor_dist(a, opts)
            full = lu.allgather()
            if grid.in_grid:
                ok = np.allclose(full, lu0, rtol=1e-10, atol=1e-10) and np.array_equal(piv, piv0)
                parallel_assert(ok, f"{p}x{q} {m}x{n} nb={nb} {opts}", grid.all)


@pytest.mark.parametrize("trans", [0, 1])
@pytest.mark.parametrize("n,nb,nrhs,bnb", [(23, 4, 3, 5), (6, 8, 1, 2), (40, 8, 4, 8)])
def test_solve_matches_scipy(n, nb, nrhs, bnb, trans):
    g = world()
    rng = np.random.default_rng(n + nrhs)
    a0 = rng.standard_normal((n, n))
    b0 = rng.standard_normal((n, nrhs))
    ref = sl.lu_solve(sl.lu_factor(a0), b0, trans=trans)
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        a = DistMatrix.from_global(a0 if g.rank == 0 else None, grid, nb, nb)
        b = DistMatrix.from_global(b0 if g.rank == 0 else None, grid, bnb, bnb)
        x = lu_solve_dist(lu_factor_dist(a), b, trans=trans)
        got = x.allgather()
        if grid.in_grid:
            close = np.allclose(got, ref, rtol=1e-9, atol=1e-9)
            ok = x.gshape == (n, nrhs) and x.mb == bnb and close
            parallel_assert(ok, f"{p}x{q} n={n} trans={trans}", grid.all)


def test_singular_names_the_pivot_on_every_rank():
    g = world()
    n, nb = 14, 3
    a0 = np.random.default_rng(0).standard_normal((n, n))
    a0[:, 4] = 0.0
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        a = DistMatrix.from_global(a0 if g.rank == 0 else None, grid, nb, nb)
        msg = ""
        try:
            lu_factor_dist(a)
        except np.linalg.LinAlgError as exc:
            msg = str(exc)
        if grid.in_grid:
            parallel_assert("global index 4" in msg, f"got {msg!r}", grid.all)


NOPIV = [LUOptions(pivoting=False), LUOptions(pivoting=False, pfact="crout", rfact="left",
                                              depth=0, swap="binexch", bcast="long")]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 2e-4)])
@pytest.mark.parametrize("n,nb", [(29, 6), (40, 8)])
def test_no_pivoting_matches_scipy_on_a_dominant_matrix(dtype, tol, n, nb):
    # column-diagonally dominant: scipy's partial pivoting keeps every row in place,
    # so its LU is the LU without pivoting
    g = world()
    rng = np.random.default_rng(n)
    a0 = rng.uniform(-0.5, 0.5, (n, n)) + n * np.eye(n)
    lu0, piv0 = sl.lu_factor(a0)
    assert np.array_equal(piv0, np.arange(n))
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        for opts in NOPIV:
            a = DistMatrix.from_global(a0.astype(dtype) if g.rank == 0 else None, grid, nb, nb)
            lu, piv = lu_factor_dist(a, opts)
            full = lu.allgather()
            if grid.in_grid:
                ok = (full.dtype == dtype and np.allclose(full, lu0, rtol=tol, atol=tol)
                      and np.array_equal(piv, np.arange(n)))
                parallel_assert(ok, f"{p}x{q} n={n} {dtype.__name__} {opts}", grid.all)


def test_no_pivoting_keeps_rows_where_partial_pivoting_would_swap():
    # a small first pivot: partial pivoting swaps, no pivoting must not (Doolittle's LU)
    g = world()
    n, nb = 12, 4
    rng = np.random.default_rng(3)
    a0 = rng.standard_normal((n, n)) + 4 * np.eye(n)
    a0[0, 0] = 0.25
    ref = a0.copy()
    for k in range(n):  # unblocked Doolittle without pivoting
        ref[k + 1:, k] /= ref[k, k]
        ref[k + 1:, k + 1:] -= np.outer(ref[k + 1:, k], ref[k, k + 1:])
    assert not np.array_equal(sl.lu_factor(a0)[1], np.arange(n))
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        a = DistMatrix.from_global(a0 if g.rank == 0 else None, grid, nb, nb)
        lu, piv = lu_factor_dist(a, LUOptions(pivoting=False))
        full = lu.allgather()
        if grid.in_grid:
            ok = np.allclose(full, ref, rtol=1e-9, atol=1e-9) and np.array_equal(piv, np.arange(n))
            parallel_assert(ok, f"{p}x{q}", grid.all)
