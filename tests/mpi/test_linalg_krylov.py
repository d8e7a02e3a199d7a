"""CG and GMRES on DistMatrix operators and user matvecs, against scipy's dense solution."""

import numpy as np
import pytest
import scipy.linalg as sl
from linalg_util import dist, each_grid, rand, spd

from hpcmac.linalg import BlockVector, DistMatrix, cg, gmres, jacobi
from hpcmac.testing import parallel_allclose, parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def scaled_spd(rng, n, dtype):
    """SPD with a wide diagonal spread, so Jacobi has something to fix."""
    d = np.linspace(1.0, 200.0, n)
    return (spd(rng, n, dtype) + np.diag(d)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_cg_on_distmatrix(dtype):
    rng = np.random.default_rng(20)
    n = 37
    for _g, grid in each_grid(limit=3):
        a = scaled_spd(rng, n, dtype)
        b = rand(rng, (n,), dtype)
        d = dist(a, grid, 4, 3)
        plain = cg(d, b, rtol=1e-10)
        pre = cg(d, b, rtol=1e-10, M="jacobi")
        if not grid.in_grid:
            continue
        ref = sl.solve(a, b)
        for res in (plain, pre):
            x, info = res
            parallel_assert(info == 0, f"info {info}", grid.all)
            parallel_allclose(x, ref, rtol=1e-7, atol=1e-8, group=grid.all)
            parallel_assert(len(res.residuals) == res.iterations + 1, "history", grid.all)
            parallel_assert(res.residuals[-1] <= 1e-10 * np.linalg.norm(b) * 1.0001, "res",
                            grid.all)
        parallel_assert(pre.iterations < plain.iterations,
                        f"jacobi {pre.iterations} !< {plain.iterations}", grid.all)


def test_cg_not_converging_returns_info():
    rng = np.random.default_rng(21)
    for _g, grid in each_grid(limit=1):
        a = scaled_spd(rng, 30, np.float64)
        res = cg(dist(a, grid, 4, 4), np.ones(30), rtol=1e-14, maxiter=3)
        if grid.in_grid:
            parallel_assert(res.info == 3 and res.iterations == 3 and len(res.residuals) == 4,
                            f"info {res.info}", grid.all)
        # an (n, 1) DistMatrix b gives an (n, 1) DistMatrix x in b's layout
        bd = DistMatrix.from_function(lambda i, j: 1.0 + i, (30, 1), grid, 7, 1)
        x, info = cg(dist(a, grid, 4, 4), bd, rtol=1e-10)
        full = x.allgather()
        if grid.in_grid:
            parallel_assert(info == 0 and (x.mb, x.nb) == (7, 1), "layout", grid.all)
            parallel_allclose(full[:, 0], sl.solve(a, 1.0 + np.arange(30)), rtol=1e-7,
                              group=grid.all)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("restart", [5, 50])
def test_gmres_nonsymmetric(dtype, restart):
    rng = np.random.default_rng(22)
    n = 33
    for _g, grid in each_grid(limit=2):
        a = (rand(rng, (n, n), dtype) + 10 * np.eye(n)).astype(dtype)
        b = rand(rng, (n,), dtype)
        for M in (None, "jacobi"):
            res = gmres(dist(a, grid, 3, 5), b, rtol=1e-10, restart=restart, M=M)
            if grid.in_grid:
                parallel_assert(res.info == 0, f"info {res.info}", grid.all)
                parallel_allclose(res.x, sl.solve(a, b), rtol=1e-7, atol=1e-8, group=grid.all)
                r = np.linalg.norm(b - a @ res.x)
                parallel_assert(r <= 1e-10 * np.linalg.norm(b) * 1.01, f"true res {r}", grid.all)
    res = gmres(dist(a, grid, 3, 5), b, rtol=1e-14, restart=2, maxiter=2)
    if grid.in_grid:
        parallel_assert(res.info == 2 and res.iterations == 4, f"{res.info}", grid.all)


def laplace_1d(n, group):
    """A matvec on BlockVector pieces with a one-entry halo exchange (point to point)."""
    counts = BlockVector.zeros(n, group).counts
    r, p = group.rank, group.size

    def matvec(xl):
        left, right = np.zeros(1), np.zeros(1)
        reqs = []
        if r > 0 and counts[r - 1] and xl.size:
            reqs += [group.isend(np.ascontiguousarray(xl[:1]), r - 1, 5),
                     group.irecv(left, r - 1, 6)]
        if r < p - 1 and counts[r + 1] and xl.size:
            reqs += [group.isend(np.ascontiguousarray(xl[-1:]), r + 1, 6),
                     group.irecv(right, r + 1, 5)]
        for q in reqs:
            q.wait()
        ext = np.concatenate([left, xl, right])
        return 2 * ext[1:-1] - ext[:-2] - ext[2:]

    return matvec


def test_cg_and_gmres_with_user_matvec():
    g = world()
    n = 64
    b = BlockVector.from_function(lambda i: np.sin(0.3 * i) + 1.0, n, g)
    lap = 2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1)
    ref = sl.solve(lap, np.sin(0.3 * np.arange(n)) + 1.0)
    two = BlockVector.from_function(lambda i: 2.0 + 0 * i, n, g)
    for solver in (cg, gmres):
        res = solver(laplace_1d(n, g), b, rtol=1e-10, M=jacobi(two))
        parallel_assert(res.info == 0 and isinstance(res.x, BlockVector), f"{res.info}", g)
        parallel_allclose(res.x.allgather(), ref, rtol=1e-7, group=g)
    res = cg(laplace_1d(n, g), b, rtol=1e-10)
    parallel_assert(res.iterations <= n, f"CG took {res.iterations} > n steps", g)
    with pytest.raises(ValueError, match="BlockVector"):
        cg(laplace_1d(n, g), np.ones(n))
