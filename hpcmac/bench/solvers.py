"""``mpirun -np R python -m hpcmac.bench.solvers``: eigh, lstsq and inv vs scipy, in one run.

Collective: every rank runs it. For each operation the distributed call
(1 x R grid, one BLAS thread per rank; the slowest rank's time counts)
alternates with scipy's serial routine timed on every rank at once (one
thread each), so both see the same machine state. Printed: the medians of
``--reps`` runs and the speed-up over one core running scipy (ideal: R).
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import numpy as np

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import check_on_root, output_path


def run(world, n: int, nb: int, reps: int) -> list[dict]:
    """Collective over ``world``: one record per operation (the same list on every rank)."""
    import scipy.linalg as sl
    from threadpoolctl import threadpool_limits

    from hpcmac.linalg import DistMatrix, Grid, eigh, inv, lstsq

    grid = Grid(world, 1, world.size)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n))
    s = a + a.T
    tall = rng.standard_normal((2 * n, n // 2))
    y = rng.standard_normal(2 * n)
    ds = DistMatrix.from_function(lambda i, j: s[i, j], s.shape, grid, nb, nb)
    da = DistMatrix.from_function(lambda i, j: a[i, j] + n * (i == j), a.shape, grid, nb, nb)
    dt = DistMatrix.from_function(lambda i, j: tall[i, j], tall.shape, grid, nb, nb)
    ops = [("eigh", n, lambda: eigh(ds), lambda: sl.eigh(s)),
           ("lstsq", 2 * n, lambda: lstsq(dt, y),
            lambda: sl.lstsq(tall, y, lapack_driver="gelsy")),
           ("inv", n, lambda: inv(da), lambda: sl.inv(a + n * np.eye(n)))]
    records = []
    with threadpool_limits(1):
        for name, size, ours, ref in ops:
            t_ours, t_ref = [], []
            for _ in range(reps):
                world.barrier()
                t0 = time.perf_counter()
                ours()
                t = time.perf_counter() - t0
                t_ours.append(float(world.allreduce(np.array([t]), op="max")[0]))
                world.barrier()
                t0 = time.perf_counter()
                ref()
                t = time.perf_counter() - t0
                t_ref.append(float(world.allreduce(np.array([t]))[0]) / world.size)
            mo, mr = statistics.median(t_ours), statistics.median(t_ref)
            records.append({"op": name, "m": size, "n": n if name != "lstsq" else n // 2,
                            "nb": nb, "ranks": world.size, "seconds": mo,
                            "scipy_1core_seconds": mr, "speedup_over_1core": mr / mo})
    return records


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hpcmac.bench.solvers", description=__doc__)
    ap.add_argument("--n", type=int, default=1000, help="matrix order (default 1000)")
    ap.add_argument("--nb", type=int, default=64, help="block size (default 64)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (median)")
    ap.add_argument("--json", type=output_path,
                    metavar="FILE", help="also write the records as JSON (rank 0)")
    args = ap.parse_args(argv)
    for name in ("n", "nb", "reps"):
        if getattr(args, name) < 1 or (name == "n" and args.n < 2):
            raise UsageError(f"--{name}: expected a positive integer (n >= 2)")
    from hpcmac import comm

    world = comm.init(announce=False)
    check_on_root(world, args.json, "--json")  # before any measurement
    comm.announce()
    records = run(world, args.n, args.nb, args.reps)
    if world.rank == 0:
        print(f"hpcmac.bench.solvers on {platform.node()}, {world.size} rank(s), 1 x "
              f"{world.size} grid, 1 BLAS thread per rank, median of {args.reps}")
        print(f"{'op':<7}{'m':>7}{'n':>7}{'seconds':>10}{'scipy 1 core':>14}{'speed-up':>10}")
        for r in records:
            print(f"{r['op']:<7}{r['m']:>7}{r['n']:>7}{r['seconds']:>10.3f}"
                  f"{r['scipy_1core_seconds']:>14.3f}{r['speedup_over_1core']:>10.2f}")
        if args.json:
            from hpcmac.io.outputs import write_atomic

            write_atomic(args.json, json.dumps(records, indent=1), what="--json")
    return 0


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    raise SystemExit(run_cli(main))
