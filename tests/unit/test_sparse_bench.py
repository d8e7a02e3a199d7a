"""A smoke run of ``python -m hpcmac.bench.sparse`` at a tiny size (PETSc's side when present)."""

import os
import subprocess
import sys

import pytest

from hpcmac.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_runs_tiny_and_says_whether_petsc_ran():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "hpcmac.bench.sparse", "--n2", "12",
                           "--n2-small", "8", "--n3", "5", "--ranks", "1", "--reps", "1",
                           "--spmv", "2", "--cg-iters", "3"],
                          env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for row in ("SpMV Gflops", "CG+Jacobi ms/iteration", "CG+AMG iterations",
                "CG+AMG time to solution", "AMG iteration growth 8^2 -> 12^2"):
        assert row in out, out
    assert ("PETSc 3." in out) != ("PETSc: not run" in out), out


def test_bench_refuses_bad_sizes():
    from hpcmac.bench.sparse import main

    with pytest.raises(UsageError, match="--n3: expected a positive integer"):
        main(["--n3", "1"])
    with pytest.raises(UsageError, match="--ranks: expected positive integers"):
        main(["--ranks", "0"])
