"""``python -m hpcmac.bench.mpi_wheels --venv OTHER``: this venv's MPI wheel beside another's.

Issue #17 asks to choose the MPI wheel by numbers. This runs, in interleaved
rounds (the order alternates), the same commands under this environment's
``mpirun`` (the Open MPI wheel) and under the ``mpirun`` of ``--venv`` (a
throwaway venv with, e.g., ``pip install mpich mpi4py numpy scipy threadpoolctl``;
hpcmac itself comes from this checkout through PYTHONPATH):

* ``mpirun -np 4 python -c pass`` (the launcher alone),
* ``mpirun -np 4 python -c 'from mpi4py import MPI'`` (``MPI_Init``; Open MPI both
  with its defaults and with the ``ofi`` components off, as hpcmac starts it on a
  host without RDMA hardware),
* ``mpirun -np P*Q python -m hpcmac.hpl -N N -P P -Q Q`` for each ``--cases``
  entry ``N:PxQ`` (default 1000:2x2, the start-up case of ``--whole-job``),
* netlib's ``xhpl`` at the first case, when ``--xhpl`` is given (the reference
  of the start-up target).

Each launcher gets what it needs to run more ranks than cores as root (Open
MPI: ``--oversubscribe --bind-to none``; MPICH's Hydra needs nothing). One BLAS
thread per rank. Medians of wall time from starting ``mpirun`` to its exit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output
from hpcmac.lifecycle import run_cli

_OFI_OFF = {"OMPI_MCA_btl": "^ofi", "OMPI_MCA_mtl": "^ofi", "OMPI_MCA_pml": "ob1"}


def implementation(mpirun: str) -> str:
    """'Open MPI', 'MPICH' or the first line of ``mpirun --version``."""
    out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                         timeout=30).stdout
    if "Open MPI" in out:
        return "Open MPI"
    if "HYDRA" in out or "MPICH" in out:
        return "MPICH"
    return out.splitlines()[0] if out else "unknown"


def launcher(venv_bin: str, ranks: int) -> tuple[list[str], str]:
    """(mpirun argv up to the command, implementation name) for the venv's ``mpirun``."""
    mpirun = os.path.join(venv_bin, "mpirun")
    if not os.access(mpirun, os.X_OK):
        raise UsageError(f"{mpirun}: not found (the venv needs an MPI wheel)")
    impl = implementation(mpirun)
    argv = [mpirun, "-np", str(ranks)]
    if impl == "Open MPI":
        argv += ["--oversubscribe", "--bind-to", "none"]
    return argv, impl


