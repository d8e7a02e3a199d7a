"""BLAS and LAPACK called by address, so they work in place on strided sub-matrices.

scipy.linalg.blas copies any array that is not contiguous (a trailing block
``A[i:, j:]`` of a Fortran matrix is not), which would double the memory
traffic of every update. These wrappers reach the same OpenBLAS that scipy
links, through the function pointers scipy exports in ``cython_blas`` and
``cython_lapack``, and take raw addresses: ``addr(a)`` of a Fortran-ordered
float64 array plus ``8 * (i + j * ld)`` is the address of ``a[i, j]``.

All integer arguments are Fortran ``int`` (32 bit); indices are 0-based where
a function returns one. The caller keeps the arrays alive during the call.
Nothing here communicates.
"""

from __future__ import annotations

import ctypes

import numpy as np
from scipy.linalg import cython_blas, cython_lapack

_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_vp = ctypes.c_void_p


def capsule_function(module, name: str, argtypes: list, restype=None):
    """The C function ``name`` that a Cython module (scipy's ``cython_blas`` or
    ``cython_lapack``) exports in its capsules, callable through ctypes."""
    cap = module.__pyx_capi__[name]
    ptr = _api.PyCapsule_GetPointer(cap, _api.PyCapsule_GetName(cap))
    return ctypes.CFUNCTYPE(restype, *argtypes)(ptr)


def _load(module, name: str, nargs: int, restype=None):
    """A routine whose arguments are all passed by address (Fortran BLAS/LAPACK)."""
    return capsule_function(module, name, [_vp] * nargs, restype)


_dgemm = _load(cython_blas, "dgemm", 13)
_dtrsm = _load(cython_blas, "dtrsm", 11)
_dtrsv = _load(cython_blas, "dtrsv", 8)
_dgemv = _load(cython_blas, "dgemv", 11)
_dger = _load(cython_blas, "dger", 9)
_dscal = _load(cython_blas, "dscal", 4)
_dswap = _load(cython_blas, "dswap", 5)
_dcopy = _load(cython_blas, "dcopy", 5)
_idamax = _load(cython_blas, "idamax", 3, ctypes.c_int)
_dlaswp = _load(cython_lapack, "dlaswp", 7)

# scratch storage for the by-reference scalars (single-threaded use only)
_I = np.zeros(16, dtype=np.int32)
_D = np.zeros(4, dtype=np.float64)
_C = np.frombuffer(b"NTLURC", dtype=np.uint8).copy()
_IA = _I.ctypes.data
_DA = _D.ctypes.data
_CA = _C.ctypes.data
CHAR = {c: _CA + i for i, c in enumerate("NTLURC")}
_i = [_IA + 4 * k for k in range(16)]


def addr(a: np.ndarray) -> int:
    """Address of ``a[0, 0]`` (or ``a[0]``)."""
    return a.__array_interface__["data"][0]


def dgemm(ta: str, tb: str, m: int, n: int, k: int, alpha: float, a: int, lda: int,
          b: int, ldb: int, beta: float, c: int, ldc: int) -> None:
    """C(m, n) = alpha op(A) op(B) + beta C (all addresses)."""
    if m <= 0 or n <= 0:
        return
    _I[0], _I[1], _I[2], _I[3], _I[4], _I[5] = m, n, k, max(lda, 1), max(ldb, 1), max(ldc, 1)
    _D[0], _D[1] = alpha, beta
    _dgemm(CHAR[ta], CHAR[tb], _i[0], _i[1], _i[2], _DA, a, _i[3], b, _i[4], _DA + 8, c, _i[5])


def dtrsm(side: str, uplo: str, ta: str, diag: str, m: int, n: int, alpha: float,
          a: int, lda: int, b: int, ldb: int) -> None:
    """B(m, n) = alpha op(A)^-1 B (side L) or alpha B op(A)^-1 (side R)."""
    if m <= 0 or n <= 0:
        return
    _I[0], _I[1], _I[2], _I[3] = m, n, max(lda, 1), max(ldb, 1)
    _D[0] = alpha
    _dtrsm(CHAR[side], CHAR[uplo], CHAR[ta], CHAR[diag], _i[0], _i[1], _DA, a, _i[2], b, _i[3])


def dtrsv(uplo: str, ta: str, diag: str, n: int, a: int, lda: int, x: int, incx: int) -> None:
    """x(n) = op(A)^-1 x."""
    if n <= 0:
        return
    _I[0], _I[1], _I[2] = n, max(lda, 1), incx
    _dtrsv(CHAR[uplo], CHAR[ta], CHAR[diag], _i[0], a, _i[1], x, _i[2])


def dgemv(ta: str, m: int, n: int, alpha: float, a: int, lda: int, x: int, incx: int,
          beta: float, y: int, incy: int) -> None:
    """y = alpha op(A) x + beta y, A is (m, n)."""
    if m <= 0 or n <= 0:
        return
    _I[0], _I[1], _I[2], _I[3], _I[4] = m, n, max(lda, 1), incx, incy
    _D[0], _D[1] = alpha, beta
    _dgemv(CHAR[ta], _i[0], _i[1], _DA, a, _i[2], x, _i[3], _DA + 8, y, _i[4])


def dger(m: int, n: int, alpha: float, x: int, incx: int, y: int, incy: int,
         a: int, lda: int) -> None:
    """A(m, n) += alpha x y^T."""
    if m <= 0 or n <= 0:
        return
    _I[0], _I[1], _I[2], _I[3], _I[4] = m, n, incx, incy, max(lda, 1)
    _D[0] = alpha
    _dger(_i[0], _i[1], _DA, x, _i[2], y, _i[3], a, _i[4])


def dscal(n: int, alpha: float, x: int, incx: int) -> None:
    if n <= 0:
        return
    _I[0], _I[1] = n, incx
    _D[0] = alpha
    _dscal(_i[0], _DA, x, _i[1])


def dswap(n: int, x: int, incx: int, y: int, incy: int) -> None:
    if n <= 0:
        return
    _I[0], _I[1], _I[2] = n, incx, incy
    _dswap(_i[0], x, _i[1], y, _i[2])


def dcopy(n: int, x: int, incx: int, y: int, incy: int) -> None:
    if n <= 0:
        return
    _I[0], _I[1], _I[2] = n, incx, incy
    _dcopy(_i[0], x, _i[1], y, _i[2])


def idamax(n: int, x: int, incx: int) -> int:
    """0-based index of the first entry of largest magnitude (-1 when n == 0)."""
    if n <= 0:
        return -1
    _I[0], _I[1] = n, incx
    return _idamax(_i[0], x, _i[1]) - 1


def dlaswp(n: int, a: int, lda: int, k1: int, k2: int, ipiv: np.ndarray) -> None:
    """Apply row interchanges ``k1..k2`` (1-based, as LAPACK) of ``ipiv`` (int32,
    1-based rows relative to ``a``) to the ``n`` columns of ``a``."""
    if n <= 0 or k2 < k1:
        return
    _I[0], _I[1], _I[2], _I[3], _I[4] = n, max(lda, 1), k1, k2, 1
    _dlaswp(_i[0], a, _i[1], _i[2], _i[3], addr(ipiv), _i[4])
