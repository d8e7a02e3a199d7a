"""``python -m hpcmac.bench.sparse``: DistCSR SpMV, CG + Jacobi and CG + AMG vs PETSc, in one run.

For each rank count the driver starts two jobs on the same matrices (2-D
5-point Poisson n^2 and 3-D 7-point Poisson n^3, rows split evenly as PETSc's
PETSC_DECIDE): ``mpirun -np R`` of itself (``--worker``: hpcmac) and, when
petsc4py is found, the PETSc worker (``sparse_petsc.py``) under the Python
and ``mpirun`` petsc4py belongs to (``--petsc-python``, ``--petsc-mpirun``;
default: Debian's ``/usr/bin/python3`` and ``/usr/bin/mpirun``). Without
petsc4py the PETSc columns say so and hpcmac's rows still run.

Measured, each the median of ``--reps`` and the slowest rank's time:
SpMV (``A @ x`` vs MatMult), CG + Jacobi per iteration over a fixed
``--cg-iters`` (vs KSPCG + PCJACOBI), CG + AMG to ``rtol = 1e-8`` on the
true residual (setup, solve, iterations; vs KSPCG + PCGAMG, unpreconditioned
norm), AMG iteration growth from the small 2-D size to the large one, and
SpMV bytes per second against a STREAM-style ``a = b + c`` run on every rank
at once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from hpcmac.bench.sparse_problems import even_range, nrows, poisson_rows
from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output

HERE = os.path.dirname(os.path.abspath(__file__))
DEBIAN_PETSC = "/usr/lib/petscdir/petsc3.18/x86_64-linux-gnu-real"


def _slowest(world, t: float) -> float:
    return float(world.allreduce(np.array([t]), op="max")[0])


def _median(world, fn, reps: int, per: int = 1) -> float:
    ts = []
    for _ in range(reps):
        world.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(_slowest(world, time.perf_counter() - t0) / per)
    return statistics.median(ts)


def stream_add(world, n: int = 4_000_000, reps: int = 5) -> float:
    """Collective: bytes/s of ``a = b + c`` on every rank at once, summed over ranks."""
    b, c = np.ones(n), np.ones(n)
    a = np.empty(n)
    np.add(b, c, out=a)
    t = _median(world, lambda: [np.add(b, c, out=a) for _ in range(5)], reps, per=5)
    return 3 * 8 * n * world.size / t


def run_problem(world, dim: int, n: int, reps: int, spmv: int, cg_iters: int,
                amg: bool) -> dict:
    """Collective: one problem's hpcmac measurements (the same dict on every rank)."""
    import scipy.sparse as sp

    from hpcmac.linalg.sparse import DistCSR, cg
    from hpcmac.linalg.sparse import amg as build_amg

    N = nrows(dim, n)
    lo, hi = even_range(N, world.size, world.rank)
    ptr, ind, dat = poisson_rows(dim, n, lo, hi)
    A = DistCSR.from_rows(sp.csr_matrix((dat, ind, ptr), shape=(hi - lo, N)), world)
    nnz = A.nnz
    x = np.ones(hi - lo)
    y = np.empty(hi - lo)
    for _ in range(3):
        A.matvec(x, out=y)
    rec = {"dim": dim, "n": n, "rows": N, "nnz": nnz,
           "spmv_s": _median(world, lambda: [A.matvec(x, out=y) for _ in range(spmv)], reps,
                             per=spmv)}
    # bytes one product must move at least: values + column indices + row pointers, x and y
    ib = A.diag.indices.itemsize
    rec["spmv_bytes"] = nnz * (8 + ib) + (N + world.size) * ib + 2 * 8 * N
    b = A.vector(np.ones(N), side="rows")
    res = [None]

    def fixed_cg():
        res[0] = cg(A, b, rtol=0.0, atol=0.0, maxiter=cg_iters, M="jacobi")

    rec["cg_jacobi_s_per_it"] = _median(world, fixed_cg, reps, per=cg_iters)
    rec["cg_jacobi_its"] = res[0].iterations
    if amg:
        setups, solves, its = [], [], []
        for _ in range(reps):
            world.barrier()
            t0 = time.perf_counter()
            M = build_amg(A)
            t1 = time.perf_counter()
            out = cg(A, b, rtol=1e-8, M=M, maxiter=500)
            t2 = time.perf_counter()
            setups.append(_slowest(world, t1 - t0))
            solves.append(_slowest(world, t2 - t1))
            its.append(out.iterations)
        rec.update({"amg_setup_s": statistics.median(setups),
                    "amg_solve_s": statistics.median(solves), "amg_its": its[-1],
                    "amg_info": out.info, "amg_levels": repr(M)})
    return rec


