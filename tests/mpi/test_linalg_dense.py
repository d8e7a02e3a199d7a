"""Distributed matmul, norms, transpose, redistribute, Cholesky and triangular solves vs scipy."""

import numpy as np
import pytest
import scipy.linalg as sl
from linalg_util import DTYPES, dist, each_grid, grids, rand, same_error_everywhere, spd, tol

from hpcmac.comm.grid import Grid
from hpcmac.linalg import (
    DistMatrix,
    LinAlgError,
    cho_factor,
    cho_solve,
    matmul,
    norm,
    solve,
    solve_triangular,
    transpose,
)
from hpcmac.testing import parallel_allclose, parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("panel", [1024, 5])
def test_matmul_against_numpy(dtype, panel, monkeypatch):
    import hpcmac.linalg.summa

    monkeypatch.setattr(hpcmac.linalg.summa, "PANEL", panel)   # 5: many panels, odd cuts
    rng = np.random.default_rng(1)
    for _g, grid in each_grid():
        for (m, k, n), (amb, anb), (bmb, bnb) in [((13, 11, 9), (3, 2), (4, 3)),
                                                   ((16, 16, 16), (4, 4), (4, 4)),
                                                   ((5, 30, 2), (8, 7), (5, 1))]:
            a, b = rand(rng, (m, k), dtype), rand(rng, (k, n), dtype)
            c = matmul(dist(a, grid, amb, anb), dist(b, grid, bmb, bnb))
            full = c.allgather()
            if grid.in_grid:
                parallel_assert((c.mb, c.nb) == (amb, bnb), "C layout", grid.all)
                parallel_allclose(full, a @ b, rtol=tol(dtype), atol=tol(dtype) * 10,
                                  msg=f"{grid.shape} {m}x{k}x{n}", group=grid.all)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_transpose_redistribute_eye(dtype):
    rng = np.random.default_rng(2)
    for _g, grid in each_grid():
        a = rand(rng, (11, 7), dtype)
        d = dist(a, grid, 3, 2)
        for ord_ in (None, "fro", 1, -1, np.inf, -np.inf):
            v = norm(d, ord_)
            if grid.in_grid:
                parallel_allclose(v, sl.norm(a, ord_), rtol=1e-5, msg=f"norm {ord_}",
                                  group=grid.all)
        v = norm(d, "max")
        if grid.in_grid:
            parallel_allclose(v, np.abs(a).max(), rtol=1e-6, group=grid.all)
        for conj in (False, True):
            t = transpose(d, conj=conj)
            full = t.allgather()
            if grid.in_grid:
                ref = a.conj().T if conj else a.T
                parallel_assert(np.array_equal(full, ref) and (t.mb, t.nb) == (2, 3), "T", grid.all)
        for mb, nb in [(1, 1), (5, 2), (11, 7), (20, 20)]:
            full = d.redistribute(grid, mb, nb).allgather()
            if grid.in_grid:
                parallel_assert(np.array_equal(full, a), f"redistribute {mb}x{nb}", grid.all)
        e = DistMatrix.eye(6, grid, 4, 3, m=8, dtype=dtype).allgather()
        if grid.in_grid:
            parallel_assert(np.array_equal(e, np.eye(6, 8, dtype=dtype)), "eye", grid.all)


def test_redistribute_between_grids():
    g = world()
    rng = np.random.default_rng(3)
    a = rand(rng, (9, 10), np.float64)
    src = Grid(g, 1, g.size)
    dst = Grid(g, g.size, 1, order="col")
    small = Grid(g, 1, 1)
    d = dist(a, src, 2, 3)
    for target, mb, nb in [(dst, 4, 1), (small, 3, 3), (src, 5, 5)]:
        moved = d.redistribute(target, mb, nb)
        full = moved.gather()
        parallel_assert(full is None or np.array_equal(full, a), f"to {target.shape}", g)
        back = moved.redistribute(src, 2, 3)
        parallel_assert(np.array_equal(back.local, d.local), "round trip", g)


def test_helpers_owner_g2l_l2g():
    for _g, grid in each_grid(limit=2):
        if not grid.in_grid:
            continue
        d = DistMatrix.from_function(lambda i, j: 100 * i + j, (10, 9), grid, 3, 2)
        ok = True
        for li in range(d.lshape[0]):
            for lj in range(d.lshape[1]):
                i, j = d.l2g(li, lj)
                ok &= d.local[li, lj] == 100 * i + j
                ok &= d.owner(i, j) == (grid.myrow, grid.mycol) and d.g2l(i, j) == (li, lj)
        parallel_assert(ok, "index helpers", grid.all)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [512, 1])
