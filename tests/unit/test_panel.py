"""Panel factorisation (every PFACT x RFACT, NBMIN, NDIV) against scipy's LU, one process."""

import itertools

import numpy as np
import pytest
import scipy.linalg as sl

from hpcmac.linalg import _blas as blas
from hpcmac.linalg.panel import VARIANTS, PanelFactor
from hpcmac.linalg.pivot import LocalPivot


def factor_in_place(a, r0, c0, m, jb, pfact, rfact, nbmin, ndiv):
    """Factor the (m, jb) block of ``a`` at (r0, c0) in place; ``a`` keeps its leading dimension."""
    lda = a.shape[0]
    w = a[r0:r0 + m, c0:c0 + jb]
    ptr = blas.addr(a) + 8 * (r0 + c0 * lda)
    f = PanelFactor(w, ptr, lda, jb, 100, LocalPivot(w, ptr, lda, jb, 100 + np.arange(m)),
                    pfact, rfact, nbmin, ndiv)
    f.run()
    return f


@pytest.mark.parametrize("pfact,rfact", list(itertools.product(VARIANTS, VARIANTS)))
@pytest.mark.parametrize("m,jb,nbmin,ndiv", [(40, 16, 4, 2), (23, 9, 2, 3), (9, 9, 1, 2),
                                             (30, 1, 4, 2), (50, 32, 8, 4)])
def test_panel_matches_scipy(pfact, rfact, m, jb, nbmin, ndiv):
    rng = np.random.default_rng(m * jb + nbmin)
    a = np.asfortranarray(rng.standard_normal((m + 5, jb + 3)))
    before = a.copy()
    lu, piv = sl.lu_factor(before[2:2 + m, 1:1 + jb])
    f = factor_in_place(a, 2, 1, m, jb, pfact, rfact, nbmin, ndiv)
    np.testing.assert_allclose(a[2:2 + m, 1:1 + jb], lu, rtol=1e-12, atol=1e-12)
    assert np.array_equal(f.ipiv, 100 + piv)  # global row numbers
    assert f.zero == -1
    # nothing outside the panel moved
    mask = np.ones(a.shape, bool)
    mask[2:2 + m, 1:1 + jb] = False
    assert np.array_equal(a[mask], before[mask])


@pytest.mark.parametrize("pfact", VARIANTS)
def test_zero_pivot_is_reported_not_divided(pfact):
    rng = np.random.default_rng(3)
    a = np.asfortranarray(rng.standard_normal((12, 6)))
    a[:, 2] = 0.0
    f = factor_in_place(a, 0, 0, 12, 6, pfact, "right", 2, 2)
    assert f.zero == 100 + 2
    assert np.isfinite(a).all()
