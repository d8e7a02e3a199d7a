"""The HPL driver: every combination of HPL.dat, timed and checked as netlib's xhpl.

For each grid P x Q (grids too big for the job are skipped with a note; ranks
beyond P*Q sit idle), each N, NB and algorithm variant:

1. generate netlib's [A | b] (each rank its own blocks, :mod:`hpcmac.hpl.matgen`);
2. barrier, time ``hpl_solve`` on every rank; the run's time is the slowest rank's;
3. Gflops = (2/3 N^3 + 3/2 N^2) / time / 1e9;
4. free the factors, regenerate A and b block by block (never stored whole,
   :mod:`hpcmac.hpl.residual`) and compute netlib's scaled residual
   ``||Ax-b||_oo / (eps * (||A||_oo * ||x||_oo + ||b||_oo) * N)`` with
   eps = 2**-53; PASSED when below the threshold.

Each phase (generate, solve, check) is timed and its peak resident memory
taken on every rank (:mod:`hpcmac.hpl.memory`): ``RunResult.phases``. So no
step holds more than the local piece of [A | b] plus O(N * NB) per rank.

Collective calls say so; everything else is local.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, TextIO

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.comm.grid import Grid
from hpcmac.hpl import matgen, memory
from hpcmac.hpl.config import HPLConfig, Variant
from hpcmac.hpl.progress import Progress
from hpcmac.hpl.report import RunResult, gflops, header, phase_lines, result_lines
from hpcmac.hpl.residual import check_regenerated, check_solution  # noqa: F401 (API)
from hpcmac.hpl.sweep import Sweep
from hpcmac.linalg.distmatrix import DistMatrix

#: netlib's eps: HPL_pdlamch(HPL_MACH_EPS), the unit round-off of float64
EPS = 2.0**-53

#: ``solve(a, opts, progress=..., after_panel=...) -> x`` (hpcmac.linalg.lu.hpl_solve)
Solver = Callable[..., np.ndarray]


def _max(group: Group, value: float) -> float:
    return float(group.allreduce(np.array([value], dtype=np.float64), op="max")[0])


def scaled_residual(norms: dict[str, float], n: int) -> float:
    """Netlib's ``||Ax-b||_oo / (eps * (||A||_oo * ||x||_oo + ||b||_oo) * N)`` (0 for N = 0)."""
    if n <= 0:
        return 0.0
    denom = EPS * (norms["norm_a_inf"] * norms["norm_x_inf"] + norms["norm_b_inf"]) * n
    return norms["resid0"] / denom if denom > 0 else float("inf")


class _Phases:
    """Local wall time and peak RSS of each phase of one run (not collective)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.peak: dict[str, int] = {}
        self._meter = memory.PhasePeak()

    @contextmanager
    def phase(self, name: str):
        """Time and meter the ``with`` body as phase ``name``; a body that raises records
        nothing and leaves no meter registered with the sampler thread."""
        self._meter.start()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds, peak = time.perf_counter() - t0, self._meter.stop()
        self.seconds[name], self.peak[name] = seconds, peak

    def gather(self, group: Group, local_bytes: int) -> dict:
        """Collective over ``group``: slowest rank's times, peaks per rank and per phase."""
        names = list(self.peak)
        rows = group.allgather_obj(([self.seconds[k] for k in names],
                                    [self.peak[k] for k in names], local_bytes))
        mb = 1024.0 * 1024.0
        return dict(
            time_generate_s=max(r[0][names.index("generate")] for r in rows),
            time_check_s=max(r[0][names.index("check")] for r in rows)
            if "check" in names else None,
            peak_rss_mb=[round(max(r[1]) / mb, 1) for r in rows],
            peak_rss_phase_mb={k: round(max(r[1][i] for r in rows) / mb, 1)
                               for i, k in enumerate(names)},
            matrix_mb=[round(r[2] / mb, 1) for r in rows],
        )


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
    phases = _Phases()
    with phases.phase("generate"):
        a = matgen.generate(n, nb, grid)
    local_bytes = a.local.nbytes
    grid.all.barrier()
    start = time.time()
    with phases.phase("solve"):
        if n > 0:
            x = solve(a, options, progress=progress, after_panel=after_panel)
        else:
            x = np.zeros(0)
    elapsed = phases.seconds["solve"]
    end = time.time()
    wall = _max(grid.all, elapsed)
    del a  # the factors: the check regenerates A block by block, so free them first

    res = RunResult(
        tv=variant.tv, n=n, nb=nb, p=grid.nprow, q=grid.npcol, time_s=wall,
        gflops=gflops(n, wall), residual=None, passed=None,
        norm_a_inf=0.0, norm_x_inf=0.0, norm_b_inf=0.0, start=start, end=end,
    )
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    if x.shape != (n,):
        raise RuntimeError(f"solver returned x of shape {x.shape}, expected ({n},)")
    with phases.phase("check"):
        norms = check_regenerated(n, nb, grid, x)
    for key, value in norms.items():
        setattr(res, key, value)
    if threshold > 0.0:
        res.residual = scaled_residual(norms, n)
        # NaN must fail: netlib's `resid1 < thrsh` is false for NaN
        res.passed = bool(res.residual < threshold)
    res.phases = phases.gather(grid.all, local_bytes)
    return res


def local_ranks(world: Group) -> int:
    """Collective over ``world``: how many ranks of the job share this host."""
    import socket

    hosts = world.allgather_obj(socket.gethostname())
    return hosts.count(hosts[world.rank])


class Driver(Sweep):
    """Runs every combination of an HPLConfig on a world group (collective: every rank).

    ``out`` is the HPL.out stream on world rank 0 (None elsewhere); ``show_phases``
    adds each run's phase times and peak memory per rank to it. ``solve`` and
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
        show_phases: bool = False,
    ):
        super().__init__(world, cfg, out, show_progress, notes, on_result)
        if solve is None or make_options is None:
            from hpcmac.linalg.lu import LUOptions, hpl_solve

            solve = hpl_solve if solve is None else solve
            make_options = LUOptions if make_options is None else make_options
        self.solve, self.make_options = solve, make_options
        self.after_panel = after_panel
        self.show_phases = show_phases

    def header(self) -> str:
        return header(self.cfg, EPS)

    def results_header_due(self, first: bool) -> bool:
        return first or self.cfg.threshold > 0.0  # xhpl: once when the check is off

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
        if self.show_phases:
            self._write(phase_lines(res))
        self._report(grid)
