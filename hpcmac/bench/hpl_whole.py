"""``python -m hpcmac.bench.hpl --whole-job``: the whole HPL job beside netlib's, same rounds.

What a user waits for and what memory a rank needs, not only the timed solve:
for each case it runs, alternating which goes first in each round,

* hpcmac: ``mpirun -np P*Q python -m hpcmac.hpl`` (the venv's Open MPI, one BLAS
  thread per rank, WR11C2R4, ``--json`` for the phase times);
* netlib HPL 2.3's ``xhpl`` (built from netlib's source against the serial
  OpenBLAS, ``--xhpl PATH`` or ``HPCMAC_XHPL``) under the ``mpirun`` of the MPI it
  was built with (``--xhpl-mpirun``, default Debian's ``/usr/bin/mpirun.openmpi``),
  ``OPENBLAS_CORETYPE=SkylakeX`` as in the hpcc comparison, same HPL.dat.

Each job's wall time is from starting ``mpirun`` to its exit (start-up, generation,
solve, check, teardown). Peak RSS per rank, the kernel's high-water mark (VmHWM)
either way: netlib's is ``wait4``'s ``ru_maxrss`` of its ``mpirun`` (Debian's
Open MPI 4.1 reaps the ranks itself, so that is the largest rank's); hpcmac's
ranks report theirs in ``--json`` (Open MPI 5's ranks are not reaped by the
``mpirun`` we wait for). Both sides run OpenBLAS's SkylakeX kernels
(``OPENBLAS_CORETYPE=SkylakeX``) where the CPU has AVX-512: OpenBLAS picks the
Haswell kernels on some AVX-512 CPUs (this VM's AMD EPYC), which would compare
BLAS builds instead of HPLs. hpcmac's bytecode is compiled first, as ``pip
install`` does (a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` would compile
every module at every start).
Default cases: N=8000 1x1 and N=16000 1x2 (NB=256), and start-up at N=1000 NB=192
on 2x2 (4 ranks). Medians over ``--rounds``; ratios hpcmac / netlib.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcmac.bench.hpl_run import clean_env, hpl_dat, oversubscribe, venv_mpirun
from hpcmac.errors import UsageError

#: (label, N, NB, P, Q)
CASES = [("whole job", 8000, 256, 1, 1), ("whole job", 16000, 256, 1, 2),
         ("start-up", 1000, 192, 2, 2)]
_LINE = re.compile(r"^W\S+\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s*$", re.M)


def find_xhpl(path: str | None) -> str:
    """netlib's xhpl from ``--xhpl`` or ``HPCMAC_XHPL``; UsageError naming both if absent."""
    path = path or os.environ.get("HPCMAC_XHPL")
    if not path:
        raise UsageError("--whole-job needs netlib's xhpl: --xhpl PATH or HPCMAC_XHPL "
                         "(netlib HPL 2.3 built against the serial OpenBLAS; see docs/hpl.md)")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise UsageError(f"--xhpl {path}: not an executable file")
    return path


def run_job(cmd: list[str], env: dict, cwd: str, timeout: float) -> tuple[float, int, str, int]:
    """(wall seconds, peak RSS bytes of the largest process of the tree, stdout, exit code)."""
    out = Path(cwd, "job.out")
    with open(out, "w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
    peak = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return wall, peak, out.read_text(), proc.returncode


def _hpcmac(n: int, nb: int, p: int, q: int, timeout: float) -> dict:
    np_ = p * q
    with tempfile.TemporaryDirectory(prefix="hpcmac-bench-whole-") as tmp:
        Path(tmp, "HPL.dat").write_text(hpl_dat(n, nb, p, q))
        js = Path(tmp, "out.json")
        env = clean_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1",
                         **_coretype())
        cmd = [venv_mpirun(), "-np", str(np_), *oversubscribe(np_), "--bind-to", "none",
               sys.executable, "-m", "hpcmac.hpl", "--dat", "HPL.dat", "--json", str(js),
               "--progress", "off", "--blas-threads", "1"]
        wall, peak, text, rc = run_job(cmd, env, tmp, timeout)
        if rc not in (0, 1) or not js.exists():
            raise RuntimeError(f"hpcmac HPL failed (exit {rc}):\n{text[-3000:]}")
        rec = json.loads(js.read_text())[0]
    per_rank = rec.get("peak_rss_mb") or [peak / 2**20]
    return dict(wall_s=wall, peak_rss_mb=max(per_rank), time_s=rec["time_s"],
                gflops=rec["gflops"], passed=rec["passed"], residual=rec["residual"],
                time_generate_s=rec.get("time_generate_s"), time_check_s=rec.get("time_check_s"),
                peak_rss_mb_per_rank=rec.get("peak_rss_mb"))


