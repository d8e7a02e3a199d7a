"""scipy's remaining names over DistMatrix: cholesky, inv, det, slogdet, diag, trace,
ndarray right-hand sides, gmres(restart=None), arithmetic operators — against scipy/numpy."""

import types

import numpy as np
import pytest
import scipy.linalg as sl
from linalg_util import DTYPES, dist, each_grid, rand, same_error_everywhere, spd, tol

import hpcmac.linalg as hl
from hpcmac.linalg import (
    DistMatrix,
    Grid,
    LinAlgError,
    cho_factor,
    cho_solve,
    cholesky,
    det,
    diag,
    gmres,
    inv,
    matmul,
    slogdet,
    solve_triangular,
    trace,
)
from hpcmac.testing import parallel_allclose, parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def test_no_submodule_shadows_a_function():
    import hpcmac.linalg.chol  # noqa: F401  (importing every module must not rebind a name)
    import hpcmac.linalg.inverse  # noqa: F401

    for name in hl.__all__:
        assert not isinstance(getattr(hl, name), types.ModuleType), name
    assert callable(hl.cholesky) and hl.Grid is __import__("hpcmac.comm.grid").comm.grid.Grid


@pytest.mark.parametrize("dtype", DTYPES)
def test_cholesky_like_scipy(dtype):
    rng = np.random.default_rng(30)
    for _g, grid in each_grid(limit=2):
        a = spd(rng, 13, dtype)
        for lower in (False, True):
            c = cholesky(dist(a, grid, 3, 4), lower=lower)
            full = c.allgather()
            if grid.in_grid:
                parallel_assert((c.mb, c.nb) == (3, 4), "layout", grid.all)
                # the other triangle is zero, as scipy's
                parallel_allclose(full, sl.cholesky(a, lower=lower), rtol=tol(dtype) * 10,
                                  atol=tol(dtype) * 10, msg=f"lower={lower}", group=grid.all)
    grid = Grid(world(), 1, 1)
    if grid.in_grid:
        bad = np.eye(5)
        bad[2, 2] = -1
        msg = same_error_everywhere(grid.all, lambda: cholesky(dist(bad, grid, 2, 2)),
                                    LinAlgError)
        assert msg.startswith("3-th leading minor"), msg


@pytest.mark.parametrize("dtype", DTYPES)
def test_inv_like_scipy(dtype):
    rng = np.random.default_rng(31)
    for _g, grid in each_grid(limit=2):
        a = rand(rng, (15, 15), dtype) + 3 * np.eye(15, dtype=dtype)
        x = inv(dist(a, grid, 4, 3))
        full = x.allgather()
        if grid.in_grid:
            parallel_assert((x.mb, x.nb, x.dtype) == (4, 3, np.dtype(dtype)),
                            f"layout/dtype {x.mb} {x.nb} {x.dtype}", grid.all)
            parallel_allclose(full, sl.inv(a), rtol=tol(dtype) * 100, atol=tol(dtype) * 100,
                              group=grid.all)
        sing = np.ones((4, 4))
        if grid.in_grid:
            same_error_everywhere(grid.all, lambda s=sing, g=grid: inv(dist(s, g, 2, 2)),
                                  LinAlgError)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
def test_det_and_slogdet_like_scipy_and_numpy(dtype):
    rng = np.random.default_rng(32)
    for _g, grid in each_grid(limit=2):
        for n in (1, 9, 16):
            a = rand(rng, (n, n), dtype)
            d = dist(a, grid, 3, 3)
            got_det, got_slog = det(d), slogdet(d)
            if grid.in_grid:
                sign, logabs = got_slog
                wide = a.astype(np.result_type(dtype, np.float64))
                ref_sign, ref_log = np.linalg.slogdet(wide)
                parallel_allclose(got_det, sl.det(wide), rtol=tol(dtype) * 100,
                                  msg=f"det n={n}", group=grid.all)
                if np.iscomplexobj(a):
                    parallel_allclose(sign, ref_sign, rtol=1e-10, msg="phase", group=grid.all)
                else:
                    parallel_assert(sign == ref_sign, f"sign {sign} != {ref_sign}", grid.all)
                parallel_allclose(logabs, ref_log, rtol=tol(dtype) * 10, atol=tol(dtype),
                                  msg="logabsdet", group=grid.all)
                # every rank holds exactly the same numbers
                parallel_assert(len(set(grid.all.allgather_obj((got_det, sign, logabs)))) == 1,
                                "same everywhere", grid.all)
        # a GP's log-likelihood term: 2 sum(log diag(L)) == logdet of an SPD matrix
        k = spd(rng, 12, np.float64)
        low = cholesky(dist(k, grid, 4, 4), lower=True)
        ld = diag(low)
        if grid.in_grid:
            parallel_allclose(2 * np.sum(np.log(ld)), np.linalg.slogdet(k)[1], rtol=1e-12,
                              group=grid.all)
        sing = np.ones((5, 5))
        got = (det(dist(sing, grid, 2, 2)), slogdet(dist(sing, grid, 2, 2)))
        if grid.in_grid:
            parallel_assert(got == (0.0, (0.0, -np.inf)), f"singular: {got}", grid.all)


