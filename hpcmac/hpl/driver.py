"""The HPL driver: every combination of HPL.dat, timed and checked as netlib's xhpl.

For each grid P x Q (grids too big for the job are skipped with a note; ranks
beyond P*Q sit idle), each N, NB and algorithm variant:

1. generate netlib's [A | b] (each rank its own blocks, :mod:`hpcmac.hpl.matgen`);
2. barrier, time ``hpl_solve`` on every rank; the run's time is the slowest rank's;
3. Gflops = (2/3 N^3 + 3/2 N^2) / time / 1e9;
4. regenerate A and b, and compute netlib's scaled residual
   ``||Ax-b||_oo / (eps * (||A||_oo * ||x||_oo + ||b||_oo) * N)`` with
   eps = 2**-53; PASSED when below the threshold.

Collective calls say so; everything else is local.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.comm.grid import Grid
from hpcmac.hpl import matgen
from hpcmac.hpl.config import HPLConfig, Variant
from hpcmac.hpl.progress import Progress
from hpcmac.hpl.report import (
    RunResult,
    footer,
    gflops,
    header,
    result_lines,
    results_header,
)
from hpcmac.linalg.distmatrix import DistMatrix

#: netlib's eps: HPL_pdlamch(HPL_MACH_EPS), the unit round-off of float64
EPS = 2.0**-53

#: ``solve(a, opts, progress=..., after_panel=...) -> x`` (hpcmac.linalg.lu.hpl_solve)
Solver = Callable[..., np.ndarray]


def _max(group: Group, value: float) -> float:
    return float(group.allreduce(np.array([value], dtype=np.float64), op="max")[0])


def check_solution(a: DistMatrix, x: np.ndarray) -> dict[str, float]:
    """Collective over ``a.grid``: netlib's norms of A, x, b and ``||Ax - b||_oo``.

    Parameters
    ----------
    a : DistMatrix, N x (N+1)
        The *original* [A | b] (regenerated, not the factored one).
    x : (N,) float64, the solution, replicated (the same on every grid rank).

    Returns
    -------
    dict with norm_a_inf, norm_a_1, norm_x_inf, norm_x_1, norm_b_inf, resid0;
    the same on every rank of the grid.
    """
    grid = a.grid
    n = a.gshape[0]
    cols = a.cols
    in_a = cols < n
    a_loc = a.local[:, in_a]  # (lm, local columns of A)
    b_loc = a.local[:, cols == n]  # (lm, 1) on b's process column, (lm, 0) elsewhere
    lm = a.local.shape[0]
    x = np.asarray(x, dtype=np.float64)
    out = {"norm_x_inf": float(np.abs(x).max()) if n else 0.0,
           "norm_x_1": float(np.abs(x).sum())}

    # ||A||_oo: row sums over the process row, then the max down the process column
    rows_abs = np.abs(a_loc).sum(axis=1)  # (lm,)
    if lm:
        grid.row.allreduce(rows_abs, op="sum", out=rows_abs)
    out["norm_a_inf"] = _max(grid.all, float(rows_abs.max()) if lm else 0.0)
    # ||A||_1: column sums down the process column, then the max along the row
    cols_abs = np.abs(a_loc).sum(axis=0)  # (local columns of A,)
    if cols_abs.size:
        grid.col.allreduce(cols_abs, op="sum", out=cols_abs)
    out["norm_a_1"] = _max(grid.all, float(cols_abs.max()) if cols_abs.size else 0.0)
    out["norm_b_inf"] = _max(grid.all, float(np.abs(b_loc).max()) if b_loc.size else 0.0)

    # r = A x - b: local partial products summed along the process row
    r = a_loc @ x[cols[in_a]] if a_loc.size else np.zeros(lm)  # (lm,)
    if b_loc.size:
        r = r - b_loc[:, 0]
    r = np.ascontiguousarray(r, dtype=np.float64)
    if lm:
        grid.row.allreduce(r, op="sum", out=r)
    out["resid0"] = _max(grid.all, float(np.abs(r).max()) if lm else 0.0)
    return out


def scaled_residual(norms: dict[str, float], n: int) -> float:
    """Netlib's ``||Ax-b||_oo / (eps * (||A||_oo * ||x||_oo + ||b||_oo) * N)`` (0 for N = 0)."""
    if n <= 0:
        return 0.0
    denom = EPS * (norms["norm_a_inf"] * norms["norm_x_inf"] + norms["norm_b_inf"]) * n
    return norms["resid0"] / denom if denom > 0 else float("inf")