def parse_case(text: str) -> tuple[int, int, int]:
    """``N:PxQ`` -> (N, P, Q); UsageError naming the flag otherwise."""
    try:
        n, grid = text.split(":")
        p, q = grid.lower().split("x")
        n, p, q = int(n), int(p), int(q)
        if n < 1 or p < 1 or q < 1:
            raise ValueError
    except ValueError:
        raise UsageError(f"--cases {text!r}: expected N:PxQ, e.g. 1000:2x2") from None
    return n, p, q


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m hpcmac.bench.mpi_wheels",
                       description=__doc__.split("\n")[0])
    p.add_argument("--venv", required=True, metavar="DIR",
                   help="the other environment (its bin/mpirun and bin/python)")
    p.add_argument("--cases", nargs="+", default=["1000:2x2"], metavar="N:PxQ",
                   help="HPL jobs to run under each (default 1000:2x2)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--xhpl", metavar="PATH", help="netlib's xhpl, run at the first case "
                   "under --xhpl-mpirun as the reference")
    p.add_argument("--xhpl-mpirun", default="/usr/bin/mpirun.openmpi")
    p.add_argument("--json", type=checked_output("--json"), metavar="FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        raise UsageError("--rounds must be >= 1")
    cases = [parse_case(c) for c in args.cases]
    from hpcmac.bench.hpl_run import clean_env, hpl_dat
    from hpcmac.bench.hpl_whole import _coretype, find_xhpl, precompile

    here = os.path.dirname(sys.executable)
    there = os.path.join(os.path.abspath(args.venv), "bin")
    envs = {}
    for label, bindir in (("this", here), ("other", there)):
        _, impl = launcher(bindir, 1)
        envs[label] = (bindir, impl)
    root = str(Path(__file__).resolve().parents[2])
    base = clean_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1",
                      PYTHONPATH=root, **_coretype())
    hpl_flags = ["--progress", "off", "--blas-threads", "1"]
    jobs = []  # (name, argv, extra env, needs PASSED)
    for bindir, impl in envs.values():
        py = os.path.join(bindir, "python")
        four, _ = launcher(bindir, 4)
        jobs.append((f"{impl}: python -c pass", four + [py, "-c", "pass"], {}, False))
        if impl == "Open MPI":
            jobs.append((f"{impl}: from mpi4py import MPI (defaults)",
                         four + [py, "-c", "from mpi4py import MPI"], {}, False))
            jobs.append((f"{impl}: from mpi4py import MPI (ofi off)",
                         four + [py, "-c", "from mpi4py import MPI"], _OFI_OFF, False))
        else:
            jobs.append((f"{impl}: from mpi4py import MPI",
                         four + [py, "-c", "from mpi4py import MPI"], {}, False))
        for n, p, q in cases:
            mpirun, _ = launcher(bindir, p * q)
            jobs.append((f"{impl}: hpcmac.hpl N={n} {p}x{q}",
                         mpirun + [py, "-m", "hpcmac.hpl", "-N", str(n), "--nb", "192", "-P",
                                   str(p), "-Q", str(q), *hpl_flags], {}, True))
    if args.xhpl:
        xhpl = find_xhpl(args.xhpl)
        n, p, q = cases[0]
        root_flag = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        over = ["--oversubscribe"] if p * q > (os.cpu_count() or 1) else []
        jobs.append((f"netlib xhpl N={n} {p}x{q}", [args.xhpl_mpirun, *root_flag, "-np",
                     str(p * q), *over, "--bind-to", "none", xhpl], {"xhpl": "1"}, True))
    precompile()
    load0 = os.getloadavg()
    print(f"# MPI wheels: {envs['this'][1]} ({here}) vs {envs['other'][1]} ({there}); "
          f"{args.rounds} rounds, {os.cpu_count()} cores, load average {load0[0]:.1f}",
          flush=True)
    times: dict[str, list[float]] = {name: [] for name, *_ in jobs}
    with tempfile.TemporaryDirectory(prefix="hpcmac-mpi-wheels-") as tmp:
        for r in range(args.rounds):
            for name, cmd, extra, check in (jobs if r % 2 == 0 else jobs[::-1]):
                env = dict(base, **{k: v for k, v in extra.items() if k != "xhpl"})
                if "xhpl" in extra:  # Debian's Open MPI for netlib's xhpl, its HPL.dat
                    env["PATH"] = "/usr/bin:/bin:" + env.get("PATH", "")
                    n, p, q = cases[0]
                    Path(tmp, "HPL.dat").write_text(hpl_dat(n, 192, p, q))
                else:
                    Path(tmp, "HPL.dat").unlink(missing_ok=True)
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True,
                                      timeout=600)
                times[name].append(time.perf_counter() - t0)
                if proc.returncode != 0 or (check and "PASSED" not in proc.stdout):
                    raise RuntimeError(f"{name}: exit {proc.returncode}\n"
                                       f"{(proc.stdout + proc.stderr)[-2000:]}")
    load1 = os.getloadavg()
    med = {name: statistics.median(v) for name, v in times.items()}
    ref = next((med[name] for name in med if name.startswith("netlib")), None)
    print(f"\n{'job':<52} {'median s':>8} {'min':>6} {'max':>6}" + ("  vs xhpl" if ref else ""))
    for name, v in times.items():
        line = f"{name:<52} {med[name]:8.3f} {min(v):6.3f} {max(v):6.3f}"
        print(line + (f"  {med[name] / ref:6.2f}" if ref else ""))
    print(f"# wall from mpirun start to exit; load average {load1[0]:.1f} at the end "
          "(shared machine)")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(dict(times=times, median=med, load_start=load0,
                                                load_end=load1), indent=1), what="--json")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
