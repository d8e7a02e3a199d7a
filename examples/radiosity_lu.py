"""Radiosity by LU, read from and written to HDF5: the DISTRIBUTED version.

    mpirun -np 2 python examples/radiosity_lu.py --m 100 --input room.h5 --output room_B.h5

Same problem and files as radiosity_serial.py. Each rank builds (if the
input file is missing), reads and writes only its own blocks of the
block-cyclic matrix; the LU is the distributed one HPL uses. Rank 0 prints.
"""

import argparse
import os
import sys
import time

import numpy as np

from hpcmac import comm
from hpcmac.comm.grid import Grid
from hpcmac.errors import UsageError
from hpcmac.io.hdf5 import read_hdf5, write_hdf5
from hpcmac.linalg import DistMatrix, lu_factor, lu_solve, matmul, norm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from radiosity_geometry import input_mismatch, patches, system_entries  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=100, help="patches per wall (N = 4 m unknowns)")
    ap.add_argument("--input", default="room.h5")
    ap.add_argument("--output", default="room_B.h5")
    ap.add_argument("--nb", type=int, default=64, help="block size")
    ap.add_argument("-P", type=int, default=1, help="process rows (Q = ranks / P)")
    args = ap.parse_args(argv)
    world = comm.init()
    if world.size % args.P:
        raise UsageError(f"-P {args.P} does not divide the {world.size} ranks")
    grid = Grid(world, args.P, world.size // args.P)
    n, nb = 4 * args.m, args.nb
    if args.m < 1 or args.nb < 1:
        raise UsageError(f"--m and --nb must be positive, found {args.m} and {args.nb}")
    exists = world.bcast_obj(os.path.exists(args.input) if world.rank == 0 else None)
    if exists:  # a file left by a run with another --m: refuse, do not solve it silently
        why = world.bcast_obj(input_mismatch(args.input, args.m) if world.rank == 0 else None)
        if why:
            raise UsageError(why)
    if not exists:  # every rank computes and writes only its own entries
        a = DistMatrix.from_function(system_entries(args.m), (n, n), grid, nb, nb)
        e_all = patches(args.m)[4]
        e = DistMatrix.from_function(lambda i, j: e_all[i] + 0 * j, (n, 1), grid, nb, nb)
        write_hdf5(a, args.input, "A")
        write_hdf5(e, args.input, "E")
    a = read_hdf5(args.input, "A", grid, nb, nb, shape=(n, n))
    e = read_hdf5(args.input, "E", grid, nb, nb, shape=(n, 1))
    world.barrier()
    t0 = time.perf_counter()
    lu, piv = lu_factor(a)
    b = lu_solve((lu, piv), e)
    seconds = time.perf_counter() - t0
    how = write_hdf5(b, args.output, "B")
    r = matmul(a, b)
    r.local -= e.local
    resid = norm(r, np.inf) / (norm(a, np.inf) * norm(b, "max"))
    total = world.allreduce(np.array([b.local.sum()]))[0]
    if world.rank == 0:
        print(f"N={n} grid={grid.nprow}x{grid.npcol} nb={nb} solve_s={seconds:.3f} "
              f"scaled_residual={resid:.2e} total_radiosity={total:.10f} hdf5={how}")
    return {"residual": float(resid), "total": float(total), "hdf5": how}


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    def _cli(argv: list[str] | None) -> int:
        main(argv)
        return 0

    raise SystemExit(run_cli(_cli))
