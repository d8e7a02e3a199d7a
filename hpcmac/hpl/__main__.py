"""``mpirun -np 4 python -m hpcmac.hpl``: netlib HPL (LINPACK), in hpcmac.

Reads HPL.dat, runs every combination it lists, prints HPL.out. See ``--help``.
"""

from __future__ import annotations

import argparse
import os
import sys

from hpcmac import comm
from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.hpl import config as hplconfig
from hpcmac.io.inputs import int_arg
from hpcmac.io.outputs import output_path
from hpcmac.lifecycle import run_cli

DESCRIPTION = f"""\
Distributed FP64 LINPACK as netlib HPL 2.3: right-looking LU with partial
pivoting of netlib's random N x N matrix on a P x Q process grid, timed,
checked with HPL's scaled residual, reported in HPL.out's format.

Input (the first that applies):
  --dat FILE        this HPL.dat
  ./HPL.dat         when present in the working directory
  embedded default  N={hplconfig.DEFAULT_N} NB={hplconfig.DEFAULT_NB}, one variant (WR11C2R4),
                    grid P x Q from the rank count (P <= Q, as square as possible)
-N / --nb / -P / -Q then replace the file's Ns, NBs and grids.
"""

EPILOG = """\
HPL.dat (netlib's format: 31 lines; a value line may end in a comment):
  1-2   free text
  3     output file name (used when line 4 is neither 6 nor 7)
  4     device out: 6 = stdout, 7 = stderr, anything else = the file of line 3
  5-6   number of problem sizes, then the Ns (>= 0)
  7-8   number of block sizes, then the NBs (>= 1)
  9     PMAP: 0 = row-major, 1 = column-major placement of ranks on the grid
  10-12 number of grids, then the Ps, then the Qs (P*Q ranks each; grids too big
        for the job are skipped with a note, ranks beyond P*Q sit idle)
  13    threshold: a run PASSES when the scaled residual is below it (16.0);
        <= 0 turns the check off
  14-15 PFACTs, panel factorisation: 0 = left-looking, 1 = Crout, 2 = right-looking
  16-17 NBMINs: recursion stops at panels this narrow (>= 1)
  18-19 NDIVs: panels split into this many parts per recursion level (>= 2)
  20-21 RFACTs, recursive panel factorisation: 0 = left, 1 = Crout, 2 = right
  22-23 BCASTs, panel broadcast along process rows: 0 = 1ring, 1 = 1ringM,
        2 = 2ring, 3 = 2ringM, 4 = long (spread-roll), 5 = longM
  24-25 DEPTHs, look-ahead: 0 = none, 1 = factor the next panel while
        updating the rest
  26    SWAP, row swaps: 0 = binary-exchange, 1 = spread-roll (long), 2 = mix
  27    swapping threshold: with SWAP = 2, binary-exchange below this many
        columns, spread-roll above
  28    L1 form: 0 = transposed, 1 = no-transposed (storage of the panel's L)
  29    U form: 0 = transposed, 1 = no-transposed
  30    EQUIL: 0 = no, 1 = yes (equilibrate spread-roll swaps)
  31    ALIGN: memory alignment in doubles (> 0)
Lines after 31 are ignored. Every list line holds at least as many values as
its count line says; unknown codes are an error (netlib silently substitutes).

Output: HPL.out's lines (T/V N NB P Q Time Gflops; the residual line ending in
PASSED or FAILED; the closing counts). The T/V code, e.g. WR11C2R4, reads:
W(all time), R/C (PMAP), DEPTH, BCAST code, RFACT letter (L/C/R), NDIV,
PFACT letter, NBMIN. Time is the slowest rank's; Gflops = (2/3 N^3 + 3/2 N^2)
/ time / 1e9.

Exit status: 0 when every checked run passed, 1 when one FAILED, 2 on bad input.

Examples:
  mpirun -np 4 python -m hpcmac.hpl                    # embedded default, 2x2
  mpirun -np 2 python -m hpcmac.hpl -N 8000 --nb 256 -P 1 -Q 2 --json hpl.json
  mpirun -np 4 python -m hpcmac.hpl --dat jobs/hpl/HPL-small.dat
"""


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m hpcmac.hpl",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dat", metavar="FILE", help="read this HPL.dat (default: ./HPL.dat if "
                   "present, else the embedded default)")
    p.add_argument("-N", dest="ns", type=int_arg, nargs="+", metavar="N",
                   help="problem sizes, replacing the file's Ns")
    p.add_argument("--nb", dest="nbs", type=int_arg, nargs="+", metavar="NB",
                   help="block sizes, replacing the file's NBs")
    p.add_argument("-P", type=int_arg, help="process rows; with -Q, the one grid to run "
                   "(alone: Q = ranks // P)")
    p.add_argument("-Q", type=int_arg, help="process columns (alone: P = ranks // Q)")
    p.add_argument("--json", type=output_path,
                   metavar="FILE", help="also write one JSON record per run: tv, n, "
                   "nb, p, q, time_s, gflops, residual, passed, norm_a_inf, norm_x_inf, "
                   "norm_b_inf, then time_generate_s, time_check_s, peak_rss_mb (per grid "
                   "rank), peak_rss_phase_mb, matrix_mb (a JSON list, rewritten after each "
                   "run)")
    p.add_argument("--phases", action="store_true",
                   help="also print each run's generation, solve and check times and the "
                   "peak resident memory per rank in HPL.out (always in --json)")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="rank 0 shows columns factored, elapsed and ETA on stderr: "
                   "auto = when stderr is a terminal (default)")
    comm.add_transport_argument(p)
    p.add_argument("--blas-threads", type=int_arg, metavar="T", default=None,
                   help="BLAS threads per rank; 0 leaves BLAS alone. Default: the "
                   "OMP_NUM_THREADS/OPENBLAS_NUM_THREADS environment if set, else the "
                   "host's cores divided by the ranks on that host")
    return p


def _check_memory(world, cfg: hplconfig.HPLConfig, ranks_here: int) -> None:
    """Collective: UsageError on every rank when a run's matrix cannot fit the smallest
    rank's share of its host's memory (checked before any matrix is made)."""
    from hpcmac.limits import available_memory

    per_rank = min(world.allgather_obj(available_memory(ranks_here)))
    hplconfig.check_memory(cfg, world.size, per_rank)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.blas_threads is not None and args.blas_threads < 0:
        raise UsageError(f"--blas-threads: expected an integer >= 0, found {args.blas_threads}")
    if args.blas_threads is not None:   # comm.init applies it (hpcmac.blas_threads)
        os.environ["HPCMAC_BLAS_THREADS"] = str(args.blas_threads)

    from hpcmac.hpl import driver, job, report
    from hpcmac.hpl.progress import want_progress

    # the transport line waits until the input is known good: bad input is one line
    from hpcmac.launch.hostfile import job_hostfile

    world = comm.init(args.transport, args.transport_strict, announce=False,
                      hostfile=job_hostfile())
    cfg = job.load_config(world, args)
    hplconfig.check_grids(cfg, world.size)  # same verdict on every rank
    _check_memory(world, cfg, driver.local_ranks(world))
    return job.run(world, cfg, args.json, report.write_json, lambda out, on_result: driver.Driver(
        world, cfg, out, show_progress=want_progress(args.progress), notes=sys.stderr,
        on_result=on_result, show_phases=args.phases))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
