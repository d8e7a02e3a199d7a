"""``mpirun -np 4 python -m hpcmac.hpl_mxp``: mixed-precision LINPACK (HPL-MxP rules).

Reads HPL.dat like ``hpcmac.hpl``, runs every combination it lists, prints an
HPL.out-style report naming both precisions. See ``--help``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from hpcmac import comm
from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.hpl import config as hplconfig
from hpcmac.io.inputs import float_arg, int_arg
from hpcmac.io.outputs import output_path
from hpcmac.lifecycle import run_cli

DESCRIPTION = f"""\
HPL-MxP (formerly HPL-AI): solve netlib HPL's system to FP64 accuracy from a
low-precision factorisation. The matrix is HPL's random matrix with each
diagonal entry set to the sum of the magnitudes of the other entries of its
row (diagonally dominant, as the HPL-MxP rules require); it is factored
WITHOUT pivoting in low precision by hpcmac.linalg's block-cyclic LU (netlib
HPL's panel, broadcast and update phases, the variants HPL.dat names), then
flexible GMRES in float64, preconditioned by that LU, refines the solution
until HPL's scaled residual is below the threshold. The rate is HPL's
(2/3 N^3 + 3/2 N^2) flops over the whole time: factorisation plus refinement.

Input (the first that applies), as python -m hpcmac.hpl:
  --dat FILE        this HPL.dat (netlib's 31-line format; python -m hpcmac.hpl --help)
  ./HPL.dat         when present in the working directory
  embedded default  N={hplconfig.DEFAULT_N} NB={hplconfig.DEFAULT_NB}, WR11C2R4, P x Q from the
                    rank count
-N / --nb / -P / -Q then replace the file's Ns, NBs and grids. The threshold
(line 13, default 16.0) must be > 0: the refinement stops on it.
"""

EPILOG = """\
Precisions (--backend, --precision):
  numpy  float32    the whole LU in float32 with the BLAS's SGEMM (the default)
  mlx    float32 | bfloat16 | float16
                    panels in float32 on the CPU, the trailing update C -= L U
                    through MLX with L and U in that precision (Metal on Apple
                    GPUs; MLX's CPU build elsewhere, slow: numerics, not speed)
The refinement, the matrix-vector products and the residual check are always
float64.

Output: HPL.out's lines (T/V N NB P Q Time Gflops; start/end times; the
residual line ending in PASSED or FAILED; the closing counts) plus, per run,
the factorisation and refinement times and GMRES's iteration count. A run is
PASSED only when the refinement reached the threshold; it is FAILED when the
iteration limit ran out first or the low-precision LU broke down (an exactly
zero pivot). --json writes hpcmac.hpl's record plus precision, backend,
iterations, restarts, converged, time_factor_s, time_refine_s, history
(scaled residual at each restart) and note.

Exit status: 0 when every run passed, 1 when one FAILED, 2 on bad input.

Examples:
  mpirun -np 2 python -m hpcmac.hpl_mxp -N 8000 --nb 256 -P 1 -Q 2 --json mxp.json
  mpirun -np 4 python -m hpcmac.hpl_mxp --backend mlx --precision float16 -N 4000
"""


def build_parser() -> argparse.ArgumentParser:
    from hpcmac.hpl_mxp.kernels import BACKENDS, PRECISIONS

    p = ArgumentParser(prog="python -m hpcmac.hpl_mxp", description=DESCRIPTION,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dat", metavar="FILE", help="read this HPL.dat (default: ./HPL.dat if "
                   "present, else the embedded default)")
    p.add_argument("-N", dest="ns", type=int_arg, nargs="+", metavar="N",
                   help="problem sizes, replacing the file's Ns")
    p.add_argument("--nb", dest="nbs", type=int_arg, nargs="+", metavar="NB",
                   help="block sizes, replacing the file's NBs")
    p.add_argument("-P", type=int_arg, help="process rows; with -Q, the one grid to run")
    p.add_argument("-Q", type=int_arg, help="process columns")
    p.add_argument("--backend", default="numpy", metavar="{" + ",".join(BACKENDS) + "}",
                   help="where the factorisation's GEMM runs (default numpy)")
    p.add_argument("--precision", default="float32", metavar="{" + ",".join(PRECISIONS) + "}",
                   help="the factorisation's precision (default float32)")
    p.add_argument("--maxit", type=int_arg, default=50, help="GMRES iterations at most, in all "
                   "(default 50); a run that needs more is FAILED")
    p.add_argument("--restart", type=int_arg, default=30, help="GMRES restart length (default 30)")
    p.add_argument("--diag", type=float_arg, default=1.0, metavar="S",
                   help="diagonal = S x the row's off-diagonal magnitude sum (default 1, the "
                   "rules' matrix; other values are for testing and are not HPL-MxP runs)")
    p.add_argument("--json", type=output_path,
                   metavar="FILE", help="also write one JSON record per run")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="rank 0 shows the factorisation's progress on stderr")
    comm.add_transport_argument(p)
    p.add_argument("--blas-threads", type=int_arg, metavar="T", default=None,
                   help="BLAS threads per rank, as python -m hpcmac.hpl")
    return p


def check_args(args) -> None:
    """Pure: UsageError (one line) for flags out of range; the same on every rank."""
    from hpcmac.hpl_mxp.kernels import check_choice

    if args.blas_threads is not None and args.blas_threads < 0:
        raise UsageError(f"--blas-threads: expected an integer >= 0, found {args.blas_threads}")
    if args.maxit < 0:
        raise UsageError(f"--maxit: expected an integer >= 0, found {args.maxit}")
    if args.restart < 1:
        raise UsageError(f"--restart: expected an integer >= 1, found {args.restart}")
    if not math.isfinite(args.diag) or args.diag < 0:  # float_arg refuses nan and inf
        raise UsageError(f"--diag: expected a number >= 0, found {args.diag}")
    check_choice(args.backend, args.precision)


def run_bytes(n: int, nb: int, p: int, q: int, restart: int) -> int:
    """Bytes the largest rank holds for one run: HPL's [A | b] block and workspace
    (``hpcmac.hpl.config.run_bytes``), the float32 copy of A (half of it again), and
    GMRES's 2 x (restart + 1) vectors of N float64."""
    return hplconfig.run_bytes(n, nb, p, q) * 3 // 2 + 16 * (restart + 1) * n


def largest_n(nb: int, p: int, q: int, restart: int, nbytes: int) -> int:
    """The largest N with :func:`run_bytes` <= ``nbytes`` (0 when even N = 1 does not fit)."""
    lo, hi = 0, 1
    while run_bytes(hi, nb, p, q, restart) <= nbytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if run_bytes(mid, nb, p, q, restart) <= nbytes else (lo, mid)
    return lo


def check_memory(world, cfg: hplconfig.HPLConfig, restart: int, ranks_here: int) -> None:
    """Collective: UsageError on every rank when a run cannot fit the smallest rank's
    share of its host's memory (checked before any matrix is made)."""
    from hpcmac.limits import available_memory, gib

    per_rank = min(world.allgather_obj(available_memory(ranks_here)))
    for p, q in cfg.grids:
        if p * q > world.size:
            continue
        for nb in cfg.nbs:
            for n in cfg.ns:
                need = run_bytes(n, nb, p, q, restart)
                if need > per_rank:
                    where = getattr(cfg, "ns_where", "") or (
                        cfg.source if cfg.source.startswith("<") else f"{cfg.source}:6")
                    raise UsageError(
                        f"{where}: Ns: N={n} needs {gib(need)} per rank for HPL-MxP on the "
                        f"{p}x{q} grid (NB={nb}; A in float64 and float32), expected at most "
                        f"the {gib(per_rank)} available per rank (largest N that fits: "
                        f"{largest_n(nb, p, q, restart, per_rank)})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.blas_threads is not None:  # comm.init applies it (hpcmac.blas_threads)
        os.environ["HPCMAC_BLAS_THREADS"] = str(args.blas_threads)

    from hpcmac.hpl import driver as hpl_driver
    from hpcmac.hpl import job
    from hpcmac.hpl.progress import want_progress
    from hpcmac.hpl_mxp import report
    from hpcmac.hpl_mxp.driver import Driver, MxPOptions
    from hpcmac.launch.hostfile import job_hostfile

    world = comm.init(args.transport, args.transport_strict, announce=False,
                      hostfile=job_hostfile())
    cfg = job.load_config(world, args)
    if not cfg.threshold > 0.0:
        raise UsageError(f"{cfg.source}:13: threshold: expected a number > 0 for HPL-MxP (the "
                         f"refinement runs until the scaled residual is below it), found "
                         f"{cfg.threshold}")
    hplconfig.check_grids(cfg, world.size)
    check_memory(world, cfg, args.restart, hpl_driver.local_ranks(world))
    mxp = MxPOptions(args.precision, args.backend, args.maxit, args.restart, args.diag)
    return job.run(world, cfg, args.json, report.write_json, lambda out, on_result: Driver(
        world, cfg, mxp, out, show_progress=want_progress(args.progress), notes=sys.stderr,
        on_result=on_result))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
