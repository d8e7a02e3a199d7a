"""HPL-MxP at np 1, 2, 4: float32 LU + FP64 GMRES passes HPL's check, agrees with numpy's
FP64 solve to the residual bound, MLX's half precisions need more iterations, and a matrix
the low-precision LU cannot precondition is FAILED (exit 1), never PASSED."""

import json
import os
import shutil
import tempfile

import numpy as np
import pytest

from hpcmac.comm.grid import Grid
from hpcmac.hpl.config import Variant
from hpcmac.hpl_mxp import matgen, refine
from hpcmac.hpl_mxp.__main__ import main
from hpcmac.hpl_mxp.driver import MxPOptions, run_one
from hpcmac.linalg.lu import LUOptions, lu_factor_dist
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

VARIANT = Variant(pmap=0, depth=1, bcast=1, rfact=1, ndiv=2, pfact=2, nbmin=4)
NOPIV = LUOptions(pivoting=False)


def grids(size):
    """1 x size, size x 1 and, at np 4, 2 x 2 (one grid at np 1)."""
    return sorted({(1, size), (size, 1)} | ({(2, 2)} if size == 4 else set()))


@pytest.mark.parametrize("n,nb", [(1000, 64), (333, 32)])
def test_solution_is_numpy_fp64_solve_to_the_residual_bound(n, nb):
    g = world()
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        a, b = matgen.generate(n, nb, grid)
        lu = a.astype(np.float32)
        lu_factor_dist(lu, NOPIV)
        out = refine.refine(a, lu, b)
        full = a.allgather()
        ok, why = out.converged and out.check.residual < 16.0, f"{p}x{q}: {out}"
        if ok and g.rank == 0:
            x_np = np.linalg.solve(full, b)  # the oracle: LAPACK's FP64 solve
            # forward error <= 2 cond(A) * backward error, the backward error being
            # below the HPL bound 16 N eps
            kappa = np.linalg.cond(full, np.inf)
            err = np.abs(out.x - x_np).max() / np.abs(x_np).max()
            bound = 2 * kappa * 16.0 * n * refine.EPS
            ok = err <= bound and kappa < 10  # diagonally dominant: well conditioned
            why = f"{p}x{q}: forward error {err:.3e}, bound {bound:.3e}, cond {kappa:.2f}"
            # the diagonal is the row's off-diagonal magnitude sum (the rules' matrix)
            off = np.abs(full).sum(axis=1) - np.abs(np.diag(full))
            ok = ok and np.allclose(np.diag(full), off, rtol=1e-12)
        parallel_assert(ok, why, grid.all)


def test_float32_run_passes_with_few_iterations():
    g = world()
    for p, q in grids(g.size):
        grid = Grid(g, p, q)
        res = run_one(grid, 1200, 64, VARIANT, NOPIV, 16.0, MxPOptions())
        ok = (res.passed and res.converged and 1 <= res.iterations <= 3
              and res.history[0] > 16.0 > res.history[-1] == res.residual
              and res.time_s >= res.time_factor_s > 0 and res.gflops > 0)
        parallel_assert(ok, f"{p}x{q}: {res}", grid.all)


def test_mlx_half_precisions_converge_with_more_iterations():
    pytest.importorskip("mlx.core")
    g = world()
    grid = Grid(g, *grids(g.size)[0])
    n, nb = 640, 64
    ref = run_one(grid, n, nb, VARIANT, NOPIV, 16.0, MxPOptions())
    for prec in ("float16", "bfloat16"):
        res = run_one(grid, n, nb, VARIANT, NOPIV, 16.0, MxPOptions(prec, "mlx"))
        # the first solution (from the LU alone) is worse, so GMRES does more work
        ok = (res.passed and res.iterations >= 2 and res.iterations > ref.iterations
              and res.history[0] > ref.history[0])
        parallel_assert(ok, f"{prec}: {res.iterations} iterations, history {res.history}; "
                        f"float32: {ref.iterations}, {ref.history}", grid.all)


def _main(args, g):
    tmp = g.bcast_obj(tempfile.mkdtemp(prefix="hpl-mxp-") if g.rank == 0 else None)
    js, out = os.path.join(tmp, "r.json"), os.path.join(tmp, "HPL.out")
    dat = os.path.join(tmp, "HPL.dat")
    if g.rank == 0:
        from hpcmac.hpl.config import DEFAULT_DAT

        text = DEFAULT_DAT.format(n=500, nb=32, p=1, q=g.size).replace(
            "HPL.out      output file name", f"{out}      output file name").replace(
            "6            device out", "8            device out")
        with open(dat, "w") as fh:
            fh.write(text)
    g.barrier()
    code = main(["--dat", dat, "--json", js, "--progress", "off", *args])
    g.barrier()
    recs = json.load(open(js)) if g.rank == 0 else None
    text = open(out).read() if g.rank == 0 else ""
    if g.rank == 0:
        shutil.rmtree(tmp)
    return code, recs, text


def test_main_reports_both_precisions_and_passes():
    g = world()
    code, recs, text = _main(["-N", "500", "300"], g)
    ok, why = code == 0, f"exit {code}"
    if g.rank == 0:
        ok = ok and [r["n"] for r in recs] == [500, 300]
        ok = ok and all(r["passed"] and r["converged"] and r["iterations"] >= 1
                        and r["precision"] == "float32" and r["q"] == g.size for r in recs)
        ok = ok and text.count("PASSED") == 2 and "FAILED" not in text.replace(
            "failed residual", "")
        ok = ok and "PRECISION: LU float32" in text and "residual check float64" in text
        ok = ok and "GMRES iterations" in text
        why = text[-1500:]
    parallel_assert(ok, why, g)


@pytest.mark.parametrize("args,note", [
    # dominance given up (diagonal 1/1000 of the rule's): cond_oo ~ 1e5 instead of ~4,
    # GMRES needs ~10 iterations; 3 are allowed
    (["--diag", "0.001", "--maxit", "3"], "iteration limit (3) ran out"),
    # zero diagonal: the LU without pivoting meets an exactly zero pivot at once
    (["--diag", "0"], "zero pivot at global index 0"),
])
def test_matrix_the_lu_cannot_precondition_is_failed_exit_1(args, note):
    g = world()
    code, recs, text = _main(args, g)
    ok, why = code == 1, f"exit {code}"
    if g.rank == 0:
        r = recs[0]
        ok = ok and not r["passed"] and not r["converged"] and note in r["note"]
        ok = ok and "FAILED" in text and "PASSED" not in text and "NOT HPL-MxP" in text
        ok = ok and "1 tests completed and failed residual checks" in text
        why = f"{why}: {r}"
    parallel_assert(ok, why, g)
