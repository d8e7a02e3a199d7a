"""``python -m hpcmac.bench.hpl``: hpcmac's HPL beside netlib's, same N, NB and grid.

For each grid P x Q, in one run of this command:

* hpcmac: ``mpirun -np P*Q python -m hpcmac.hpl -N .. --nb .. -P .. -Q ..``, one BLAS
  thread per rank (as netlib with a serial BLAS), variant WR11C2R4;
* netlib HPL: Debian's ``hpcc`` (netlib HPL inside the HPC Challenge suite, which
  also runs its other tests first, ~1-2 min) under Debian's own ``mpirun``, with
  ``libopenblas0-serial`` and ``OPENBLAS_CORETYPE=SkylakeX`` (OpenBLAS 0.3.21
  misdetects this CPU and would run an unvectorised kernel), same variant;
* the DGEMM ceiling: numpy's matmul with P*Q BLAS threads (median of 3).

It prints both Gflops, the ratio hpcmac / netlib, each against the ceiling, and
the norms both report (the same matrix gives the same ||A||, ||b|| and, to
rounding, ||x||). The load average is printed too: on a shared machine the
numbers move with it; the two HPLs run back to back, ``--repeat`` times, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from hpcmac.bench.hpl_run import clean_env, dgemm_gflops, hpl_dat, oversubscribe, run_hpcmac
from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output
from hpcmac.lifecycle import run_cli

HPCC_TAIL = """\
##### This line (no. 32) is ignored (it serves as a separator). ######
0                      		Number of additional problem sizes for PTRANS
1200 10000 30000        	values of N
0                       	number of additional blocking sizes for PTRANS
40 9 8 13 13 20 16 32 64       	values of NB
"""


def find_hpcc() -> tuple[str, str] | None:
    """(hpcc, Debian's mpirun) when netlib HPL via Debian's hpcc is installed."""
    hpcc = shutil.which("hpcc") or ("/usr/bin/hpcc" if os.path.exists("/usr/bin/hpcc") else None)
    for mpirun in ("/usr/bin/mpirun.openmpi", "/usr/bin/mpirun"):
        if hpcc and os.path.exists(mpirun):
            return hpcc, mpirun
    return None


_HPCC_KEYS = {"HPL_Tflops": "tflops", "HPL_time": "time_s", "HPL_AnormI": "norm_a_inf",
              "HPL_XnormI": "norm_x_inf", "HPL_BnormI": "norm_b_inf", "HPL_RnormI": "resid0",
              "HPL_N": "n", "HPL_NB": "nb", "HPL_nprow": "p", "HPL_npcol": "q"}


def parse_hpccoutf(text: str) -> dict:
    """HPL's numbers from hpcc's hpccoutf.txt (its ``HPL_*=value`` summary block)."""
    rec: dict = {}
    for key, value in re.findall(r"^(HPL_\w+)=(\S+)$", text, flags=re.M):
        if key in _HPCC_KEYS:
            rec[_HPCC_KEYS[key]] = float(value)
    if "tflops" not in rec:
        raise RuntimeError("no HPL_Tflops in hpccoutf.txt: did hpcc's HPL run?")
    rec["gflops"] = rec.pop("tflops") * 1000.0
    m = re.search(r"^\|\|Ax-b\|\|_oo/\(eps.*=\s*(\S+) \.+ (PASSED|FAILED)", text, flags=re.M)
    if m:
        rec["residual"], rec["passed"] = float(m.group(1)), m.group(2) == "PASSED"
    return rec


def run_netlib(hpcc: tuple[str, str], n: int, nb: int, p: int, q: int, timeout: float) -> dict:
    """One netlib HPL run through Debian's hpcc (which runs the other HPCC tests too)."""
    exe, mpirun = hpcc
    np_ = p * q
    with tempfile.TemporaryDirectory(prefix="hpcmac-bench-hpcc-") as tmp:
        Path(tmp, "hpccinf.txt").write_text(hpl_dat(n, nb, p, q, device=8) + HPCC_TAIL)
        env = clean_env(OPENBLAS_CORETYPE="SkylakeX", OMP_NUM_THREADS="1",
                         OPENBLAS_NUM_THREADS="1")
        env["PATH"] = "/usr/bin:/bin:" + env.get("PATH", "")
        root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        cmd = [mpirun, *root, "-np", str(np_), *oversubscribe(np_), "--bind-to", "none", exe]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=tmp)
        wall = time.perf_counter() - t0
        outf = Path(tmp, "hpccoutf.txt")
        if proc.returncode != 0 or not outf.exists():
            raise RuntimeError(f"hpcc failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rec = parse_hpccoutf(outf.read_text())
    rec["job_wall_s"] = wall
    return rec


def _grid(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"expected PxQ like 1x2, found {text!r}")
    return int(m.group(1)), int(m.group(2))


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m hpcmac.bench.hpl", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-N", type=int, default=8000, help="problem size (default 8000)")
    p.add_argument("--nb", type=int, default=256, help="block size (default 256)")
    p.add_argument("--grids", type=_grid, nargs="+", default=[(1, 1), (1, 2)], metavar="PxQ",
                   help="process grids (default: 1x1 1x2)")
    p.add_argument("--repeat", type=int, default=1,
                   help="runs of each HPL per grid, alternating; medians reported (default 1)")
    p.add_argument("--dgemm-n", type=int, default=None,
                   help="matmul size for the DGEMM ceiling (default: min(N, 6000))")
    p.add_argument("--no-netlib", action="store_true", help="skip netlib HPL (hpcc)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per HPL run")
    p.add_argument("--json", type=checked_output("--json"),
                   metavar="FILE", help="write every measurement as JSON")
    p.add_argument("--whole-job", action="store_true",
                   help="the whole job (wall time from mpirun to exit, start-up, peak RSS per "
                   "rank) against netlib's xhpl in alternating rounds: N=8000 1x1, "
                   "N=16000 1x2, start-up N=1000 2x2 (see hpcmac.bench.hpl_whole)")
    p.add_argument("--xhpl", metavar="PATH", help="netlib HPL 2.3's xhpl for --whole-job "
                   "(default: $HPCMAC_XHPL)")
    p.add_argument("--xhpl-mpirun", metavar="PATH", default="/usr/bin/mpirun.openmpi",
                   help="the mpirun of the MPI xhpl was built with (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="--whole-job rounds (default 3)")
    p.add_argument("--cases", type=int, nargs="+", metavar="N",
                   help="--whole-job: only the cases with these N (8000, 16000, 1000)")
    p.add_argument("--mxp", action="store_true", help="HPL-MxP (python -m hpcmac.hpl_mxp, "
                   "float32 LU + FP64 GMRES) beside FP64 hpcmac.hpl instead of netlib: same N, "
                   "NB and grid, alternating in the same rounds (hpcmac.bench.hpl_mxp)")
    return p


def _median(recs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in recs) if recs else float("nan")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.N < 1 or args.nb < 1 or args.repeat < 1:
        raise UsageError("-N, --nb and --repeat must be >= 1")
    if args.mxp:
        from hpcmac.bench.hpl_mxp import compare

        return compare(args)
    if args.whole_job:
        if args.rounds < 1:
            raise UsageError("--rounds must be >= 1")
        from hpcmac.bench.hpl_whole import compare as whole

        return whole(args)
    hpcc = None if args.no_netlib else find_hpcc()
    if not args.no_netlib and hpcc is None:
        raise UsageError("netlib HPL not found: apt-get install hpcc libopenblas0-serial "
                         "(or pass --no-netlib)")
    dgemm_n = args.dgemm_n or min(args.N, 6000)
    load0 = os.getloadavg()
    print(f"# hpcmac HPL vs netlib HPL (Debian hpcc, OpenBLAS serial, SkylakeX kernel): "
          f"N={args.N} NB={args.nb}, {os.cpu_count()} cores, "
          f"load average {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f} at start", flush=True)
    rows = []
    for p, q in args.grids:
        ours, theirs = [], []
        for _ in range(args.repeat):
            ours.append(run_hpcmac(args.N, args.nb, p, q, args.timeout))
            print(f"  {p}x{q} hpcmac  {ours[-1]['gflops']:8.2f} Gflops", flush=True)
            if hpcc:
                theirs.append(run_netlib(hpcc, args.N, args.nb, p, q, args.timeout))
                print(f"  {p}x{q} netlib  {theirs[-1]['gflops']:8.2f} Gflops", flush=True)
        ceiling = dgemm_gflops(dgemm_n, p * q)
        g_ours, g_theirs = _median(ours, "gflops"), _median(theirs, "gflops")
        rows.append(dict(
            grid=f"{p}x{q}", n=args.N, nb=args.nb, hpcmac_gflops=g_ours,
            netlib_gflops=g_theirs, ratio=g_ours / g_theirs if theirs else float("nan"),
            dgemm_gflops=ceiling, dgemm_n=dgemm_n, dgemm_threads=p * q,
            hpcmac_runs=ours, netlib_runs=theirs,
        ))
    load1 = os.getloadavg()
    print()
    print(f"{'grid':>5} {'N':>6} {'NB':>4} {'hpcmac':>9} {'netlib':>9} {'ratio':>6} "
          f"{'DGEMM':>9} {'hpcmac/DGEMM':>12} {'netlib/DGEMM':>12} {'passed':>7}")
    for r in rows:
        passed = all(x.get("passed") for x in r["hpcmac_runs"] + r["netlib_runs"])
        print(f"{r['grid']:>5} {r['n']:6d} {r['nb']:4d} {r['hpcmac_gflops']:9.2f} "
              f"{r['netlib_gflops']:9.2f} {r['ratio']:6.3f} {r['dgemm_gflops']:9.2f} "
              f"{r['hpcmac_gflops'] / r['dgemm_gflops']:12.3f} "
              f"{r['netlib_gflops'] / r['dgemm_gflops']:12.3f} {str(passed):>7}")
    for r in rows:
        for key in ("norm_a_inf", "norm_x_inf", "norm_b_inf"):
            a = r["hpcmac_runs"][0].get(key)
            b = r["netlib_runs"][0].get(key) if r["netlib_runs"] else None
            if b is not None:
                print(f"# {r['grid']} {key}: hpcmac {a:.6f}  netlib {b:.6f}")
    print(f"# Gflops in Gflop/s (median of {args.repeat}); DGEMM = numpy {dgemm_n}^3 matmul with "
          f"P*Q threads; load average {load1[0]:.1f} at the end (shared machine: "
          "absolute numbers move with it, ratios less)")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(dict(rows=rows, load_start=load0, load_end=load1,
                                                cores=os.cpu_count()), indent=1), what="--json")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