def worker(args) -> dict:
    from threadpoolctl import threadpool_limits

    from hpcmac import comm

    world = comm.init(announce=False)
    with threadpool_limits(1):
        recs = [run_problem(world, d, n, args.reps, args.spmv, args.cg_iters, amg)
                for d, n, amg in _problems(args)]
        bw = stream_add(world)
    return {"ranks": world.size, "records": recs, "stream_bytes_per_s": bw}


def _problems(args) -> list[tuple[int, int, bool]]:
    return [(2, args.n2_small, True), (2, args.n2, True), (3, args.n3, True)]


def _mpirun(ranks: int) -> list[str]:
    root = os.path.dirname(os.path.dirname(HERE))
    tool = os.path.join(root, "tools", "mpirun")
    if os.path.exists(tool):
        return [tool, str(ranks)]
    found = shutil.which("mpirun")
    if not found:
        raise UsageError("bench sparse: no mpirun found (tools/mpirun or mpirun on PATH)")
    return [found, "-np", str(ranks), "--oversubscribe"]


def _common(args) -> list[str]:
    return ["--reps", str(args.reps), "--spmv", str(args.spmv), "--cg-iters", str(args.cg_iters)]


def run_ours(ranks: int, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = _mpirun(ranks) + [sys.executable, "-m", "hpcmac.bench.sparse", "--worker",
                            "--n2", str(args.n2), "--n2-small", str(args.n2_small),
                            "--n3", str(args.n3)] + _common(args)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"hpcmac worker at {ranks} ranks failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def petsc_available(args) -> tuple[bool, str]:
    """(usable, why not): petsc4py imports under --petsc-python."""
    py = shutil.which(args.petsc_python) or args.petsc_python
    if not os.path.exists(py):
        return False, f"{args.petsc_python} not found"
    env = _petsc_env()
    done = subprocess.run([py, "-c", "import petsc4py.PETSc"], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        return False, f"petsc4py does not import under {py}"
    return True, ""


def _petsc_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "PYTHON"))}
    if "PETSC_DIR" not in env and os.path.isdir(DEBIAN_PETSC):
        env["PETSC_DIR"] = DEBIAN_PETSC   # Debian's petsc4py.pth looks in /usr/lib/petsc otherwise
    from hpcmac.mpirun import root_env

    env.update(OMP_NUM_THREADS="1", **root_env())
    return env


