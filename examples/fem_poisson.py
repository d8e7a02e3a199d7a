"""-Laplace u = 1 on the unit square, u = 0 on its boundary, by P1 finite elements: DISTRIBUTED.

    mpirun -np 4 python examples/fem_poisson.py --n 64

The port of fem_poisson_serial.py by docs/porting.md: each rank computes the
element matrices of its own block of triangles only, and hands the entries
to ``assemble`` by global index (as PETSc's MatSetValues with ADD_VALUES):
entries of rows another rank owns travel there and duplicates add up. The
load vector goes through ``assemble_vector`` the same way. Then ``cg`` with the AMG
preconditioner. Only rank 0 prints.
"""

import argparse

import numpy as np
from fem_mesh import interior, p1_elements, points, triangles

from hpcmac import comm
from hpcmac.errors import UsageError
from hpcmac.linalg.sparse import assemble, assemble_vector, cg
from hpcmac.linalg.vectors import block_range


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="squares per side (two triangles each)")
    ap.add_argument("--rtol", type=float, default=1e-10)
    ap.add_argument("--M", default="amg", choices=["amg", "jacobi", "none"],
                    help="preconditioner")
    args = ap.parse_args(argv)
    if not (args.n >= 2 and 0 < args.rtol < 1):
        raise UsageError(f"expected --n >= 2 and 0 < --rtol < 1, found {args.n}, {args.rtol}")
    world = comm.init()
    n = args.n
    p = points(n)
    lo, hi = block_range(2 * n * n, world.size, world.rank)   # my triangles
    t = triangles(n, lo, hi)
    K, f = p1_elements(p, t)
    inside = interior(n)
    number = np.cumsum(inside) - 1                             # node -> interior unknown
    NI = int(inside.sum())
    rows = np.repeat(t.T, 3, axis=1).ravel()
    cols = np.tile(t.T, (1, 3)).ravel()
    keep = inside[rows] & inside[cols]                         # condense: interior x interior
    A = assemble(number[rows[keep]], number[cols[keep]], K.ravel()[keep], (NI, NI), world)
    node = t.T.ravel()
    on = inside[node]
    b = assemble_vector(number[node[on]], f.ravel()[on], NI, world, row_starts=A.row_starts)
    res = cg(A, b, rtol=args.rtol, M=None if args.M == "none" else args.M)
    if res.info != 0:
        raise RuntimeError(f"cg did not converge (info {res.info})")
    u_max = world.allreduce(np.array([res.x.local.max(initial=0.0)]), op="max")[0]
    if world.rank == 0:
        print(f"n={n} dofs={NI} cg_iterations={res.iterations} u_max={u_max:.10f} "
              f"ranks={world.size}")
    u = np.zeros(p.shape[1])
    u[inside] = res.x.allgather()
    return {"u": u, "u_max": float(u_max), "iterations": res.iterations}


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    def _cli(argv):
        main(argv)
        return 0

    raise SystemExit(run_cli(_cli))
