"""The 2-D heat equation, implicit Euler, each step solved by CG: the DISTRIBUTED version.

    mpirun -np 2 python examples/heat_cg.py --n 64 --steps 5

Same problem as heat_serial.py. Each rank owns a slab of grid rows (a
BlockVector piece: rows [r0, r1) times all n columns); the matvec swaps one
halo row with each neighbour through hpcmac.comm, then applies the same
stencil. Only rank 0 prints.
"""

import argparse

import numpy as np

from hpcmac import comm
from hpcmac.errors import UsageError
from hpcmac.linalg import BlockVector, cg, jacobi
from hpcmac.linalg.vectors import block_range


def halo_matvec(group, n: int, rows: int, h: float, dt: float):
    """``v_local -> ((I - dt * Laplace) v)_local`` on this rank's ``rows`` x ``n`` slab."""
    up, down = group.rank - 1, group.rank + 1          # neighbours owning the rows above / below
    has_up = up >= 0 and block_range(n, group.size, up)[1] > block_range(n, group.size, up)[0]
    has_down = down < group.size and block_range(n, group.size, down)[1] > \
        block_range(n, group.size, down)[0]

    def matvec(v_local: np.ndarray) -> np.ndarray:
        v = v_local.reshape(rows, n)
        p = np.zeros((rows + 2, n + 2))                   # slab plus halo rows and boundary
        p[1:-1, 1:-1] = v
        reqs = []
        if rows and has_up:
            reqs += [group.isend(np.ascontiguousarray(v[0]), up, 1),
                     group.irecv(p[0, 1:-1], up, 2)]
        if rows and has_down:
            reqs += [group.isend(np.ascontiguousarray(v[-1]), down, 2),
                     group.irecv(p[-1, 1:-1], down, 1)]
        for r in reqs:
            r.wait()
        lap = (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * v) / h**2
        return (v - dt * lap).ravel()

    return matvec


def modes(y, x, h, dt, steps):
    """u (rows y, columns x) after ``steps`` implicit Euler steps from
    sin(pi x) sin(pi y) + 0.5 sin(5 pi x) sin(3 pi y)."""
    u = 0.0
    for p, q, amp in ((1, 1, 1.0), (5, 3, 0.5)):
        lam = 4 / h**2 * (np.sin(p * np.pi * h / 2) ** 2 + np.sin(q * np.pi * h / 2) ** 2)
        shape = np.outer(np.sin(q * np.pi * y), np.sin(p * np.pi * x))
        u = u + amp * (1 + dt * lam) ** -steps * shape
    return u


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="interior points per side")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dt", type=float, default=1e-3)
    ap.add_argument("--rtol", type=float, default=1e-10)
    ap.add_argument("--jacobi", action="store_true", help="Jacobi preconditioner")
    args = ap.parse_args(argv)
    if not (args.n >= 1 and args.steps >= 0 and 0 < args.dt < float("inf")
            and 0 < args.rtol < 1):
        raise UsageError(f"expected --n >= 1, --steps >= 0, --dt > 0 and 0 < --rtol < 1, "
                         f"found {args.n}, {args.steps}, {args.dt}, {args.rtol}")
    world = comm.init()
    n, dt = args.n, args.dt
    h = 1.0 / (n + 1)
    r0, r1 = block_range(n, world.size, world.rank)   # my grid rows
    y = np.arange(r0 + 1, r1 + 1) * h
    x = np.arange(1, n + 1) * h
    u = BlockVector.from_local(modes(y, x, h, dt, 0).ravel(), world)
    op = halo_matvec(world, n, r1 - r0, h, dt)
    diag = 1 + dt * 4 / h**2                          # the stencil's diagonal
    M = jacobi(np.full(u.local.size, diag)) if args.jacobi else None
    total = 0
    for _ in range(args.steps):
        res = cg(op, u, x0=u, rtol=args.rtol, M=M)
        assert res.info == 0, res.info
        u = res.x
        total += res.iterations
    exact = modes(y, x, h, dt, args.steps).ravel()
    err = world.allreduce(np.array([np.abs(u.local - exact).max(initial=0.0)]), op="max")[0]
    umax = world.allreduce(np.array([u.local.max(initial=0.0)]), op="max")[0]
    if world.rank == 0:
        print(f"n={n} steps={args.steps} cg_iterations={total} max|u-exact|={err:.3e} "
              f"u_max={umax:.10f} ranks={world.size}")
    return {"error": float(err), "iterations": total, "u_max": float(umax)}


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    def _cli(argv: list[str] | None) -> int:
        main(argv)
        return 0

    raise SystemExit(run_cli(_cli))
