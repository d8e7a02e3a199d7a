"""Shared helpers for the linalg MPI tests (not a test module)."""

import numpy as np

from hpcmac.comm.grid import Grid
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.testing import world

DTYPES = [np.float64, np.float32, np.complex128]


def tol(dtype) -> float:
    return 2e-4 if np.dtype(dtype) == np.float32 else 1e-10


def grids(size, limit=None):
    """Grid shapes that fit ``size`` ranks, the full ones first (a few at most)."""
    shapes = [(p, q) for p in range(1, size + 1) for q in range(1, size + 1) if p * q <= size]
    shapes.sort(key=lambda s: (-s[0] * s[1], s))
    return shapes[:limit] if limit else shapes


def each_grid(limit=None):
    g = world()
    for p, q in grids(g.size, limit):
        yield g, Grid(g, p, q)


def grid_at(index):
    """Collective: the ``index``-th grid shape that fits (pytest.skip when there is none)."""
    import pytest

    g = world()
    shapes = grids(g.size)
    if index >= len(shapes):
        pytest.skip("fewer grid shapes at this rank count")
    return Grid(g, *shapes[index])


def rand(rng, shape, dtype):
    a = rng.standard_normal(shape)
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        a = a + 1j * rng.standard_normal(shape)
    return a.astype(dtype)


def spd(rng, n, dtype):
    x = rand(rng, (n, n), dtype)
    return (x @ x.conj().T / n + np.eye(n)).astype(dtype)


def dist(a, grid, mb, nb):
    """Not collective: ``a`` (the same on every rank) as a DistMatrix, no scatter."""
    return DistMatrix.from_function(lambda i, j: a[i, j], a.shape, grid, mb, nb, a.dtype)


def same_error_everywhere(group, fn, exc_type):
    """Collective: ``fn()`` raises ``exc_type`` on every rank with the same message; returns it."""
    try:
        fn()
        msg = None
    except exc_type as exc:
        msg = str(exc)
    msgs = group.allgather_obj(msg)
    assert all(m is not None for m in msgs), f"not raised on every rank: {msgs}"
    assert len(set(msgs)) == 1, f"different messages: {msgs}"
    return msgs[0]