def test_cholesky_and_cho_solve(dtype, chunk, monkeypatch):
    import hpcmac.linalg.chol

    monkeypatch.setattr(hpcmac.linalg.chol, "CHUNK", chunk)   # 1: one block per chunk
    rng = np.random.default_rng(4)
    for _g, grid in each_grid():
        n = 19
        a = spd(rng, n, dtype)
        b = rand(rng, (n, 3), dtype)
        for lower in (True, False):
            for mb, nb in [(4, 4), (3, 5), (32, 32)]:
                c, low = cho_factor(dist(a, grid, mb, nb), lower=lower)
                full = c.allgather()
                x = cho_solve((c, low), dist(b, grid, 2, 2)).allgather()
                if grid.in_grid:
                    ref, _ = sl.cho_factor(a, lower=lower)
                    tri = np.tril if lower else np.triu
                    parallel_allclose(tri(full), tri(ref), rtol=tol(dtype) * 10,
                                      atol=tol(dtype) * 10, msg=f"factor {lower} {mb}x{nb}",
                                      group=grid.all)
                    parallel_allclose(x, sl.cho_solve((ref, lower), b), rtol=tol(dtype) * 100,
                                      atol=tol(dtype) * 100, msg="cho_solve", group=grid.all)
        # solve(assume_a="pos") takes the same path, b given whole on every rank
        x = solve(dist(a, grid, 4, 4), b[:, 0], assume_a="pos")
        if grid.in_grid:
            parallel_allclose(x, sl.solve(a, b[:, 0], assume_a="pos"), rtol=tol(dtype) * 100,
                              atol=tol(dtype) * 100, group=grid.all)


@pytest.mark.parametrize("dtype", DTYPES)
def test_solve_triangular(dtype):
    rng = np.random.default_rng(5)
    for _g, grid in each_grid():
        n = 17
        a = rand(rng, (n, n), dtype) + 4 * np.eye(n, dtype=dtype)
        b = rand(rng, (n, 4), dtype)
        for lower in (True, False):
            for trans in (0, 1, 2):
                for unit in (False, True):
                    x = solve_triangular(dist(a, grid, 3, 3), dist(b, grid, 2, 3), trans=trans,
                                         lower=lower, unit_diagonal=unit).allgather()
                    if grid.in_grid:
                        ref = sl.solve_triangular(a, b, trans=trans, lower=lower,
                                                  unit_diagonal=unit)
                        parallel_allclose(x, ref, rtol=tol(dtype) * 100, atol=tol(dtype) * 100,
                                          msg=f"{lower} {trans} {unit}", group=grid.all)


@pytest.mark.parametrize("shape_index", [0, 1])
def test_errors_are_the_same_on_every_rank(shape_index):
    g = world()
    shapes = grids(g.size)
    if shape_index >= len(shapes):
        pytest.skip("one grid shape at this rank count")
    grid = Grid(g, *shapes[shape_index])
    if not grid.in_grid:
        return
    group = grid.all
    rng = np.random.default_rng(6)
    a = dist(rand(rng, (6, 5), np.float64), grid, 2, 2)
    b = dist(rand(rng, (4, 3), np.float64), grid, 2, 2)
    msg = same_error_everywhere(group, lambda: matmul(a, b), ValueError)
    assert "not aligned" in msg
    same_error_everywhere(group, lambda: cho_factor(a), ValueError)
    sq = dist(spd(rng, 6, np.float64), grid, 2, 2)
    msg = same_error_everywhere(group, lambda: cho_solve((sq, True), b), ValueError)
    assert "incompatible" in msg
    # a non-finite entry on one rank only (the owner of (5, 5)): every rank still raises
    bad = sq.copy()
    bad.local[(bad.rows[:, None] == 5) & (bad.cols[None, :] == 5)] = np.nan
    msg = same_error_everywhere(group, lambda: cho_factor(bad), ValueError)
    assert "infs or NaNs" in msg
    # not positive definite: the 4th leading minor fails
    m = np.eye(6)
    m[3, 3] = -1.0
    msg = same_error_everywhere(group, lambda: cho_factor(dist(m, grid, 2, 2), lower=True),
                                LinAlgError)
    assert msg.startswith("4-th leading minor"), msg
    # a zero on the diagonal of a triangle: singular at global index 4
    t = np.triu(np.ones((6, 6)))
    t[4, 4] = 0
    rhs = dist(np.ones((6, 1)), grid, 2, 2)
    msg = same_error_everywhere(group, lambda: solve_triangular(dist(t, grid, 2, 2), rhs),
                                LinAlgError)
    assert "diagonal 4" in msg, msg


def test_ranks_outside_the_grid_take_no_part():
    """A 1 x 1 grid at any rank count, operands scattered by from_global (idle ranks do not
    know the shapes): every call returns on the idle ranks and is right on rank 0."""
    g = world()
    grid = Grid(g, 1, 1)
    rng = np.random.default_rng(7)
    a0, b0 = spd(rng, 9, np.float64), rand(rng, (9, 2), np.float64)
    a = DistMatrix.from_global(a0 if g.rank == 0 else None, grid, 4, 4)
    b = DistMatrix.from_global(b0 if g.rank == 0 else None, grid, 4, 4)
    results = [matmul(a, b).gather(), solve(a, b).gather(), solve(a, b0),
               cho_solve(cho_factor(a), b).gather(), solve_triangular(a, b).gather(),
               norm(a, 1)]
    if g.rank == 0:
        expect = [a0 @ b0, sl.solve(a0, b0), sl.solve(a0, b0), sl.solve(a0, b0),
                  sl.solve_triangular(a0, b0), sl.norm(a0, 1)]
        for got, want in zip(results, expect):
            np.testing.assert_allclose(got, want, rtol=1e-9)
    g.barrier()
