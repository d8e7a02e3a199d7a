"""The PETSc side of ``hpcmac.bench.sparse``: MatMult, KSPCG + PCJACOBI, KSPCG + PCGAMG.

Run by the driver as ``mpirun -np R python3 sparse_petsc.py ARGS`` under the
Python and MPI petsc4py was built with (Debian's python3-petsc4py and Open
MPI), so it imports nothing of hpcmac's but ``sparse_problems.py``, by path.
Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

from petsc4py import PETSc

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("sparse_problems",
                                               os.path.join(_here, "sparse_problems.py"))
problems = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(problems)


def build(dim: int, n: int):
    comm = PETSc.COMM_WORLD
    N = problems.nrows(dim, n)
    lo, hi = problems.even_range(N, comm.getSize(), comm.getRank())
    ptr, ind, dat = problems.poisson_rows(dim, n, lo, hi)
    A = PETSc.Mat().createAIJ(((hi - lo, N), (hi - lo, N)), comm=comm)
    A.setPreallocationCSR((ptr.astype(PETSc.IntType), ind.astype(PETSc.IntType), dat))
    A.assemble()
    return A


def slowest(t: float) -> float:
    """The slowest rank's time (a PETSc Vec max, so no mpi4py is needed)."""
    v = PETSc.Vec().createMPI((1, PETSc.DECIDE), comm=PETSc.COMM_WORLD)
    v.set(t)
    m = v.max()[1]
    v.destroy()
    return float(m)


def run(dim: int, n: int, reps: int, spmv: int, cg_iters: int, amg: bool) -> dict:
    A = build(dim, n)
    x, y = A.createVecs()
    x.set(1.0)
    rec = {"dim": dim, "n": n, "rows": A.getSize()[0], "nnz": int(A.getInfo()["nz_used"])}
    for _ in range(3):
        A.mult(x, y)
    ts = []
    for _ in range(reps):
        PETSc.COMM_WORLD.barrier()
        t0 = time.perf_counter()
        for _ in range(spmv):
            A.mult(x, y)
        ts.append(slowest(time.perf_counter() - t0) / spmv)
    rec["spmv_s"] = statistics.median(ts)
    b = A.createVecRight()
    b.set(1.0)
    ksp = PETSc.KSP().create(PETSc.COMM_WORLD)
    ksp.setOperators(A)
    ksp.setType("cg")
    ksp.getPC().setType("jacobi")
    ksp.setTolerances(rtol=1e-50, atol=0.0, max_it=cg_iters)
    ksp.setConvergenceTest(lambda *a: 0)   # run exactly cg_iters steps, as ours does
    ts = []
    for _ in range(reps):
        sol = A.createVecLeft()
        PETSc.COMM_WORLD.barrier()
        t0 = time.perf_counter()
        ksp.solve(b, sol)
        ts.append(slowest(time.perf_counter() - t0) / max(ksp.getIterationNumber(), 1))
    rec["cg_jacobi_s_per_it"] = statistics.median(ts)
    rec["cg_jacobi_its"] = ksp.getIterationNumber()
    ksp.destroy()
    if amg:
        setups, solves, its = [], [], []
        for _ in range(reps):
            ksp = PETSc.KSP().create(PETSc.COMM_WORLD)
            ksp.setOperators(A)
            ksp.setType("cg")
            ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
            ksp.getPC().setType("gamg")
            ksp.setTolerances(rtol=1e-8, atol=0.0, max_it=500)
            sol = A.createVecLeft()
            PETSc.COMM_WORLD.barrier()
            t0 = time.perf_counter()
            ksp.setUp()
            t1 = time.perf_counter()
            ksp.solve(b, sol)
            t2 = time.perf_counter()
            setups.append(slowest(t1 - t0))
            solves.append(slowest(t2 - t1))
            its.append(ksp.getIterationNumber())
            rec["amg_reason"] = int(ksp.getConvergedReason())
            ksp.destroy()
        rec.update({"amg_setup_s": statistics.median(setups),
                    "amg_solve_s": statistics.median(solves), "amg_its": int(its[-1])})
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", required=True, help="dim:n[:amg],... e.g. 2:1024:amg,3:96")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spmv", type=int, default=20)
    ap.add_argument("--cg-iters", type=int, default=50)
    args = ap.parse_args()
    out = []
    for item in args.problems.split(","):
        parts = item.split(":")
        out.append(run(int(parts[0]), int(parts[1]), args.reps, args.spmv, args.cg_iters,
                       "amg" in parts[2:]))
    if PETSc.COMM_WORLD.getRank() == 0:
        print(json.dumps({"version": ".".join(map(str, PETSc.Sys.getVersion())),
                          "ranks": PETSc.COMM_WORLD.getSize(), "records": out}))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
