"""netlib HPL's matrix generator against the formula, and the N=4000 norms netlib prints."""

import numpy as np
import pytest
import scipy.linalg

from hpcmac.comm.grid import Grid
from hpcmac.comm.local import LocalGroup
from hpcmac.hpl import matgen
from hpcmac.linalg import layout


def netlib_formula(n: int, count: int) -> np.ndarray:
    """The first ``count`` entries (column-major) straight from the LCG, in Python ints.

    x[0] = 100, x[k+1] = (6364136223846793005 x[k] + 1) mod 2^64, entry = 0.5 - x/2^64
    computed as netlib's HPL_rand does: 0.5 - (hi + lo/2^32)/2^32.
    """
    x, out = 100, []
    for _ in range(count):
        x = (6364136223846793005 * x + 1) % 2**64
        out.append(0.5 - ((x & 0xFFFFFFFF) / 2**31 * 0.5 + (x >> 32)) / 2**31 * 0.5)
    return np.array(out)


def test_entries_equal_formula_bitwise():
    n = 9
    want = netlib_formula(n, n * (n + 1)).reshape(n + 1, n).T  # column-major, b last
    got = matgen.entries(np.arange(n), np.arange(n + 1), n)
    assert got.flags.f_contiguous
    np.testing.assert_array_equal(got, want)


def test_far_entries_by_jump_ahead_equal_stepping():
    # entry (i, j) of an N=1000 matrix uses x[1 + i + j*N]: step there one by one
    n, i, j = 1000, 517, 733
    k = 1 + i + j * n
    x = 100
    for _ in range(k):
        x = (6364136223846793005 * x + 1) % 2**64
    want = 0.5 - ((x & 0xFFFFFFFF) / 2**31 * 0.5 + (x >> 32)) / 2**31 * 0.5
    assert matgen.entries(np.array([i]), np.array([j]), n)[0, 0] == want
    assert int(matgen.lcg_states(np.array([k]))[0]) == x


def test_jump_coefficients_compose():
    a, c = matgen.jump_coefficients(np.array([0, 1, 2, 5]))
    assert int(a[0]) == 1 and int(c[0]) == 0
    assert int(a[1]) == matgen.MULT and int(c[1]) == matgen.IADD
    m = matgen.MULT
    assert int(a[2]) == (m * m) % 2**64 and int(c[2]) == (m + 1) % 2**64
    with pytest.raises(ValueError):
        matgen.jump_coefficients(np.array([-1]))


def test_entries_in_netlib_range():
    v = matgen.entries(np.arange(50), np.arange(51), 50)
    assert v.min() > -0.5 and v.max() <= 0.5


@pytest.mark.parametrize("p, q, n, nb", [(2, 2, 23, 4), (1, 3, 10, 4), (3, 1, 5, 8)])
def test_blocks_of_every_grid_position_assemble_the_matrix(p, q, n, nb):
    full = matgen.entries(np.arange(n), np.arange(n + 1), n)
    out = np.full((n, n + 1), np.nan)
    for pr in range(p):
        for pc in range(q):
            rows = layout.global_indices(n, nb, pr, p)
            cols = layout.global_indices(n + 1, nb, pc, q)
            out[np.ix_(rows, cols)] = matgen.entries(rows, cols, n)
    np.testing.assert_array_equal(out, full)


def test_generate_on_one_rank_is_the_whole_matrix():
    grid = Grid(LocalGroup(), 1, 1)
    a = matgen.generate(13, 5, grid)
    assert a.gshape == (13, 14) and (a.mb, a.nb) == (5, 5)
    np.testing.assert_array_equal(a.local, matgen.entries(np.arange(13), np.arange(14), 13))


def test_netlib_norms_at_n4000():
    """netlib HPL prints ||A||_oo = 1032.941422, ||x||_oo = 4.514803, ||b||_oo = 0.499822."""
    n = 4000
    m = matgen.entries(np.arange(n), np.arange(n + 1), n)
    a, b = m[:, :n], m[:, n]
    assert f"{np.abs(a).sum(axis=1).max():.6f}" == "1032.941422"
    assert f"{np.abs(b).max():.6f}" == "0.499822"
    x = scipy.linalg.solve(a, b)
    assert f"{np.abs(x).max():.6f}" == "4.514803"
