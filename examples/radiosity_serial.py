"""Radiosity by LU, read from and written to HDF5: the SERIAL version (numpy, scipy, h5py).

    python examples/radiosity_serial.py --m 100 --input room.h5 --output room_B_serial.h5

Builds the system into --input if it does not exist, then solves it.
"""

import argparse
import os
import sys
import time

import h5py
import numpy as np
import scipy.linalg
from radiosity_geometry import input_mismatch, patches, system_entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=100, help="patches per wall (N = 4 m unknowns)")
    ap.add_argument("--input", default="room.h5")
    ap.add_argument("--output", default="room_B_serial.h5")
    args = ap.parse_args()
    n = 4 * args.m
    why = f"--m must be positive, found {args.m}" if args.m < 1 else \
        os.path.exists(args.input) and input_mismatch(args.input, args.m)
    if why:
        print(f"error: {why}", file=sys.stderr)
        raise SystemExit(2)
    if not os.path.exists(args.input):
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        with h5py.File(args.input, "w") as f:
            f["A"] = system_entries(args.m)(i, j)
            f["E"] = patches(args.m)[4][:, None]
    with h5py.File(args.input, "r") as f:
        a, e = f["A"][...], f["E"][...]
    t0 = time.perf_counter()
    lu, piv = scipy.linalg.lu_factor(a)
    b = scipy.linalg.lu_solve((lu, piv), e)
    seconds = time.perf_counter() - t0
    with h5py.File(args.output, "w") as f:
        f["B"] = b
    resid = np.abs(a @ b - e).max() / (np.abs(a).sum(1).max() * np.abs(b).max())
    print(f"N={n} solve_s={seconds:.3f} scaled_residual={resid:.2e} "
          f"total_radiosity={b.sum():.10f}")


if __name__ == "__main__":
    main()