def run_petsc(ranks: int, args) -> dict:
    probs = ",".join(f"{d}:{n}" + (":amg" if amg else "") for d, n, amg in _problems(args))
    cmd = [args.petsc_mpirun, "-np", str(ranks), "--oversubscribe", "-x", "PETSC_DIR",
           args.petsc_python, os.path.join(HERE, "sparse_petsc.py"), "--problems", probs] + \
        _common(args)
    done = subprocess.run(cmd, env=_petsc_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"PETSc worker at {ranks} ranks failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(label, ours, theirs, fmt, target, time=False):
    """One table line; the ratio is hpcmac / PETSc, or for times PETSc / hpcmac (speed)."""
    ratio = (theirs / ours if time else ours / theirs) if theirs and ours else float("nan")
    t = f"{theirs:{fmt}}" if theirs else "-"
    return f"  {label:<34}{ours:>11{fmt}}{t:>11}{ratio:>8.2f}  {target}"


def report(runs: dict, petsc: dict, why_no_petsc: str) -> list[dict]:
    """Print the table; returns the records."""
    out = []
    for r, mine in runs.items():
        theirs = petsc.get(r)
        bw = mine["stream_bytes_per_s"]
        print(f"\n== {r} rank(s); STREAM-style a = b + c, all ranks at once: {bw / 1e9:.1f} GB/s"
              + ("" if theirs else f"; PETSc: not run ({why_no_petsc})"))
        print(f"  {'measure':<34}{'hpcmac':>11}{'PETSc':>11}{'ratio':>8}  target "
              f"(ratio: hpcmac/PETSc; for times PETSc/hpcmac, a speed)")
        for k, rec in enumerate(mine["records"]):
            p = theirs["records"][k] if theirs else {}
            name = f"{rec['dim']}-D Poisson {rec['n']}^{rec['dim']} ({rec['rows']} rows)"
            print(f" {name}")
            gf = 2 * rec["nnz"] / rec["spmv_s"] / 1e9
            gfp = 2 * p["nnz"] / p["spmv_s"] / 1e9 if p else 0.0
            lines = [_row("SpMV Gflops", gf, gfp, ".2f", ">= 0.8"),
                     f"  {'SpMV GB/s (min bytes) / STREAM':<34}"
                     f"{rec['spmv_bytes'] / rec['spmv_s'] / 1e9:>11.1f}"
                     f"{'':>11}{rec['spmv_bytes'] / rec['spmv_s'] / bw:>8.2f}",
                     _row("CG+Jacobi ms/iteration", rec["cg_jacobi_s_per_it"] * 1e3,
                          p.get("cg_jacobi_s_per_it", 0) * 1e3, ".2f", "speed >= 0.8",
                          time=True)]
            if "amg_its" in rec:
                lines.append(_row("CG+AMG iterations", rec["amg_its"], p.get("amg_its", 0), ".0f",
                                  "<= 1.5"))
                tot = rec["amg_setup_s"] + rec["amg_solve_s"]
                ptot = p.get("amg_setup_s", 0) + p.get("amg_solve_s", 0)
                lines.append(_row("CG+AMG setup s", rec["amg_setup_s"], p.get("amg_setup_s", 0),
                                  ".2f", "(speed)", time=True))
                lines.append(_row("CG+AMG solve s", rec["amg_solve_s"], p.get("amg_solve_s", 0),
                                  ".2f", "(speed)", time=True))
                lines.append(_row("CG+AMG time to solution s", tot, ptot, ".2f",
                                  "speed >= 0.5", time=True))
                lines.append(f"  {'  levels':<34}{rec['amg_levels']}")
            print("\n".join(lines))
            out.append({"ranks": r, "hpcmac": rec, "petsc": p or None})
        small, big = mine["records"][0], mine["records"][1]
        growth = f"hpcmac {big['amg_its'] / small['amg_its']:.2f}"
        if theirs:
            tr = theirs["records"]
            growth += f", PETSc GAMG {tr[1]['amg_its'] / tr[0]['amg_its']:.2f}"
        print(f"  AMG iteration growth {small['n']}^2 -> {big['n']}^2: {growth}  (target <= 1.3)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hpcmac.bench.sparse", description=__doc__)
    ap.add_argument("--n2", type=int, default=1024, help="2-D grid side (default 1024)")
    ap.add_argument("--n2-small", type=int, default=256,
                    help="2-D side for the AMG growth check (default 256)")
    ap.add_argument("--n3", type=int, default=96, help="3-D grid side (default 96)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (median)")
    ap.add_argument("--spmv", type=int, default=20, help="products per SpMV timing")
    ap.add_argument("--cg-iters", type=int, default=50, help="CG + Jacobi steps per timing")
    ap.add_argument("--petsc-python", default="/usr/bin/python3",
                    help="the Python petsc4py is installed for")
    ap.add_argument("--petsc-mpirun", default="/usr/bin/mpirun",
                    help="the mpirun of the MPI petsc4py was built with")
    ap.add_argument("--no-petsc", action="store_true", help="hpcmac's rows only")
    ap.add_argument("--json", type=checked_output("--json"), metavar="FILE",
                    help="also write the records as JSON")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("n2", "n2_small", "n3", "reps", "spmv", "cg_iters"):
        if getattr(args, name) < 2 if name.startswith("n") else getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: expected a positive integer "
                             f"(grid sides >= 2), found {getattr(args, name)}")
    if any(r < 1 for r in args.ranks):
        raise UsageError(f"--ranks: expected positive integers, found {args.ranks}")
    if args.worker:
        res = worker(args)
        from hpcmac import comm

        if comm.init().rank == 0:
            print(json.dumps(res))
        return 0
    ok, why = (False, "--no-petsc") if args.no_petsc else petsc_available(args)
    load = os.getloadavg()
    print(f"hpcmac.bench.sparse on {platform.node()} ({os.cpu_count()} cores), load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; median of {args.reps}, slowest rank; "
          f"1 BLAS thread per rank")
    runs, petsc = {}, {}
    for r in args.ranks:
        runs[r] = run_ours(r, args)
        if ok:
            petsc[r] = run_petsc(r, args)
    if petsc:
        v = next(iter(petsc.values()))["version"]
        print(f"PETSc {v} (petsc4py under {args.petsc_python}, {args.petsc_mpirun}), "
              f"default GAMG options")
    records = report(runs, petsc, why)
    load = os.getloadavg()
    print(f"\nload average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps({"records": records}, indent=1), what="--json")
    return 0


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    raise SystemExit(run_cli(main))
