"""Distributed symmetric eigensolver (tridiagonal reduction + MRRR + back-transformation)
against scipy.linalg.eigh."""

import numpy as np
import pytest
import scipy.linalg as sl
from linalg_util import dist, each_grid, rand, same_error_everywhere, tol

from hpcmac.linalg import DistMatrix, eigh
from hpcmac.linalg.tridiag import tridiagonalize
from hpcmac.testing import parallel_allclose, parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def sym(rng, n, dtype=np.float64):
    x = rand(rng, (n, n), dtype)
    return ((x + x.conj().T) / 2).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_tridiagonal_reduction_keeps_the_spectrum(dtype):
    rng = np.random.default_rng(50)
    for _g, grid in each_grid(limit=3):
        a = sym(rng, 17, dtype)
        d, e, tau = tridiagonalize(dist(a, grid, 3, 3))
        if grid.in_grid:
            parallel_assert(d.shape == (17,) and e.shape == (16,) and tau.shape == (16,),
                            "shapes", grid.all)
            parallel_allclose(sl.eigvalsh_tridiagonal(d, e), sl.eigvalsh(a), rtol=1e-12,
                              atol=1e-12, group=grid.all)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
@pytest.mark.parametrize("n,blocks", [(1, (2, 2)), (2, (1, 1)), (13, (3, 3)), (30, (4, 7)),
                                      (40, (8, 8))])
def test_eigh_like_scipy(dtype, n, blocks):
    rng = np.random.default_rng(51)
    for _g, grid in each_grid(limit=2):
        a = sym(rng, n, dtype)
        for lower in (True, False):
            # only the named triangle is read: spoil the other one
            given = np.tril(a) + 7 * np.triu(np.ones_like(a), 1) if lower else \
                np.triu(a) - 7 * np.tril(np.ones_like(a), -1)
            if np.iscomplexobj(a):      # scipy (LAPACK) ignores the diagonal's imaginary part
                given = given + 3j * np.eye(n)
            w, v = eigh(dist(given.astype(dtype), grid, *blocks), lower=lower)
            only = eigh(dist(given.astype(dtype), grid, *blocks), lower=lower,
                        eigvals_only=True) if lower else w
            full = v.allgather()
            if not grid.in_grid:
                continue
            ref_w, ref_v = sl.eigh(a.astype(np.result_type(a.dtype, np.float64)))
            r = tol(dtype) * 10 * max(1, n / 10)
            parallel_assert((v.mb, v.nb, v.gshape) == (*blocks, (n, n)), "layout", grid.all)
            parallel_allclose(w, ref_w, rtol=r, atol=r, msg="w", group=grid.all)
            parallel_allclose(only, w, rtol=r, atol=r, msg="eigvals_only", group=grid.all)
            # eigenvectors: A V = V diag(w), V^T V = I, and each column is +-scipy's
            parallel_allclose(a @ full, full * w, rtol=r, atol=r, msg="A V = V w",
                              group=grid.all)
            parallel_allclose(full.conj().T @ full, np.eye(n), rtol=r, atol=r,
                              msg="orthonormal", group=grid.all)
            parallel_allclose(np.abs(np.sum(full.conj() * ref_v, axis=0)), np.ones(n),
                              rtol=r * 10,
                              atol=r * 10, msg="same vectors up to sign", group=grid.all)


def test_eigh_subset_by_index_and_a_degenerate_spectrum():
    rng = np.random.default_rng(52)
    for _g, grid in each_grid(limit=2):
        q, _ = np.linalg.qr(rng.standard_normal((20, 20)))
        a = q @ np.diag(np.repeat([1.0, 2.0, 5.0, 9.0], 5)) @ q.T    # 4 eigenvalues x 5
        a = (a + a.T) / 2
        w, v = eigh(dist(a, grid, 4, 4))
        ws, vs = eigh(dist(a, grid, 4, 4), subset_by_index=(3, 9))
        full, sub = v.allgather(), vs.allgather()
        if grid.in_grid:
            parallel_allclose(w, sl.eigh(a)[0], rtol=1e-12, atol=1e-12, group=grid.all)
            parallel_allclose(full.T @ full, np.eye(20), atol=1e-11, group=grid.all)
            parallel_allclose(a @ full, full * w, atol=1e-11, group=grid.all)
            parallel_assert(sub.shape == (20, 7), f"{sub.shape}", grid.all)
            parallel_allclose(ws, w[3:10], rtol=1e-12, atol=1e-12, group=grid.all)
            parallel_allclose(a @ sub, sub * ws, atol=1e-11, group=grid.all)


def test_eigh_refuses_what_it_cannot_do():
    for _g, grid in each_grid(limit=1):
        if not grid.in_grid:
            continue
        a = dist(np.eye(4), grid, 2, 2)
        msg = same_error_everywhere(grid.all, lambda d=a: eigh(d, np.eye(4)), ValueError)
        assert "generalized" in msg
        rect = DistMatrix.zeros((4, 3), grid, 2, 2)
        msg = same_error_everywhere(grid.all, lambda d=rect: eigh(d), ValueError)
        assert "square" in msg
