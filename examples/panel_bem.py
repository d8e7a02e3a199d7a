"""Flow past a cylinder by source panels (AeroPython lesson 10): the DISTRIBUTED version.

    mpirun -np 4 python examples/panel_bem.py --panels 64

Ported from panel_serial.py following docs/porting.md: each rank computes only its
blocks of the two dense influence matrices (``DistMatrix.from_function`` with the same
entry functions), ``hpcmac.linalg.solve`` replaces ``numpy.linalg.solve``, ``matmul``
replaces ``@``; rank 0 prints the same line as the serial script (plus the ranks).
"""

import argparse
import os
import sys

import numpy as np

from hpcmac import comm
from hpcmac.errors import UsageError
from hpcmac.linalg import DistMatrix, Grid, matmul, solve

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from panel_geometry import exact_cp, freestream, normal_entries, tangent_entries  # noqa: E402


def solve_panels(n: int, grid: Grid, nb: int):
    """(sigma, cp), whole on every rank: the same algorithm over the grid."""
    a = DistMatrix.from_function(normal_entries(n), (n, n), grid, nb, nb)   # my blocks only
    b, bt = freestream(n)
    sigma = solve(a, b)                               # b whole on every rank -> sigma whole
    at = DistMatrix.from_function(tangent_entries(n), (n, n), grid, nb, nb)
    s = DistMatrix.from_function(lambda i, j: sigma[i] + 0.0 * j, (n, 1), grid, nb, nb)
    vt = matmul(at, s).allgather()[:, 0] + bt         # (n,) on every rank
    return sigma, 1.0 - vt**2


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--panels", type=int, default=64, help="panels on the cylinder (>= 4)")
    ap.add_argument("--nb", type=int, default=16, help="block size")
    ap.add_argument("-P", type=int, default=1, help="process rows (Q = ranks / P)")
    args = ap.parse_args(argv)
    if args.panels < 4 or args.nb < 1:
        raise UsageError(f"--panels must be >= 4 and --nb >= 1, found {args.panels} "
                         f"and {args.nb}")
    world = comm.init()
    if args.P < 1 or world.size % args.P:
        raise UsageError(f"-P {args.P} does not divide the {world.size} ranks")
    grid = Grid(world, args.P, world.size // args.P)
    n = args.panels
    sigma, cp = solve_panels(n, grid, args.nb)
    err = float(np.abs(cp - exact_cp(n)).max())
    if world.rank == 0:
        print(f"panels={n} sum_sigma={sigma.sum():.3e} max_cp_error={err:.6e} "
              f"cp_first={cp[0]:.12f} cp_quarter={cp[n // 4]:.12f} ranks={world.size}")
    return {"sigma": sigma, "cp": cp, "cp_error": err}


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    def _cli(argv: list[str] | None) -> int:
        main(argv)
        return 0

    raise SystemExit(run_cli(_cli))
