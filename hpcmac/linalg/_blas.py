"""BLAS and LAPACK called by address, so they work in place on strided sub-matrices.

scipy.linalg.blas copies any array that is not contiguous (a trailing block
``A[i:, j:]`` of a Fortran matrix is not), which would double the memory
traffic of every update. These wrappers reach the same OpenBLAS that scipy
links, through the function pointers scipy exports in ``cython_blas`` and
``cython_lapack``, and take raw addresses: ``addr(a)`` of a Fortran-ordered
float64 array plus ``8 * (i + j * ld)`` is the address of ``a[i, j]``.
One :class:`Routines` per precision (``DOUBLE``, ``SINGLE``; ``for_dtype``)
carries the same names without the type letter and its ``itemsize``; the
module-level ``dgemm``, ``dtrsm``, ... are ``DOUBLE``'s.

All integer arguments are Fortran ``int`` (32 bit); indices are 0-based where
a function returns one. The caller keeps the arrays alive during the call.
Nothing here communicates.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.util
import os
import sys

import numpy as np


def _scipy_cython(name: str):
    """scipy's ``scipy.linalg.<name>`` (``cython_blas`` / ``cython_lapack``), loaded from
    its file without running ``scipy/linalg/__init__.py``, which imports all of
    scipy.linalg (~0.2 s per rank of start-up that an HPL job never uses).

    Registered in ``sys.modules`` under its own name, so a later ``import scipy.linalg``
    shares it; any surprise falls back to the ordinary import.
    """
    full = f"scipy.linalg.{name}"
    if full in sys.modules:
        return sys.modules[full]
    try:
        scipy_spec = importlib.util.find_spec("scipy")
        folder = os.path.join(os.path.dirname(scipy_spec.origin), "linalg")
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = os.path.join(folder, name + suffix)
            if os.path.exists(path):
                spec = importlib.util.spec_from_file_location(full, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[full] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[full]
                    raise
                return module
    except Exception:  # pragma: no cover - an unusual scipy layout
        pass
    return importlib.import_module(full)


cython_blas = _scipy_cython("cython_blas")
cython_lapack = _scipy_cython("cython_lapack")

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


# by-reference character arguments, shared (read-only) by every precision
_C = np.frombuffer(b"NTLURC", dtype=np.uint8).copy()
_CA = _C.ctypes.data
CHAR = {c: _CA + i for i, c in enumerate("NTLURC")}


def addr(a: np.ndarray) -> int:
    """Address of ``a[0, 0]`` (or ``a[0]``)."""
    return a.__array_interface__["data"][0]


class Routines:
    """BLAS/LAPACK of one precision (``"d"`` float64 or ``"s"`` float32) by address.

    ``itemsize`` is the bytes per element: ``addr(a) + itemsize * (i + j * ld)``
    is ``a[i, j]``. Not thread-safe (by-reference scalars live in scratch arrays).
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.dtype = np.dtype({"d": np.float64, "s": np.float32}[prefix])
        self.itemsize = self.dtype.itemsize
        self._gemm = _load(cython_blas, prefix + "gemm", 13)
        self._trsm = _load(cython_blas, prefix + "trsm", 11)
        self._trsv = _load(cython_blas, prefix + "trsv", 8)
        self._gemv = _load(cython_blas, prefix + "gemv", 11)
        self._ger = _load(cython_blas, prefix + "ger", 9)
        self._scal = _load(cython_blas, prefix + "scal", 4)
        self._swap = _load(cython_blas, prefix + "swap", 5)
        self._copy = _load(cython_blas, prefix + "copy", 5)
        self._iamax = _load(cython_blas, "i" + prefix + "amax", 3, ctypes.c_int)
        self._laswp = _load(cython_lapack, prefix + "laswp", 7)
        # scratch storage for the by-reference scalars
        self._I = np.zeros(16, dtype=np.int32)
        self._D = np.zeros(4, dtype=self.dtype)
        self._DA = self._D.ctypes.data
        self._i = [self._I.ctypes.data + 4 * k for k in range(16)]

    def gemm(self, ta: str, tb: str, m: int, n: int, k: int, alpha: float, a: int, lda: int,
             b: int, ldb: int, beta: float, c: int, ldc: int) -> None:
        """C(m, n) = alpha op(A) op(B) + beta C (all addresses)."""
        if m <= 0 or n <= 0:
            return
        I, i = self._I, self._i
        I[0], I[1], I[2], I[3], I[4], I[5] = m, n, k, max(lda, 1), max(ldb, 1), max(ldc, 1)
        self._D[0], self._D[1] = alpha, beta
        self._gemm(CHAR[ta], CHAR[tb], i[0], i[1], i[2], self._DA, a, i[3], b, i[4],
                   self._DA + self.itemsize, c, i[5])

    def trsm(self, side: str, uplo: str, ta: str, diag: str, m: int, n: int, alpha: float,
             a: int, lda: int, b: int, ldb: int) -> None:
        """B(m, n) = alpha op(A)^-1 B (side L) or alpha B op(A)^-1 (side R)."""
        if m <= 0 or n <= 0:
            return
        I, i = self._I, self._i
        I[0], I[1], I[2], I[3] = m, n, max(lda, 1), max(ldb, 1)
        self._D[0] = alpha
        self._trsm(CHAR[side], CHAR[uplo], CHAR[ta], CHAR[diag], i[0], i[1], self._DA, a, i[2],
                   b, i[3])

    def trsv(self, uplo: str, ta: str, diag: str, n: int, a: int, lda: int, x: int,
             incx: int) -> None:
        """x(n) = op(A)^-1 x."""
        if n <= 0:
            return
        I, i = self._I, self._i
        I[0], I[1], I[2] = n, max(lda, 1), incx
        self._trsv(CHAR[uplo], CHAR[ta], CHAR[diag], i[0], a, i[1], x, i[2])

    def gemv(self, ta: str, m: int, n: int, alpha: float, a: int, lda: int, x: int, incx: int,
             beta: float, y: int, incy: int) -> None:
        """y = alpha op(A) x + beta y, A is (m, n)."""
        if m <= 0 or n <= 0:
            return
        I, i = self._I, self._i
        I[0], I[1], I[2], I[3], I[4] = m, n, max(lda, 1), incx, incy
        self._D[0], self._D[1] = alpha, beta
        self._gemv(CHAR[ta], i[0], i[1], self._DA, a, i[2], x, i[3], self._DA + self.itemsize,
                   y, i[4])

    def ger(self, m: int, n: int, alpha: float, x: int, incx: int, y: int, incy: int,
            a: int, lda: int) -> None:
        """A(m, n) += alpha x y^T."""
        if m <= 0 or n <= 0:
            return
        I, i = self._I, self._i
        I[0], I[1], I[2], I[3], I[4] = m, n, incx, incy, max(lda, 1)
        self._D[0] = alpha
        self._ger(i[0], i[1], self._DA, x, i[2], y, i[3], a, i[4])

    def scal(self, n: int, alpha: float, x: int, incx: int) -> None:
        if n <= 0:
            return
        self._I[0], self._I[1] = n, incx
        self._D[0] = alpha
        self._scal(self._i[0], self._DA, x, self._i[1])

    def swap(self, n: int, x: int, incx: int, y: int, incy: int) -> None:
        if n <= 0:
            return
        self._I[0], self._I[1], self._I[2] = n, incx, incy
        self._swap(self._i[0], x, self._i[1], y, self._i[2])

    def copy(self, n: int, x: int, incx: int, y: int, incy: int) -> None:
        if n <= 0:
            return
        self._I[0], self._I[1], self._I[2] = n, incx, incy
        self._copy(self._i[0], x, self._i[1], y, self._i[2])

    def iamax(self, n: int, x: int, incx: int) -> int:
        """0-based index of the first entry of largest magnitude (-1 when n == 0)."""
        if n <= 0:
            return -1
        self._I[0], self._I[1] = n, incx
        return self._iamax(self._i[0], x, self._i[1]) - 1

    def laswp(self, n: int, a: int, lda: int, k1: int, k2: int, ipiv: np.ndarray) -> None:
        """Apply row interchanges ``k1..k2`` (1-based, as LAPACK) of ``ipiv`` (int32,
        1-based rows relative to ``a``) to the ``n`` columns of ``a``."""
        if n <= 0 or k2 < k1:
            return
        I, i = self._I, self._i
        I[0], I[1], I[2], I[3], I[4] = n, max(lda, 1), k1, k2, 1
        self._laswp(i[0], a, i[1], i[2], i[3], addr(ipiv), i[4])


DOUBLE = Routines("d")
SINGLE = Routines("s")


def for_dtype(dtype) -> Routines:
    """The routines for ``dtype`` (float64 or float32); ValueError for any other."""
    dt = np.dtype(dtype)
    if dt == DOUBLE.dtype:
        return DOUBLE
    if dt == SINGLE.dtype:
        return SINGLE
    raise ValueError(f"BLAS by address supports float64 and float32, got {dt}")


# float64, by the BLAS names (the LU of hpcmac.hpl and its tests call these)
dgemm, dtrsm, dtrsv, dgemv, dger = DOUBLE.gemm, DOUBLE.trsm, DOUBLE.trsv, DOUBLE.gemv, DOUBLE.ger
dscal, dswap, dcopy, idamax, dlaswp = (DOUBLE.scal, DOUBLE.swap, DOUBLE.copy, DOUBLE.iamax,
                                       DOUBLE.laswp)
