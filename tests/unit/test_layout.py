"""Block-cyclic index math against brute-force enumeration (no MPI)."""

import numpy as np
import pytest

from hpcmac.io.hdf5 import _runs
from hpcmac.linalg import layout
from hpcmac.linalg.vectors import block_range

CASES = [(n, nb, p) for n in (0, 1, 7, 16, 23) for nb in (1, 3, 4, 8, 30) for p in (1, 2, 3, 4)]


def brute_owner(n, nb, p):
    """(owner, local index) of every global index, by dealing blocks out in turn."""
    own, loc = np.empty(n, int), np.empty(n, int)
    count = [0] * p
    for g in range(n):
        r = (g // nb) % p
        own[g], loc[g] = r, count[r]
        count[r] += 1
    return own, loc, count


@pytest.mark.parametrize("n,nb,p", CASES)
def test_numroc_owner_g2l_l2g(n, nb, p):
    own, loc, count = brute_owner(n, nb, p)
    assert [layout.numroc(n, nb, r, p) for r in range(p)] == count
    g = np.arange(n)
    assert np.array_equal(layout.owner(g, nb, p), own)
    assert np.array_equal(layout.g2l(g, nb, p), loc)
    for r in range(p):
        mine = g[own == r]
        assert np.array_equal(layout.global_indices(n, nb, r, p), mine)
        assert np.array_equal(layout.l2g(np.arange(mine.size), nb, r, p), mine)


@pytest.mark.parametrize("n,nb,p", CASES)
def test_first_local_at_or_after(n, nb, p):
    own, _, _ = brute_owner(n, nb, p)
    for r in range(p):
        mine = np.flatnonzero(own == r)
        for g in range(n + 1):
            expect = int(np.searchsorted(mine, g))
            assert layout.first_local_at_or_after(g, nb, r, p) == expect


@pytest.mark.parametrize("n,nb,p", CASES)
def test_hdf5_hyperslab_runs_cover_exactly_my_indices(n, nb, p):
    for r in range(p):
        got = []
        for start, stride, count, block in _runs(n, nb, r, p):
            for c in range(count):
                got.extend(range(start + c * stride, start + c * stride + block))
        assert got == list(layout.global_indices(n, nb, r, p))


@pytest.mark.parametrize("n,size", [(0, 1), (5, 1), (5, 2), (7, 4), (3, 4), (100, 3)])
def test_block_range_partitions(n, size):
    ranges = [block_range(n, size, r) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    lens = [b - a for a, b in ranges]
    assert max(lens) - min(lens) <= 1


def test_lshape_tiles_the_matrix():
    for m, n, mb, nb, p, q in [(7, 5, 2, 3, 2, 2), (16, 9, 4, 4, 3, 1), (1, 30, 5, 7, 1, 4)]:
        shapes = [[layout.lshape((m, n), mb, nb, i, j, p, q) for j in range(q)] for i in range(p)]
        assert sum(shapes[i][0][0] for i in range(p)) == m
        assert sum(shapes[0][j][1] for j in range(q)) == n
        assert all(shapes[i][j] == (shapes[i][0][0], shapes[0][j][1])
                   for i in range(p) for j in range(q))