def run_one(
    grid: Grid,
    n: int,
    nb: int,
    variant: Variant,
    options: Any,
    threshold: float,
    solve: Solver,
    progress: Callable[[int, int], None] | None = None,
    after_panel: Callable[[int, DistMatrix], None] | None = None,
) -> RunResult:
    """Collective over ``grid.all`` (in-grid ranks only): one timed, checked HPL run.

    ``options`` goes to ``solve`` unchanged; ``progress`` is local (pass it on the
    rank that shows progress, None elsewhere); ``after_panel`` is a test hook
    passed to ``solve``.
    """
    a = matgen.generate(n, nb, grid)
    grid.all.barrier()
    start = time.time()
    t0 = time.perf_counter()
    if n > 0:
        x = solve(a, options, progress=progress, after_panel=after_panel)
    else:
        x = np.zeros(0)
    elapsed = time.perf_counter() - t0
    end = time.time()
    wall = _max(grid.all, elapsed)
    del a  # the factors: free them before regenerating

    res = RunResult(
        tv=variant.tv, n=n, nb=nb, p=grid.nprow, q=grid.npcol, time_s=wall,
        gflops=gflops(n, wall), residual=None, passed=None,
        norm_a_inf=0.0, norm_x_inf=0.0, norm_b_inf=0.0, start=start, end=end,
    )
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    if x.shape != (n,):
        raise RuntimeError(f"solver returned x of shape {x.shape}, expected ({n},)")
    norms = check_solution(matgen.generate(n, nb, grid), x)
    for key, value in norms.items():
        setattr(res, key, value)
    if threshold > 0.0:
        res.residual = scaled_residual(norms, n)
        # NaN must fail: netlib's `resid1 < thrsh` is false for NaN
        res.passed = bool(res.residual < threshold)
    return res


def local_ranks(world: Group) -> int:
    """Collective over ``world``: how many ranks of the job share this host."""
    import socket

    hosts = world.allgather_obj(socket.gethostname())
    return hosts.count(hosts[world.rank])


class Driver:
    """Runs every combination of an HPLConfig on a world group (collective: every rank).

    ``out`` is the HPL.out stream on world rank 0 (None elsewhere). ``solve`` and
    ``make_options`` default to ``hpcmac.linalg.lu``'s ``hpl_solve`` and ``LUOptions``.
    """

    def __init__(
        self,
        world: Group,
        cfg: HPLConfig,
        out: TextIO | None,
        solve: Solver | None = None,
        make_options: Callable[..., Any] | None = None,
        show_progress: bool = False,
        notes: TextIO | None = None,
        on_result: Callable[[list[RunResult]], None] | None = None,
        after_panel: Callable[[int, DistMatrix], None] | None = None,
    ):
        if solve is None or make_options is None:
            from hpcmac.linalg.lu import LUOptions, hpl_solve

            solve = hpl_solve if solve is None else solve
            make_options = LUOptions if make_options is None else make_options
        self.world, self.cfg, self.out = world, cfg, out
        self.solve, self.make_options = solve, make_options
        self.show_progress = show_progress and world.rank == 0
        self.notes = notes
        self.on_result = on_result
        self.after_panel = after_panel
        self.results: list[RunResult] = []
        self.kpass = self.kfail = self.kskip = 0

    def _write(self, text: str) -> None:
        if self.out is not None and text:
            self.out.write(text)
            self.out.flush()

    def _note(self, text: str) -> None:
        if self.world.rank == 0 and self.notes is not None:
            self.notes.write(f"note: {text}\n")
            self.notes.flush()

    def run(self) -> int:
        """Collective: all runs; returns the number of runs that FAILED the check."""
        cfg, world = self.cfg, self.world
        self._write(header(cfg, EPS))
        per_grid = len(cfg.ns) * len(cfg.nbs) * sum(1 for _ in cfg.variants())
        first = True
        for p, q in cfg.grids:
            if p * q > world.size:
                self._note(f"grid {p}x{q} needs {p * q} ranks, have {world.size}: skipped")
                self.kskip += per_grid
                continue
            grid = Grid(world, p, q, order="col" if cfg.pmap == 1 else "row")
            if not grid.in_grid:
                continue  # idle for this grid
            for n in cfg.ns:
                for nb in cfg.nbs:
                    for v in cfg.variants():
                        if first or cfg.threshold > 0.0:
                            self._write(results_header())
                            first = False
                        self._one(grid, n, nb, v)
        self._write(footer(self.kpass, self.kfail, self.kskip, cfg.threshold))
        return self.kfail

    def _one(self, grid: Grid, n: int, nb: int, v: Variant) -> None:
        label = f"{v.tv} N={n} NB={nb} {grid.nprow}x{grid.npcol}"
        prog = Progress(label) if self.show_progress else None
        options = self.make_options(**self.cfg.lu_options(v))
        try:
            res = run_one(grid, n, nb, v, options, self.cfg.threshold, self.solve,
                          progress=prog, after_panel=self.after_panel)
        except np.linalg.LinAlgError as exc:
            # raised on every grid rank alike (an exactly zero pivot): netlib skips the run
            self.kskip += 1
            self._write(f"HPL WARNING: {label}: the solve reports {exc}, skip\n")
            return
        finally:
            if prog is not None:
                prog.close()
        if res.passed is False:
            self.kfail += 1
        else:
            self.kpass += 1
        self.results.append(res)
        self._write(result_lines(res, self.cfg.threshold))
        if self.on_result is not None and self.world.rank == 0:
            self.on_result(self.results)
