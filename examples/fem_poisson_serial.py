"""-Laplace u = 1 on the unit square, u = 0 on its boundary, by P1 finite elements: SERIAL.

    python examples/fem_poisson_serial.py --n 64

Written after scikit-fem's first example (kinnala/scikit-fem,
docs/examples/ex01.py: ``MeshTri`` refined, ``ElementTriP1``, ``laplace`` and
unit ``load`` assembled, ``solve(*condense(A, b, I=m.interior_nodes()))``),
with the assembly spelled out in numpy/scipy so nothing but scipy is
needed: element matrices, one ``coo_matrix`` (duplicates summed), the
interior rows and columns kept, ``scipy.sparse.linalg.cg``.
"""

import argparse

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as sla
from fem_mesh import interior, p1_elements, points, triangles


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="squares per side (two triangles each)")
    ap.add_argument("--rtol", type=float, default=1e-10)
    args = ap.parse_args(argv)
    n = args.n
    p, t = points(n), triangles(n)
    K, f = p1_elements(p, t)
    rows = np.repeat(t.T, 3, axis=1).ravel()                   # (E*9,) row of each entry
    cols = np.tile(t.T, (1, 3)).ravel()
    N = p.shape[1]
    A = sp.coo_matrix((K.ravel(), (rows, cols)), shape=(N, N)).tocsr()
    b = np.bincount(t.T.ravel(), weights=f.ravel(), minlength=N)
    inner = np.flatnonzero(interior(n))
    AI, bI = A[inner][:, inner], b[inner]                      # condense(A, b, I=...)
    its = [0]
    uI, info = sla.cg(AI, bI, rtol=args.rtol,
                      callback=lambda _: its.__setitem__(0, its[0] + 1))
    assert info == 0, info
    u = np.zeros(N)
    u[inner] = uI
    print(f"n={n} dofs={inner.size} cg_iterations={its[0]} u_max={u.max():.10f}")
    return {"u": u, "u_max": float(u.max()), "iterations": its[0]}


if __name__ == "__main__":
    main()
