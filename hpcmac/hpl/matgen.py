"""Netlib HPL's random matrix: the same N gives the same [A | b] as ``xhpl``.

Netlib HPL (``HPL_pdmatgen`` with seed ``HPL_ISEED`` = 100) fills the
N x (N+1) matrix [A | b] column-major from one 64-bit linear congruential
sequence::

    x[0] = 100,   x[k+1] = (6364136223846793005 * x[k] + 1) mod 2**64
    entry (i, j) = 0.5 - x[1 + i + j*N] / 2**64        (0-based, column N is b)

The multiplier is netlib's ``HPL_MULT1 * 2**32 + HPL_MULT0``. Netlib's
``HPL_rand`` forms the value as ``0.5 - (hi + lo / 2**32) / 2**32`` with the
32-bit halves of x; :func:`lcg_to_double` does the same floating-point
operations in the same order, so the doubles are bit-identical.

Each rank generates only its own blocks: the state at any position is reached
by jumping ahead (``x[k+m] = A_m x[k] + C_m``), vectorised over the local rows
and columns with numpy's wrapping uint64 arithmetic. Nothing here communicates.
"""

from __future__ import annotations

import numpy as np

from hpcmac.comm.grid import Grid
from hpcmac.linalg.distmatrix import DistMatrix

#: netlib's HPL_MULT1 * 2**32 + HPL_MULT0
MULT = 6364136223846793005
#: netlib's HPL_IADD1 * 2**32 + HPL_IADD0
IADD = 1
#: netlib's HPL_ISEED
SEED = 100

_MASK64 = (1 << 64) - 1
_U64 = np.uint64
# columns generated per chunk: bounds the uint64 temporaries to ~lm*_CHUNK*16 bytes
_CHUNK = 256


def _jump_tables() -> tuple[np.ndarray, np.ndarray]:
    """(A_{2^b}, C_{2^b}) for b = 0..63: the map that jumps 2^b steps."""
    a, c = MULT, IADD
    amul, cadd = [], []
    for _ in range(64):
        amul.append(a)
        cadd.append(c)
        a, c = (a * a) & _MASK64, (a * c + c) & _MASK64
    return np.array(amul, dtype=_U64), np.array(cadd, dtype=_U64)


_AMUL, _CADD = _jump_tables()


def jump_coefficients(steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Elementwise (A, C) with ``x[k + steps] = A * x[k] + C`` (mod 2**64).

    Parameters
    ----------
    steps : integer array (local), each >= 0.

    Returns
    -------
    (a, c) : uint64 arrays with the shape of ``steps``.
    """
    steps = np.asarray(steps, dtype=np.int64)
    if steps.size and steps.min() < 0:
        raise ValueError("jump distances must be >= 0")
    s = steps.astype(_U64)
    a = np.ones_like(s)
    c = np.zeros_like(s)
    one = _U64(1)
    with np.errstate(over="ignore"):
        for b in range(64):
            if not (s >> _U64(b)).any():
                break
            hit = ((s >> _U64(b)) & one).astype(bool)
            # compose: first the jump so far, then 2^b more steps (they commute)
            a = np.where(hit, a * _AMUL[b], a)
            c = np.where(hit, c * _AMUL[b] + _CADD[b], c)
    return a, c


def lcg_states(positions: np.ndarray, seed: int = SEED) -> np.ndarray:
    """The sequence values ``x[positions]`` (uint64, same shape), ``x[0] = seed``."""
    a, c = jump_coefficients(positions)
    with np.errstate(over="ignore"):
        return a * _U64(seed) + c


def lcg_to_double(x: np.ndarray) -> np.ndarray:
    """Netlib's ``HPL_rand`` value of states ``x``: ``0.5 - x / 2**64`` in (-0.5, 0.5]."""
    hi = (x >> _U64(32)).astype(np.float64)
    lo = (x & _U64(0xFFFFFFFF)).astype(np.float64)
    # same operations, same order as HPL_rand: one rounding in the sum, one in the difference
    return 0.5 - (hi + lo * 2.0**-32) * 2.0**-32


def entries(rows: np.ndarray, cols: np.ndarray, m: int, seed: int = SEED) -> np.ndarray:
    """Entries (rows x cols) of netlib's M-row matrix, Fortran order.

    Parameters
    ----------
    rows : 1-D int array of global row indices (local; any order).
    cols : 1-D int array of global column indices (local; any order).
    m : global number of rows (N for HPL's [A | b]); the column stride of the sequence.
    seed : x[0] (netlib: 100).

    Returns
    -------
    float64 array (len(rows), len(cols)), Fortran-ordered.
    """
    rows = np.asarray(rows, dtype=np.int64).ravel()
    cols = np.asarray(cols, dtype=np.int64).ravel()
    out = np.empty((rows.size, cols.size), dtype=np.float64, order="F")
    if out.size == 0:
        return out
    # x[1 + i + j*m] = A_i * x[1 + j*m] + C_i
    ra, rc = jump_coefficients(rows)  # (lm,)
    colstart = lcg_states(1 + cols * m, seed)  # (ln,)
    with np.errstate(over="ignore"):
        for j0 in range(0, cols.size, _CHUNK):
            j1 = min(j0 + _CHUNK, cols.size)
            x = ra[:, None] * colstart[None, j0:j1] + rc[:, None]  # (lm, chunk) uint64
            out[:, j0:j1] = lcg_to_double(x)
    return out


def generate(n: int, nb: int, grid: Grid, seed: int = SEED) -> DistMatrix:
    """Not collective: this rank's blocks of netlib's N x (N+1) [A | b], NB x NB blocks.

    Ranks outside the grid get an empty piece. The result is what netlib's
    ``HPL_pdmatgen(GRID, N, N+1, NB, ...)`` stores on the same grid position.
    """
    a = DistMatrix.empty((n, n + 1), grid, nb, nb)
    if a.local.size:
        a.local[...] = entries(a.rows, a.cols, n, seed)
    return a
