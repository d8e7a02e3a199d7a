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
and columns with numpy's wrapping uint64 arithmetic. Generation is in place and
blocked (:func:`column_blocks`): a few columns at a time through a cache-sized
scratch buffer, so a rank never holds more than its piece plus O(rows) extra,
and the residual check can regenerate A block by block without storing it.
Nothing here communicates.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

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
# bytes of uint64 scratch per block of columns (cache-sized: the block is converted while hot)
_SCRATCH = 1 << 20


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


def _to_double_into(x: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = lcg_to_double(x)`` without temporaries the size of ``x``.

    The 32-bit halves are read as uint32 views (a uint64 -> float64 cast is a slow
    scalar loop in numpy; uint32 -> float64 is exact and vectorised). ``x`` is C-ordered
    with a contiguous last axis; ``out`` has its shape.
    """
    if _LITTLE:
        x32 = x.view(np.uint32)  # (..., 2 k): low half first
        lo, hi = x32[..., 0::2], x32[..., 1::2]
    else:  # pragma: no cover - no big-endian platform runs hpcmac today
        lo, hi = x & _U64(0xFFFFFFFF), x >> _U64(32)
    np.multiply(lo, 2.0**-32, out=out)  # exact
    np.add(out, hi, out=out)  # hi + lo / 2**32: HPL_rand's one rounding
    np.multiply(out, -(2.0**-32), out=out)  # exact
    np.add(out, 0.5, out=out)  # 0.5 - v / 2**32: the second rounding


_LITTLE = sys.byteorder == "little"


def column_blocks(
    rows: np.ndarray, cols: np.ndarray, m: int, seed: int = SEED,
    out: np.ndarray | None = None, width: int | None = None,
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Entries (rows x cols) of netlib's M-row matrix, a few columns at a time.

    Yields ``(j0, j1, block)`` for consecutive column ranges of ``cols``; ``block``
    is the (len(rows), j1 - j0) float64 piece. With ``out`` (len(rows) x len(cols),
    any strides) the blocks are views of ``out``, which ends up holding every entry;
    without it each block lives in one reused buffer (valid until the next one). Either
    way the only other storage is O(len(rows) * width) (``width`` defaults to what
    keeps the uint64 scratch near 1 MiB, at least one column).

    Each entry is one uint64 multiply-add from its column's first state (the LCG
    jumped ahead to column j, times the row's jump-ahead coefficients), then
    ``HPL_rand``'s conversion, vectorised over the block.
    """
    rows = np.asarray(rows, dtype=np.int64).ravel()
    cols = np.asarray(cols, dtype=np.int64).ravel()
    lm, ln = rows.size, cols.size
    if out is not None and out.shape != (lm, ln):
        raise ValueError(f"out has shape {out.shape}, expected {(lm, ln)}")
    if lm == 0 or ln == 0:
        return
    if width is None:
        width = max(1, _SCRATCH // (8 * lm))
    width = max(1, min(int(width), ln))
    # x[1 + i + j*m] = A_i * x[1 + j*m] + C_i
    ra, rc = jump_coefficients(rows)  # (lm,)
    colstart = lcg_states(1 + cols * m, seed)  # (ln,)
    xbuf = np.empty((width, lm), dtype=_U64)  # (c, lm): transposed, rows contiguous
    own = np.empty((lm, width), dtype=np.float64, order="F") if out is None else None
    with np.errstate(over="ignore"):
        for j0 in range(0, ln, width):
            j1 = min(j0 + width, ln)
            x = xbuf[: j1 - j0]  # (c, lm)
            np.multiply(colstart[j0:j1, None], ra[None, :], out=x)
            np.add(x, rc[None, :], out=x)
            block = out[:, j0:j1] if out is not None else own[:, : j1 - j0]  # (lm, c)
            _to_double_into(x, block.T)
            yield j0, j1, block


def fill(out: np.ndarray, rows: np.ndarray, cols: np.ndarray, m: int, seed: int = SEED) -> None:
    """In place: ``out[:, :] = entries(rows, cols, m, seed)`` with O(len(rows)) scratch."""
    for _ in column_blocks(rows, cols, m, seed, out=out):
        pass


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
    fill(out, rows, cols, m, seed)
    return out


def generate(n: int, nb: int, grid: Grid, seed: int = SEED) -> DistMatrix:
    """Not collective: this rank's blocks of netlib's N x (N+1) [A | b], NB x NB blocks.

    Ranks outside the grid get an empty piece. The result is what netlib's
    ``HPL_pdmatgen(GRID, N, N+1, NB, ...)`` stores on the same grid position.
    """
    a = DistMatrix.empty((n, n + 1), grid, nb, nb)
    if a.local.size:
        fill(a.local, a.rows, a.cols, n, seed)  # in place: no second copy of the piece
    return a
