"""``python -m hpcmac.bench.hpl --mxp``: HPL-MxP beside FP64 HPL, same N, NB, grid, rounds.

For each grid, ``--repeat`` rounds, each a fresh ``mpirun`` of FP64
``hpcmac.hpl`` followed by one of ``hpcmac.hpl_mxp`` (float32 LU without
pivoting + FP64 GMRES), both with one BLAS thread per rank. Then numpy's DGEMM
and SGEMM with P*Q threads: SGEMM / DGEMM is the ceiling of the speed-up that
a float32 factorisation can bring. Printed per grid: both rates (medians), the
ratio MxP / FP64, the refinement's share of MxP's time, GMRES iterations,
and whether every run PASSED. The load average is printed: this machine is
shared, and absolute numbers move with it.
"""

from __future__ import annotations

import json
import os
import statistics


def _med(recs: list[dict], key: str) -> float:
    return statistics.median(float(r[key]) for r in recs) if recs else float("nan")


def compare(args) -> int:
    """Run the comparison ``args`` (bench.hpl's parsed flags) asks for; print the table."""
    from hpcmac.bench.hpl_run import dgemm_gflops, run_hpcmac

    gemm_n = args.dgemm_n or min(args.N, 6000)
    load0 = os.getloadavg()
    print(f"# HPL-MxP (float32 LU, FP64 GMRES) vs FP64 HPL, both hpcmac: N={args.N} "
          f"NB={args.nb}, {os.cpu_count()} cores, load average {load0[0]:.1f} {load0[1]:.1f} "
          f"{load0[2]:.1f} at start", flush=True)
    rows = []
    for p, q in args.grids:
        fp64, mxp = [], []
        for _ in range(args.repeat):
            fp64.append(run_hpcmac(args.N, args.nb, p, q, args.timeout))
            print(f"  {p}x{q} HPL FP64  {fp64[-1]['gflops']:8.2f} Gflops  "
                  f"{fp64[-1]['time_s']:7.2f} s", flush=True)
            mxp.append(run_hpcmac(args.N, args.nb, p, q, args.timeout, module="hpcmac.hpl_mxp"))
            r = mxp[-1]
            print(f"  {p}x{q} HPL-MxP   {r['gflops']:8.2f} Gflops  {r['time_s']:7.2f} s  (LU "
                  f"{r['time_factor_s']:.2f} s, GMRES {r['time_refine_s']:.2f} s, "
                  f"{r['iterations']} iterations)", flush=True)
        dgemm = dgemm_gflops(gemm_n, p * q)
        sgemm = dgemm_gflops(gemm_n, p * q, dtype="float32")
        shares = [r["time_refine_s"] / r["time_s"] for r in mxp]
        rows.append(dict(
            grid=f"{p}x{q}", n=args.N, nb=args.nb, fp64_gflops=_med(fp64, "gflops"),
            mxp_gflops=_med(mxp, "gflops"),
            ratio=statistics.median(m["gflops"] / f["gflops"] for f, m in zip(fp64, mxp)),
            refine_share=statistics.median(shares), iterations=[r["iterations"] for r in mxp],
            dgemm_gflops=dgemm, sgemm_gflops=sgemm, gemm_n=gemm_n,
            passed=all(r.get("passed") is True for r in fp64 + mxp),
            fp64_runs=fp64, mxp_runs=mxp,
        ))
    load1 = os.getloadavg()
    print()
    print(f"{'grid':>5} {'N':>6} {'NB':>4} {'FP64':>9} {'MxP':>9} {'ratio':>6} {'refine':>7} "
          f"{'iters':>6} {'DGEMM':>8} {'SGEMM':>8} {'S/D':>5} {'passed':>7}")
    for r in rows:
        its = "/".join(str(i) for i in r["iterations"])
        print(f"{r['grid']:>5} {r['n']:6d} {r['nb']:4d} {r['fp64_gflops']:9.2f} "
              f"{r['mxp_gflops']:9.2f} {r['ratio']:6.2f} {100 * r['refine_share']:6.1f}% "
              f"{its:>6} {r['dgemm_gflops']:8.1f} {r['sgemm_gflops']:8.1f} "
              f"{r['sgemm_gflops'] / r['dgemm_gflops']:5.2f} {str(r['passed']):>7}")
    print(f"# Gflops in Gflop/s, HPL's count (2/3 N^3 + 3/2 N^2) over the whole time; medians "
          f"of {args.repeat} rounds (ratio: median of the per-round ratios); refine = GMRES's "
          f"share of MxP's time; DGEMM/SGEMM = numpy {gemm_n}^3 matmul with P*Q threads; "
          f"load average {load1[0]:.1f} at the end (shared machine)")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(dict(rows=rows, load_start=load0, load_end=load1,
                                                cores=os.cpu_count()), indent=1), what="--json")
    return 0 if all(r["passed"] for r in rows) else 1
