"""Distributed Householder QR and lstsq against scipy.linalg.qr / scipy.linalg.lstsq."""

import numpy as np
import pytest
import scipy.linalg as sl
from linalg_util import dist, each_grid, rand, same_error_everywhere, tol

from hpcmac.linalg import DistMatrix, LinAlgError, lstsq
from hpcmac.linalg.householder import apply_q, qr_factor
from hpcmac.testing import parallel_allclose, parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
@pytest.mark.parametrize("shape,blocks", [((23, 9), (4, 3)), ((10, 10), (3, 3)),
                                          ((7, 12), (2, 5)), ((40, 17), (8, 8))])
def test_qr_matches_lapack(shape, blocks, dtype):
    """Same reflector convention as LAPACK's geqrf: R agrees with scipy's entry for entry,
    and Q^T b, Q (Q^T b) behave as scipy's Q."""
    rng = np.random.default_rng(40)
    m, n = shape
    for _g, grid in each_grid(limit=2):
        a = rand(rng, shape, dtype)
        b = rand(rng, (m, 3), dtype)
        f = qr_factor(dist(a, grid, *blocks))
        full = f.qr.allgather()
        qtb = apply_q(f, dist(b, grid, 5, 2))
        back = apply_q(f, qtb, trans=False)
        qtb_full, back_full = qtb.allgather(), back.allgather()
        if grid.in_grid:
            q, r = sl.qr(a)
            k = min(m, n)
            parallel_allclose(np.triu(full)[:k], r[:k], rtol=1e-10, atol=1e-12, msg="R",
                              group=grid.all)
            parallel_allclose(qtb_full, q.conj().T @ b, rtol=1e-10, atol=1e-12, msg="Q^T b",
                              group=grid.all)
            parallel_allclose(back_full, b, rtol=1e-10, atol=1e-12, msg="Q Q^T b",
                              group=grid.all)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
@pytest.mark.parametrize("shape", [(30, 7), (12, 12), (6, 15)])
def test_lstsq_like_scipy(dtype, shape):
    rng = np.random.default_rng(41)
    m, n = shape
    for _g, grid in each_grid(limit=2):
        a = rand(rng, shape, dtype)
        b2 = rand(rng, (m, 2), dtype)
        b1 = b2[:, 0].copy()
        d = dist(a, grid, 4, 3)
        x1, res1, rank1, s1 = lstsq(d, b1)
        x2, res2, rank2, _ = lstsq(d, dist(b2, grid, 5, 1))
        x2_full = x2.allgather()
        if grid.in_grid:
            r = tol(dtype) * 100
            for b, x, res, rank in ((b1, x1, res1, rank1), (b2, x2_full, res2, rank2)):
                ref_x, ref_res, ref_rank, _ = sl.lstsq(a, b, lapack_driver="gelsy")
                ref_res = (np.sum(np.abs(b - a @ ref_x) ** 2, axis=0) if m > n
                           else np.zeros(0))     # gelsy leaves residues empty; gelsd's rule
                if b.ndim == 1 and m > n:
                    ref_res = ref_res.item()
                parallel_assert(np.shape(x) == ref_x.shape, f"{np.shape(x)} {ref_x.shape}",
                                grid.all)
                parallel_allclose(x, ref_x, rtol=r, atol=r, msg="x", group=grid.all)
                parallel_assert(np.shape(res) == np.shape(ref_res) and rank == ref_rank,
                                f"residues {np.shape(res)} rank {rank}", grid.all)
                parallel_allclose(res, ref_res, rtol=r, atol=r, msg="residues", group=grid.all)
            parallel_assert(s1 is None and (x2.mb, x2.nb) == (5, 1), "s, layout", grid.all)
            # scipy's default driver (gelsd) agrees on x and residues for full-rank a
            wide = np.result_type(dtype, np.float64)
            ref = sl.lstsq(a.astype(wide), b2.astype(wide))
            parallel_allclose(x2_full, ref[0], rtol=r, atol=r, group=grid.all)
            if m > n:
                parallel_allclose(res2, ref[1], rtol=r, atol=r, group=grid.all)


def test_lstsq_fits_a_polynomial():
    """A least-squares fit as a user would write it: Vandermonde columns from a function."""
    rng = np.random.default_rng(42)
    t = np.linspace(-1, 1, 200)
    y = 1.5 - 2 * t + 0.5 * t**3 + 0.01 * rng.standard_normal(t.size)
    for _g, grid in each_grid(limit=2):
        v = DistMatrix.from_function(lambda i, j: t[i] ** j, (t.size, 4), grid, 16, 2)
        coef, res, rank, _ = lstsq(v, y)
        if grid.in_grid:
            ref = sl.lstsq(np.vander(t, 4, increasing=True), y)
            parallel_allclose(coef, ref[0], rtol=1e-10, atol=1e-12, group=grid.all)
            parallel_allclose(res, ref[1], rtol=1e-9, group=grid.all)


def test_rank_deficient_raises_everywhere():
    for _g, grid in each_grid(limit=2):
        if not grid.in_grid:
            continue
        a = dist(np.ones((8, 3)), grid, 2, 2)
        msg = same_error_everywhere(grid.all, lambda d=a: lstsq(d, np.ones(8)), LinAlgError)
        assert "rank deficient" in msg, msg
