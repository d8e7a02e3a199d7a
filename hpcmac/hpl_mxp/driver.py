"""The HPL-MxP driver: every combination of HPL.dat, timed and checked.

For each grid P x Q, N, NB and variant of the HPL.dat (in xhpl's order):

1. generate HPL-MxP's matrix in float64 and b (:mod:`hpcmac.hpl_mxp.matgen`),
   the float32 copy of ``[A | b]`` for the factorisation (as in HPL, b is
   factored with A, which gives ``L^-1 b``), and ``||A||_oo`` (untimed, as
   generation);
2. barrier; time the LU without pivoting of the float32 copy (hpcmac.linalg's
   LU with the variant's PFACT, RFACT, BCAST, DEPTH, SWAP; on the MLX backend
   the trailing update in the chosen precision) and the FP64 GMRES refinement
   (:mod:`hpcmac.hpl_mxp.refine`); the run's time is the slowest rank's;
3. Gflops = (2/3 N^3 + 3/2 N^2) / time / 1e9, HPL's count (the refinement's
   work is not counted, its time is);
4. PASSED when the refinement reached HPL's scaled residual below the
   threshold; FAILED when it did not within the iteration limit, or when the
   low-precision LU met an exactly zero pivot (then there is no preconditioner).

Collective calls say so; everything else is local.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.comm.grid import Grid
from hpcmac.hpl.config import HPLConfig, Variant
from hpcmac.hpl.progress import Progress
from hpcmac.hpl.report import gflops
from hpcmac.hpl.sweep import Sweep
from hpcmac.hpl_mxp import kernels, matgen, refine
from hpcmac.hpl_mxp.report import MxPResult, header, result_lines
from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.lu import LUOptions, lu_factor_dist

EPS = refine.EPS


@dataclass(frozen=True)
class MxPOptions:
    """What HPL-MxP adds to HPL.dat (global: the same on every rank)."""

    precision: str = "float32"  # float32 | bfloat16 | float16
    backend: str = "numpy"  # numpy | mlx
    maxit: int = 50  # GMRES iterations in all
    restart: int = 30  # GMRES restart length
    diag: float = 1.0  # a_ii = diag * (row's off-diagonal magnitude sum); 1 = the rules


def _max(group: Group, *values: float) -> list[float]:
    return [float(v) for v in group.allreduce(np.array(values, dtype=np.float64), op="max")]


def run_one(grid: Grid, n: int, nb: int, variant: Variant, options: LUOptions,
            threshold: float, mxp: MxPOptions,
            progress: Callable[[int, int], None] | None = None) -> MxPResult:
    """Collective over ``grid.all`` (in-grid ranks only): one timed, checked HPL-MxP run."""
    a, b = matgen.generate(n, nb, grid, mxp.diag)
    lu = _low_copy(a, b)
    norm_a = refine.norm_inf(a)
    gemm = kernels.mlx_gemm(mxp.precision) if mxp.backend == "mlx" else None
    grid.all.barrier()
    start = time.time()
    t0 = time.perf_counter()
    note = ""
    try:
        if n > 0:
            lu_factor_dist(lu, options, progress=progress, gemm=gemm)
    except np.linalg.LinAlgError as exc:  # raised on every grid rank alike
        note = f"the {mxp.precision} LU without pivoting broke down ({exc}): no preconditioner"
    t1 = time.perf_counter()
    if not note:
        ref = refine.refine(a, lu, b, threshold=threshold, maxit=mxp.maxit,
                            restart=mxp.restart, norm_a=norm_a)
        chk = ref.check
    else:
        ref = None
        chk = refine.Check(float("nan"), float("nan"), norm_a, float("nan"),
                           float(np.abs(b).max()) if n else 0.0)
    t2 = time.perf_counter()
    end = time.time()
    t_lu, t_ir, wall = _max(grid.all, t1 - t0, t2 - t1, t2 - t0)
    res = MxPResult(
        tv=variant.tv, n=n, nb=nb, p=grid.nprow, q=grid.npcol, time_s=wall,
        gflops=gflops(n, wall), residual=chk.residual, passed=False,
        norm_a_inf=chk.norm_a_inf, norm_x_inf=chk.norm_x_inf, norm_b_inf=chk.norm_b_inf,
        resid0=chk.resid0, start=start, end=end,
        precision=mxp.precision, backend=mxp.backend, time_factor_s=t_lu, time_refine_s=t_ir,
    )
    if ref is not None:
        res.iterations, res.restarts = ref.iterations, ref.restarts
        res.converged, res.history = ref.converged, list(ref.history)
        if not ref.converged:
            why = ("the residual is not finite" if not np.isfinite(chk.residual)
                   else f"the iteration limit ({mxp.maxit}) ran out")
            note = f"{why}; scaled residual {chk.residual:.3e} at the end"
    res.note = note
    # never PASSED unless the refinement converged to the threshold
    res.passed = bool(res.converged and chk.residual < threshold)
    return res


def _low_copy(a: DistMatrix, b: np.ndarray) -> DistMatrix:
    """Local: ``[A | b]`` in float32 (N x N+1, ``a``'s layout): factored together, as in HPL,
    so that the factorisation also yields ``L^-1 b``."""
    n = a.gshape[0]
    lu = DistMatrix.empty((n, n + 1), a.grid, a.mb, a.nb, np.float32)
    if lu.local.size:
        ln = a.local.shape[1]
        lu.local[:, :ln] = a.local
        if lu.local.shape[1] > ln:  # this process column holds b
            lu.local[:, ln] = b[lu.rows]
    return lu


class Driver(Sweep):
    """Runs every combination of an HPLConfig with HPL-MxP (collective: every rank).

    ``out`` is the HPL.out stream on world rank 0 (None elsewhere).
    """

    def __init__(self, world: Group, cfg: HPLConfig, mxp: MxPOptions, out: TextIO | None,
                 show_progress: bool = False, notes: TextIO | None = None,
                 on_result: Callable[[list[MxPResult]], None] | None = None):
        super().__init__(world, cfg, out, show_progress, notes, on_result)
        self.mxp = mxp

    def header(self) -> str:
        m = self.mxp
        return header(self.cfg, EPS, m.precision, m.backend, m.maxit, m.restart, m.diag)

    def _one(self, grid: Grid, n: int, nb: int, v: Variant) -> None:
        label = f"{v.tv} N={n} NB={nb} {grid.nprow}x{grid.npcol} {self.mxp.precision}"
        prog = Progress(label) if self.show_progress else None
        options = LUOptions(**self.cfg.lu_options(v), pivoting=False)
        try:
            res = run_one(grid, n, nb, v, options, self.cfg.threshold, self.mxp, prog)
        finally:
            if prog is not None:
                prog.close()
        if res.passed:
            self.kpass += 1
        else:
            self.kfail += 1
        self.results.append(res)
        self._write(result_lines(res, self.cfg.threshold))
        self._report(grid)
