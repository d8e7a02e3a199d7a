"""Flow past a cylinder by source panels (AeroPython lesson 10): the SERIAL version.

    python examples/panel_serial.py --panels 64

The whole N x N influence matrices in one process, ``numpy.linalg.solve`` as in the
lesson. Prints the sum of the source strengths (zero for a closed body), the largest
error of cp against the exact 1 - 4 sin^2 theta, and cp at the stagnation and top
points. See panel_geometry.py for where the method comes from.
"""

import argparse
import sys

import numpy as np
from panel_geometry import exact_cp, freestream, normal_entries, tangent_entries


def solve_panels(n: int):
    """(sigma, cp): the lesson's algorithm, serially."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    a = normal_entries(n)(i, j)                       # (n, n) normal influence
    b, bt = freestream(n)
    sigma = np.linalg.solve(a, b)
    vt = tangent_entries(n)(i, j) @ sigma + bt        # tangential velocity at the centres
    return sigma, 1.0 - vt**2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--panels", type=int, default=64, help="panels on the cylinder (>= 4)")
    args = ap.parse_args()
    if args.panels < 4:
        print(f"error: --panels must be at least 4, found {args.panels}", file=sys.stderr)
        raise SystemExit(2)
    n = args.panels
    sigma, cp = solve_panels(n)
    print(f"panels={n} sum_sigma={sigma.sum():.3e} "
          f"max_cp_error={np.abs(cp - exact_cp(n)).max():.6e} "
          f"cp_first={cp[0]:.12f} cp_quarter={cp[n // 4]:.12f}")


if __name__ == "__main__":
    main()
