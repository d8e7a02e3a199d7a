"""Row partitions of sparse matrices: pure index math."""

import numpy as np
import pytest

from hpcmac.linalg.sparse import rows
from hpcmac.linalg.sparse.ghost import row_entries


def test_even_matches_blockvector():
    from hpcmac.linalg.vectors import block_range

    for n, p in ((10, 3), (2, 4), (0, 2)):
        s = rows.even(n, p)
        assert [(s[r], s[r + 1]) for r in range(p)] == [block_range(n, p, r) for r in range(p)]


def test_by_nonzeros_balances_weight():
    nnz = np.array([100] * 4 + [1] * 396)
    s = rows.by_nonzeros(nnz, 2)
    w = np.cumsum(nnz + 1)
    assert s[0] == 0 and s[-1] == 400 and s[1] < 200
    assert abs(w[s[1] - 1] - (w[-1] - w[s[1] - 1])) <= 101
    assert rows.by_nonzeros(np.zeros(0, dtype=int), 3) == (0, 0, 0, 0)
    assert rows.by_nonzeros(np.zeros(5, dtype=int), 2) == (0, 3, 5)
    assert rows.by_nonzeros(np.ones(2, dtype=int), 4)[-1] == 2


def test_owners_skip_empty_ranks_and_check():
    s = (0, 0, 3, 3, 7)
    assert rows.owners(s, np.array([0, 2, 3, 6])).tolist() == [1, 1, 3, 3]
    with pytest.raises(ValueError, match="row_starts must be 5 non-decreasing"):
        rows.check((0, 3, 2, 7, 7), 7, 4)


def test_row_entries():
    ptr = np.array([0, 2, 2, 5, 6])
    assert row_entries(ptr, np.array([2, 0, 1, 3])).tolist() == [2, 3, 4, 0, 1, 5]
    assert row_entries(ptr, np.array([1])).size == 0