def _netlib(xhpl: str, mpirun: str, n: int, nb: int, p: int, q: int, timeout: float) -> dict:
    np_ = p * q
    with tempfile.TemporaryDirectory(prefix="hpcmac-bench-xhpl-") as tmp:
        Path(tmp, "HPL.dat").write_text(hpl_dat(n, nb, p, q))
        env = clean_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", **_coretype())
        env["PATH"] = "/usr/bin:/bin:" + env.get("PATH", "")
        root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        cmd = [mpirun, *root, "-np", str(np_), *oversubscribe(np_), "--bind-to", "none", xhpl]
        wall, peak, text, rc = run_job(cmd, env, tmp, timeout)
    m = _LINE.search(text)
    if rc != 0 or not m:
        raise RuntimeError(f"xhpl failed (exit {rc}):\n{text[-3000:]}")
    return dict(wall_s=wall, peak_rss_mb=peak / 2**20, time_s=float(m.group(5)),
                gflops=float(m.group(6)), passed="PASSED" in text)


def _coretype() -> dict[str, str]:
    """``OPENBLAS_CORETYPE=SkylakeX`` where the CPU has AVX-512 (Linux), else nothing."""
    try:
        with open("/proc/cpuinfo") as fh:
            return {"OPENBLAS_CORETYPE": "SkylakeX"} if " avx512f" in fh.read() else {}
    except OSError:
        return {}


def precompile() -> None:
    """Write hpcmac's bytecode (what pip does at install), so start-up is not compilation."""
    import compileall

    import hpcmac

    compileall.compile_dir(os.path.dirname(hpcmac.__file__), quiet=1)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def compare(args) -> int:
    """The --whole-job benchmark (``args`` from bench.hpl's parser)."""
    xhpl = find_xhpl(args.xhpl)
    mpirun = args.xhpl_mpirun
    if not os.access(mpirun, os.X_OK):
        raise UsageError(f"--xhpl-mpirun {mpirun}: not found (the mpirun of the MPI that "
                         "xhpl was built with)")
    precompile()
    cases = CASES if not args.cases else [c for c in CASES if c[1] in args.cases]
    load0 = os.getloadavg()
    print(f"# whole HPL job: hpcmac vs netlib xhpl ({xhpl}), {args.rounds} rounds, "
          f"{os.cpu_count()} cores, load average {load0[0]:.1f} at start", flush=True)
    rows = []
    for label, n, nb, p, q in cases:
        ours, theirs = [], []
        for r in range(args.rounds):
            order = ("hpcmac", "netlib") if r % 2 == 0 else ("netlib", "hpcmac")
            for who in order:
                if who == "hpcmac":
                    ours.append(_hpcmac(n, nb, p, q, args.timeout))
                    rec = ours[-1]
                else:
                    theirs.append(_netlib(xhpl, mpirun, n, nb, p, q, args.timeout))
                    rec = theirs[-1]
                print(f"  {label} N={n} {p}x{q} {who:<7} wall {rec['wall_s']:7.2f} s  "
                      f"solve {rec['time_s']:7.2f} s  peak RSS {rec['peak_rss_mb']:8.1f} MB  "
                      f"{'PASSED' if rec['passed'] else 'FAILED'}", flush=True)
        row = dict(case=label, n=n, nb=nb, grid=f"{p}x{q}", hpcmac_runs=ours, netlib_runs=theirs)
        for key in ("wall_s", "time_s", "peak_rss_mb"):
            row[f"hpcmac_{key}"] = _median(ours, key)
            row[f"netlib_{key}"] = _median(theirs, key)
            row[f"ratio_{key}"] = row[f"hpcmac_{key}"] / row[f"netlib_{key}"]
        row["hpcmac_generate_s"] = _median(ours, "time_generate_s")
        row["hpcmac_check_s"] = _median(ours, "time_check_s")
        rows.append(row)
    load1 = os.getloadavg()
    print()
    print(f"{'case':<10} {'N':>6} {'grid':>4} | {'wall hpcmac':>11} {'netlib':>7} {'ratio':>6} | "
          f"{'solve ratio':>11} | {'RSS/rank MB':>11} {'netlib':>7} {'ratio':>6} | "
          f"{'gen s':>6} {'check s':>7}")
    for r in rows:
        print(f"{r['case']:<10} {r['n']:6d} {r['grid']:>4} | {r['hpcmac_wall_s']:11.2f} "
              f"{r['netlib_wall_s']:7.2f} {r['ratio_wall_s']:6.2f} | {r['ratio_time_s']:11.2f} | "
              f"{r['hpcmac_peak_rss_mb']:11.1f} {r['netlib_peak_rss_mb']:7.1f} "
              f"{r['ratio_peak_rss_mb']:6.2f} | {r['hpcmac_generate_s']:6.2f} "
              f"{r['hpcmac_check_s']:7.2f}")
    print(f"# medians of {args.rounds} rounds; wall = mpirun start to exit; RSS = largest "
          f"process of the job; load average {load1[0]:.1f} at the end (shared machine)")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(dict(rows=rows, load_start=load0, load_end=load1,
                                                cores=os.cpu_count(), xhpl=xhpl), indent=1),
                     what="--json")
    return 0
