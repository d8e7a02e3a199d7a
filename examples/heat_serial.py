"""The 2-D heat equation, implicit Euler, each step solved by CG: the SERIAL version.

    python examples/heat_serial.py --n 64 --steps 5

u_t = Laplace(u) on the unit square, u = 0 on the boundary, n x n interior
points, 5-point stencil. The start is two sine modes; every step
multiplies each by exactly 1 / (1 + dt * lam) (lam: that mode's eigenvalue of
the discrete Laplacian), so the script checks the answer against the formula.
"""

import argparse
import sys

import numpy as np
from scipy.sparse.linalg import LinearOperator, cg


def modes(y, x, h, dt, steps):
    """u (rows y, columns x) after ``steps`` implicit Euler steps from
    sin(pi x) sin(pi y) + 0.5 sin(5 pi x) sin(3 pi y)."""
    u = 0.0
    for p, q, amp in ((1, 1, 1.0), (5, 3, 0.5)):
        lam = 4 / h**2 * (np.sin(p * np.pi * h / 2) ** 2 + np.sin(q * np.pi * h / 2) ** 2)
        shape = np.outer(np.sin(q * np.pi * y), np.sin(p * np.pi * x))
        u = u + amp * (1 + dt * lam) ** -steps * shape
    return u


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64, help="interior points per side")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dt", type=float, default=1e-3)
    ap.add_argument("--rtol", type=float, default=1e-10)
    args = ap.parse_args()
    if not (args.n >= 1 and args.steps >= 0 and 0 < args.dt < float("inf")
            and 0 < args.rtol < 1):
        print(f"error: expected --n >= 1, --steps >= 0, --dt > 0 and 0 < --rtol < 1, "
              f"found {args.n}, {args.steps}, {args.dt}, {args.rtol}", file=sys.stderr)
        raise SystemExit(2)
    n, dt = args.n, args.dt
    h = 1.0 / (n + 1)
    x = np.arange(1, n + 1) * h
    y = x                                                    # rows are y, columns x
    u = modes(y, x, h, dt, 0)                                # (n, n)

    def matvec(v):                                           # (I - dt * Laplace) v
        v = v.reshape(n, n)
        p = np.pad(v, 1)                                     # zero boundary
        lap = (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * v) / h**2
        return (v - dt * lap).ravel()

    op = LinearOperator((n * n, n * n), matvec=matvec)
    iters = []
    for _ in range(args.steps):
        un, info = cg(op, u.ravel(), x0=u.ravel(), rtol=args.rtol,
                      callback=lambda xk: iters.append(1))
        assert info == 0, info
        u = un.reshape(n, n)
    total = len(iters)
    exact = modes(y, x, h, dt, args.steps)
    err = np.abs(u - exact).max()
    print(f"n={n} steps={args.steps} cg_iterations={total} max|u-exact|={err:.3e} "
          f"u_max={u.max():.10f}")


if __name__ == "__main__":
    main()