@pytest.mark.parametrize("dtype", DTYPES)
def test_diag_and_trace(dtype):
    rng = np.random.default_rng(33)
    for _g, grid in each_grid(limit=2):
        a = rand(rng, (7, 10), dtype)
        d = dist(a, grid, 2, 3)
        for k in (0, 1, 4, -2, -6, 10, -7):
            got, tr = diag(d, k), trace(d, k)
            if grid.in_grid:
                parallel_assert(np.array_equal(got, np.diag(a, k)), f"diag k={k}", grid.all)
                parallel_allclose(tr, np.trace(a, k), rtol=tol(dtype), atol=tol(dtype) * 10,
                                  msg=f"trace {k}",
                                  group=grid.all)
        v = rand(rng, (6,), dtype)
        for k in (0, 2, -1):
            m = diag(v, k, grid=grid, mb=2, nb=3)
            full = m.allgather()
            if grid.in_grid:
                parallel_assert(np.array_equal(full, np.diag(v, k)), f"build k={k}", grid.all)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ndarray_right_hand_sides(dtype):
    """solve_triangular and cho_solve take b whole on every rank (1-D or 2-D) and give
    x whole on every grid rank, as solve and lu_solve do; matmul and @ likewise."""
    rng = np.random.default_rng(34)
    for _g, grid in each_grid(limit=2):
        n = 11
        t = rand(rng, (n, n), dtype) + 4 * np.eye(n, dtype=dtype)
        a = spd(rng, n, dtype)
        for b in (rand(rng, (n,), dtype), rand(rng, (n, 3), dtype)):
            x1 = solve_triangular(dist(t, grid, 3, 3), b, lower=True, trans=1)
            x2 = cho_solve(cho_factor(dist(a, grid, 4, 2)), b)
            y1 = matmul(dist(a, grid, 4, 2), b)
            y2 = dist(a, grid, 4, 2) @ b
            y3 = b.T @ dist(a, grid, 4, 2)
            if grid.in_grid:
                r = tol(dtype) * 100
                parallel_allclose(x1, sl.solve_triangular(t, b, lower=True, trans=1), rtol=r,
                                  atol=r, group=grid.all)
                parallel_allclose(x2, sl.cho_solve(sl.cho_factor(a), b), rtol=r, atol=r,
                                  group=grid.all)
                for got, want in ((y1, a @ b), (y2, a @ b), (y3, b.T @ a)):
                    parallel_assert(got.shape == want.shape, f"{got.shape} {want.shape}",
                                    grid.all)
                    parallel_allclose(got, want, rtol=r, atol=r, group=grid.all)


def test_gmres_restart_none_is_scipys_default():
    import scipy.sparse.linalg as spla

    rng = np.random.default_rng(35)
    n = 60
    a = rand(rng, (n, n), np.float64) + 9 * np.eye(n)
    b = rand(rng, (n,), np.float64)
    for _g, grid in each_grid(limit=2):
        d = dist(a, grid, 8, 8)
        res_none = gmres(d, b, rtol=1e-10, restart=None)
        res_20 = gmres(d, b, rtol=1e-10, restart=20)
        if grid.in_grid:
            ref, info = spla.gmres(a, b, rtol=1e-10, restart=None)
            parallel_assert(res_none.info == 0 and info == 0, "converged", grid.all)
            parallel_assert(res_none.iterations == res_20.iterations, "restart None == 20",
                            grid.all)
            parallel_allclose(res_none.x, ref, rtol=1e-7, atol=1e-9, group=grid.all)


@pytest.mark.parametrize("dtype", DTYPES)
def test_operators_like_numpy(dtype):
    rng = np.random.default_rng(36)
    for _g, grid in each_grid(limit=2):
        a, b = rand(rng, (9, 7), dtype), rand(rng, (9, 7), dtype)
        c = rand(rng, (7, 5), dtype)
        row = rand(rng, (7,), dtype)
        da, db, dc = dist(a, grid, 2, 3), dist(b, grid, 4, 2), dist(c, grid, 3, 2)
        cases = {
            "a + b": (da + db, a + b), "a - b": (da - db, a - b), "a * b": (da * db, a * b),
            "a / 2": (da / 2, a / 2), "2 - a": (2 - da, 2 - a), "3 * a": (3 * da, 3 * a),
            "a * 2.5j" if np.dtype(dtype).kind == "c" else "a * 2.5": (
                da * (2.5j if np.dtype(dtype).kind == "c" else 2.5),
                a * (2.5j if np.dtype(dtype).kind == "c" else 2.5)),
            "-a": (-da, -a), "a + row": (da + row, a + row), "row - a": (row - da, row - a),
            "np.float64 * a": (np.float64(1.5) * da, np.float64(1.5) * a),
            "a @ c": (da @ dc, a @ c), "a.T": (da.T, a.T), "a.T @ b": (da.T @ db, a.T @ b),
            "a.conj()": (da.conj(), a.conj()),
        }
        for what, (got, want) in cases.items():
            full = got.allgather()
            if grid.in_grid:
                parallel_assert(full.dtype == want.dtype, f"{what}: {full.dtype} {want.dtype}",
                                grid.all)
                parallel_allclose(full, want, rtol=tol(dtype) * 10, atol=tol(dtype) * 10,
                                  msg=what, group=grid.all)
        parallel_assert(((da + db).mb, (da + db).nb) == (2, 3), "left operand's layout")
        if grid.in_grid:
            msg = same_error_everywhere(grid.all, lambda x=da, y=dc: x + y, ValueError)
            assert "could not be broadcast" in msg
            with pytest.raises(TypeError):
                da + "x"


def test_distmatrix_rhs_in_its_own_layout_still():
    """A DistMatrix b still gives a DistMatrix x in b's layout."""
    rng = np.random.default_rng(37)
    for _g, grid in each_grid(limit=1):
        a, b = spd(rng, 10, np.float64), rand(rng, (10, 2), np.float64)
        x = cho_solve(cho_factor(dist(a, grid, 3, 3)), dist(b, grid, 5, 1))
        full = x.allgather()
        if grid.in_grid:
            parallel_assert(isinstance(x, DistMatrix) and (x.mb, x.nb) == (5, 1), "layout",
                            grid.all)
            parallel_allclose(full, np.linalg.solve(a, b), rtol=1e-10, group=grid.all)
