"""scipy-named LU solvers (the HPL LU underneath) vs scipy.linalg on the gathered data."""

import numpy as np
import pytest
import scipy.linalg as sl
from linalg_util import dist, each_grid, grid_at, rand, same_error_everywhere

from hpcmac.linalg import LinAlgError, lu_factor, lu_solve, solve
from hpcmac.testing import parallel_allclose, parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


@pytest.mark.parametrize("n,mb,nb", [(13, 4, 4), (20, 3, 5), (7, 16, 16)])
def test_lu_factor_matches_scipy(n, mb, nb):
    rng = np.random.default_rng(10)
    for _g, grid in each_grid():
        a = rand(rng, (n, n), np.float64)
        lu, piv = lu_factor(dist(a, grid, mb, nb))
        full = lu.allgather()
        if grid.in_grid:
            ref_lu, ref_piv = sl.lu_factor(a)
            parallel_assert(np.array_equal(piv, ref_piv), f"piv {piv} vs {ref_piv}", grid.all)
            parallel_allclose(full, ref_lu, rtol=1e-10, atol=1e-10, group=grid.all)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lu_solve_and_solve(dtype):
    rng = np.random.default_rng(11)
    tol = 1e-4 if dtype == np.float32 else 1e-9
    for _g, grid in each_grid():
        n = 18
        a = rand(rng, (n, n), dtype)
        b = rand(rng, (n, 3), dtype)
        fac = lu_factor(dist(a, grid, 4, 4))
        ref = sl.lu_factor(a)
        for trans in (0, 1, 2):
            x = lu_solve(fac, dist(b, grid, 3, 2), trans=trans)
            full = x.allgather()
            if grid.in_grid:
                parallel_assert((x.mb, x.nb, x.dtype) == (3, 2, np.dtype(dtype)), "layout",
                                grid.all)
                parallel_allclose(full, sl.lu_solve(ref, b, trans=trans), rtol=tol, atol=tol,
                                  msg=f"trans {trans}", group=grid.all)
        # solve with b whole on every rank, 1-D and 2-D, and transposed
        for rhs in (b[:, 0], b):
            for transposed in (False, True):
                x = solve(dist(a, grid, 5, 3), rhs, transposed=transposed)
                if grid.in_grid:
                    parallel_allclose(x, sl.solve(a, rhs, transposed=transposed), rtol=tol,
                                      atol=tol, group=grid.all)


def test_complex_solve_through_the_real_form():
    rng = np.random.default_rng(12)
    for _g, grid in each_grid():
        n = 14
        a = rand(rng, (n, n), np.complex128)
        b = rand(rng, (n, 2), np.complex128)
        for transposed in (False, True):
            x = solve(dist(a, grid, 3, 5), dist(b, grid, 4, 1), transposed=transposed)
            full = x.allgather()
            if grid.in_grid:
                parallel_assert((x.mb, x.nb, x.dtype) == (4, 1, np.complex128), "layout",
                                grid.all)
                ref = sl.solve(a.T if transposed else a, b)   # scipy has no complex transposed
                parallel_allclose(full, ref, rtol=1e-9, atol=1e-10, group=grid.all)
        x = solve(dist(a.real.copy(), grid, 4, 4), b[:, 0])   # real matrix, complex rhs
        if grid.in_grid:
            parallel_allclose(x, sl.solve(a.real, b[:, 0]), rtol=1e-9, atol=1e-10,
                              group=grid.all)


def test_complex_singular_names_the_complex_index():
    grid = grid_at(0)
    if not grid.in_grid:
        return
    rng = np.random.default_rng(13)
    sing = rand(rng, (8, 8), np.complex128)
    sing[:, 5] = 0
    msg = same_error_everywhere(grid.all, lambda: solve(dist(sing, grid, 2, 2), np.ones(8)),
                                LinAlgError)
    assert "global index 5" in msg, msg


@pytest.mark.parametrize("shape_index", [0, 1])
def test_singular_and_bad_input_raise_everywhere(shape_index):
    grid = grid_at(shape_index)
    if not grid.in_grid:
        return
    a = np.arange(36, dtype=np.float64).reshape(6, 6) % 5 + np.eye(6)
    a[:, 4] = a[:, 1]  # column 4 repeats column 1: U[4, 4] becomes exactly zero
    msg = same_error_everywhere(grid.all, lambda: lu_factor(dist(a, grid, 2, 2)), LinAlgError)
    assert "global index" in msg, msg
    same_error_everywhere(grid.all, lambda: solve(dist(np.zeros((4, 4)), grid, 2, 2),
                                                  np.ones(4)), LinAlgError)
    msg = same_error_everywhere(grid.all, lambda: solve(dist(np.eye(4), grid, 2, 2),
                                                        np.ones(5)), ValueError)
    assert "incompatible" in msg
    bad = np.eye(4)
    bad[2, 1] = np.inf
    msg = same_error_everywhere(grid.all, lambda: solve(dist(bad, grid, 2, 2), np.ones(4)),
                                ValueError)
    assert "infs or NaNs" in msg
    msg = same_error_everywhere(
        grid.all, lambda: lu_factor(dist(np.eye(3, dtype=complex), grid, 2, 2)), ValueError)
    assert "complex" in msg
