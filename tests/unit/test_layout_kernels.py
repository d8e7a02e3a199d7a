"""In-place BLAS kernels on strided views against numpy (no MPI)."""

import numpy as np
import pytest

from hpcmac.linalg.kernels import gemm_update, trsm_right


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
@pytest.mark.parametrize("trans_b", ["N", "T", "C"])
def test_gemm_update_in_place_on_strided_views(dtype, trans_b):
    rng = np.random.default_rng(0)
    for m, n, k in [(5, 4, 3), (1, 1, 4), (1, 6, 2), (6, 1, 2), (0, 3, 2), (3, 3, 0)]:
        for a_fortran in (False, True):
            for b_fortran in (False, True):
                a = rng.standard_normal((m, k)).astype(dtype)
                b = rng.standard_normal((k, n) if trans_b == "N" else (n, k)).astype(dtype)
                if np.iscomplexobj(a):
                    a, b = a + 1j * a[::-1], b - 2j
                a = np.asfortranarray(a) if a_fortran else a
                b = np.asfortranarray(b) if b_fortran else b
                c = np.asfortranarray(rng.standard_normal((m + 3, n + 2)).astype(dtype))
                ref = c.copy()
                ob = {"N": b, "T": b.T, "C": b.conj().T}[trans_b]
                ref[1:1 + m, 2:2 + n] += -0.5 * (a @ ob)
                gemm_update(c[1:1 + m, 2:2 + n], a, b, alpha=-0.5, trans_b=trans_b)
                tol = 1e-5 if dtype == np.float32 else 1e-12
                np.testing.assert_allclose(c, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.complex128])
@pytest.mark.parametrize("trans", ["N", "T", "C"])
@pytest.mark.parametrize("lower", [True, False])
def test_trsm_right_in_place(dtype, trans, lower):
    rng = np.random.default_rng(1)
    for unit in (False, True):
        t = rng.standard_normal((5, 5)).astype(dtype) + 4 * np.eye(5, dtype=dtype)
        if np.iscomplexobj(t):
            t = t + 1j * rng.standard_normal((5, 5))
        tri = np.tril(t) if lower else np.triu(t)
        if unit:
            np.fill_diagonal(tri, 1)
        op = {"N": tri, "T": tri.T, "C": tri.conj().T}[trans]
        tol = 1e-4 if dtype == np.float32 else 1e-12
        big = np.asfortranarray(rng.standard_normal((9, 9)).astype(dtype))
        ref = big.copy()
        ref[2:8, 1:6] = ref[2:8, 1:6] @ np.linalg.inv(op)
        trsm_right(big[2:8, 1:6], t, lower, trans, unit)
        np.testing.assert_allclose(big, ref, rtol=tol, atol=tol)
        c_order = rng.standard_normal((6, 5)).astype(dtype)   # not BLAS-shaped: the fallback
        expect = c_order @ np.linalg.inv(op)
        trsm_right(c_order, t, lower, trans, unit)
        np.testing.assert_allclose(c_order, expect, rtol=tol, atol=tol)
