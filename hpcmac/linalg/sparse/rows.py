"""Row partitions of a sparse matrix: contiguous half-open ranges, one per rank. Pure.

A partition is the tuple ``starts`` of length ``size + 1``: rank r owns the
global rows ``[starts[r], starts[r + 1])``. Ranks may own no rows.
"""

from __future__ import annotations

import numpy as np


def even(n: int, size: int) -> tuple[int, ...]:
    """Rows split as evenly as possible, the first ``n % size`` ranks one longer (BlockVector's)."""
    base, extra = divmod(n, size)
    return tuple(r * base + min(r, extra) for r in range(size + 1))


def by_nonzeros(row_nnz: np.ndarray, size: int) -> tuple[int, ...]:
    """Contiguous ranges whose weights (nonzeros + 1 per row) are as equal as possible.

    ``row_nnz`` holds the nonzero count of every global row. The ``+ 1`` makes
    empty rows cost something, so a matrix with no entries splits like ``even``.
    """
    n = int(row_nnz.size)
    if n == 0:
        return (0,) * (size + 1)
    cum = np.cumsum(np.asarray(row_nnz, dtype=np.int64) + 1)
    total = int(cum[-1])
    targets = (np.arange(1, size) * total) / size
    inner = np.searchsorted(cum, targets, side="left") + 1
    inner = np.minimum(np.maximum.accumulate(inner), n)
    return (0, *(int(i) for i in inner), n)


def from_counts(counts) -> tuple[int, ...]:
    """Starts from each rank's row count."""
    return (0, *(int(c) for c in np.cumsum(np.asarray(counts, dtype=np.int64))))


def check(starts, n: int, size: int, what: str = "row_starts") -> tuple[int, ...]:
    """``starts`` validated against ``n`` rows and ``size`` ranks; ValueError naming ``what``."""
    s = tuple(int(v) for v in starts)
    if len(s) != size + 1 or s[0] != 0 or s[-1] != n or any(b < a for a, b in zip(s, s[1:])):
        raise ValueError(f"{what} must be {size + 1} non-decreasing integers from 0 to {n}, "
                         f"got {list(s)}")
    return s


def owners(starts, index: np.ndarray) -> np.ndarray:
    """The rank owning each global ``index`` under ``starts``."""
    return np.searchsorted(np.asarray(starts[1:]), index, side="right").astype(np.int64)
