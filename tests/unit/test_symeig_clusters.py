"""Pure parts of the distributed eigensolver: clusters and the stemr call ranges."""

import numpy as np
import scipy.linalg as sl

from hpcmac.linalg.symeig import _calls, clusters


def test_clusters_group_close_eigenvalues():
    w = np.array([1.0, 1.0 + 1e-9, 2.0, 5.0, 5.0, 5.0, 9.0])
    assert clusters(w).tolist() == [0, 0, 1, 2, 2, 2, 3]
    assert clusters(np.zeros(0)).size == 0


def test_calls_compute_every_reaching_out_cluster_whole_and_alone():
    cid = np.array([0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 3])
    assert _calls(0, 3, cid) == [(0, 4)]                  # run inside cluster 0
    assert _calls(4, 7, cid) == [(0, 4), (5, 5), (6, 9)]  # head, middle, tail
    assert _calls(5, 10, cid) == [(5, 10)]                # whole clusters: one call
    assert _calls(1, 2, cid) == [(0, 4)]                  # cluster sticks out both sides
    # every index g0..g1 is covered, ranges do not overlap
    for g0 in range(11):
        for g1 in range(g0, 11):
            got = _calls(g0, g1, cid)
            covered = sorted(i for a, b in got for i in range(a, b + 1))
            assert covered == sorted(set(covered)) and set(range(g0, g1 + 1)) <= set(covered)


def test_separate_calls_on_a_degenerate_tridiagonal_are_orthogonal():
    """The reason for _calls: vectors of one cluster from two different calls are not."""
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((20, 20)))
    a = q @ np.diag(np.repeat([1.0, 2.0, 5.0, 9.0], 5)) @ q.T
    d, e = np.diag(sl.hessenberg(a)), np.diag(sl.hessenberg(a), -1)
    cid = clusters(sl.eigvalsh_tridiagonal(d, e))
    parts = []
    for g0 in range(0, 20, 4):                            # runs of 4 cut clusters of 5
        g1 = g0 + 3
        for c0, c1 in _calls(g0, g1, cid):
            vec = sl.eigh_tridiagonal(d, e, select="i", select_range=(c0, c1),
                                      lapack_driver="stemr")[1]
            a0, a1 = max(c0, g0), min(c1, g1)
            parts.append(vec[:, a0 - c0: a1 - c0 + 1])
    z = np.hstack(parts)
    assert np.abs(z.T @ z - np.eye(20)).max() < 1e-12
