"""P1 finite elements on the unit square: the mesh and the element kernels both scripts share.

The mesh is scikit-fem's ``MeshTri`` refined k times, in effect: an n x n
grid of squares (n = 2^k), each cut into two triangles. Everything here is
pure numpy and takes *index ranges*, so the distributed script asks only for
its own triangles.
"""

import numpy as np


def points(n: int) -> np.ndarray:
    """(2, (n+1)^2) node coordinates, node (i, j) at index j * (n + 1) + i."""
    x = np.linspace(0.0, 1.0, n + 1)
    X, Y = np.meshgrid(x, x)
    return np.vstack([X.ravel(), Y.ravel()])


def triangles(n: int, lo: int = 0, hi: int | None = None) -> np.ndarray:
    """(3, hi - lo) node indices of triangles [lo, hi) of the 2 n^2 (two per square)."""
    hi = 2 * n * n if hi is None else hi
    e = np.arange(lo, hi)
    sq, upper = e // 2, e % 2
    i, j = sq % n, sq // n
    a = j * (n + 1) + i                       # the square's lower-left node
    b, c, d = a + 1, a + n + 2, a + n + 1     # lower-right, upper-right, upper-left
    return np.where(upper == 0, np.vstack([a, b, c]), np.vstack([a, c, d]))


def interior(n: int) -> np.ndarray:
    """Boolean mask of the nodes not on the boundary."""
    i = np.arange(n + 1)
    inside = (i > 0) & (i < n)
    return (inside[None, :] & inside[:, None]).ravel()


def p1_elements(p: np.ndarray, t: np.ndarray):
    """Element stiffness (laplace) and unit-load vectors: ((E, 3, 3), (E, 3))."""
    x, y = p[0][t], p[1][t]                    # (3, E) vertex coordinates
    det = (x[1] - x[0]) * (y[2] - y[0]) - (x[2] - x[0]) * (y[1] - y[0])
    area = 0.5 * np.abs(det)
    # gradients of the barycentric coordinates: (E, 3 vertices, 2)
    gx = np.stack([y[1] - y[2], y[2] - y[0], y[0] - y[1]], axis=1) / det[:, None]
    gy = np.stack([x[2] - x[1], x[0] - x[2], x[1] - x[0]], axis=1) / det[:, None]
    K = area[:, None, None] * (gx[:, :, None] * gx[:, None, :] + gy[:, :, None] * gy[:, None, :])
    f = np.repeat(area[:, None] / 3.0, 3, axis=1)
    return K, f
