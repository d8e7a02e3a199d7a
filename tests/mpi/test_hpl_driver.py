"""HPL end to end at any rank count: PASSED on every grid that fits, for every variant,
N not a multiple of NB and N < NB; x equals scipy's; a corrupted factorisation FAILS."""

import io

import numpy as np
import pytest
import scipy.linalg

from hpcmac import comm
from hpcmac.comm.grid import Grid
from hpcmac.hpl import config, driver, matgen
from hpcmac.linalg import layout
from hpcmac.linalg.lu import LUOptions, hpl_solve
from hpcmac.testing import parallel_allclose, parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

GRIDS = [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1)]
# (N, NB): N not a multiple of NB, N < NB, and several panels per process
SIZES = [(37, 8), (5, 8), (64, 6)]


SOLVE, OPTIONS = hpl_solve, LUOptions


def _opts(pfact="right", rfact="crout", bcast="1ringM", depth=1, swap="mix", swap_threshold=64,
          nbmin=4, ndiv=2, l1_transposed=True, u_transposed=True, equil=True):
    return dict(pfact=pfact, nbmin=nbmin, ndiv=ndiv, rfact=rfact, bcast=bcast, depth=depth,
                swap=swap, swap_threshold=swap_threshold, l1_transposed=l1_transposed,
                u_transposed=u_transposed, equil=equil, align=8)


# every value of every option appears at least once
VARIANTS = [
    _opts(pfact="right", rfact="crout", bcast="1ring", depth=0, swap="binexch", nbmin=1),
    _opts(pfact="left", rfact="right", bcast="1ringM", depth=1, swap="spread", ndiv=3,
          l1_transposed=False),
    _opts(pfact="crout", rfact="left", bcast="2ring", depth=0, swap="mix", swap_threshold=4,
          u_transposed=False, nbmin=2),
    _opts(pfact="right", rfact="right", bcast="2ringM", depth=1, swap="mix", equil=False),
    _opts(pfact="left", rfact="crout", bcast="long", depth=1, swap="binexch", nbmin=2, ndiv=2),
    _opts(pfact="crout", rfact="right", bcast="longM", depth=0, swap="spread", equil=False),
]
FACT = {"left": 0, "crout": 1, "right": 2}
BCAST = {name: code for code, name in config.BCAST_NAMES.items()}


def _variant(o, pmap=0) -> config.Variant:
    return config.Variant(pmap, o["depth"], BCAST[o["bcast"]], FACT[o["rfact"]], o["ndiv"],
                          FACT[o["pfact"]], o["nbmin"])


def _grids(world):
    return [(p, q) for p, q in GRIDS if p * q <= world.size]


def test_generated_blocks_equal_netlib_formula_on_every_grid():
    world = comm.init("mpi")
    n, nb = 29, 4
    full = matgen.entries(np.arange(n), np.arange(n + 1), n)
    for p, q in _grids(world):
        grid = Grid(world, p, q)
        if not grid.in_grid:
            continue
        a = matgen.generate(n, nb, grid)
        rows = layout.global_indices(n, nb, grid.myrow, p)
        cols = layout.global_indices(n + 1, nb, grid.mycol, q)
        parallel_assert(np.array_equal(a.local, full[np.ix_(rows, cols)]), f"{p}x{q}", grid.all)


def test_check_solution_norms_equal_numpy():
    world = comm.init("mpi")
    n, nb = 23, 4
    full = matgen.entries(np.arange(n), np.arange(n + 1), n)
    x = np.linspace(-1.0, 2.0, n)
    want_r = np.abs(full[:, :n] @ x - full[:, n]).max()
    for p, q in _grids(world):
        grid = Grid(world, p, q)
        if not grid.in_grid:
            continue
        got = driver.check_solution(matgen.generate(n, nb, grid), x)
        want = [np.abs(full[:, :n]).sum(1).max(), np.abs(full[:, :n]).sum(0).max(),
                np.abs(full[:, n]).max(), want_r, 2.0, np.abs(x).sum()]
        keys = ["norm_a_inf", "norm_a_1", "norm_b_inf", "resid0", "norm_x_inf", "norm_x_1"]
        parallel_allclose([got[k] for k in keys], want, rtol=1e-12, msg=f"{p}x{q}",
                          group=grid.all)


@pytest.mark.parametrize("k", range(len(VARIANTS)))
def test_passed_on_every_grid_for_every_variant(k):
    world = comm.init("mpi")
    o = VARIANTS[k]
    for pmap in (0, 1):
        for p, q in _grids(world):
            grid = Grid(world, p, q, order="col" if pmap else "row")
            if not grid.in_grid:
                continue
            for n, nb in SIZES:
                res = driver.run_one(grid, n, nb, _variant(o, pmap), OPTIONS(**o), 16.0, SOLVE)
                parallel_assert(res.passed and res.residual < 16.0,
                                f"{res.tv} {p}x{q} N={n} NB={nb}: residual {res.residual}",
                                grid.all)
                parallel_assert(res.time_s > 0 and res.gflops > 0, "timing", grid.all)


def test_solution_equals_scipy():
    world = comm.init("mpi")
    n, nb = 50, 8
    full = matgen.entries(np.arange(n), np.arange(n + 1), n)
    want = scipy.linalg.solve(full[:, :n], full[:, n])
    for p, q in _grids(world):
        grid = Grid(world, p, q)
        if not grid.in_grid:
            continue
        x = SOLVE(matgen.generate(n, nb, grid), OPTIONS(**VARIANTS[1]))
        parallel_allclose(x, want, rtol=1e-10, atol=1e-12, msg=f"{p}x{q}", group=grid.all)


def _corrupt(n, nb):
    """after_panel hook: once the second panel (global columns nb..) is factored, add 1000
    to the trailing entry (n-1, n-1) on its owner, mid-run."""
    second = nb if n > nb else 0  # hpl_solve passes the panel's first global column

    def hook(j, a):
        g = a.grid
        if j == second and g.myrow == layout.owner(n - 1, nb, g.nprow) \
                and g.mycol == layout.owner(n - 1, nb, g.npcol):
            a.local[layout.g2l(n - 1, nb, g.nprow), layout.g2l(n - 1, nb, g.npcol)] += 1000.0

    return hook


def test_corrupted_factorisation_fails():
    world = comm.init("mpi")
    n, nb = 40, 8
    for p, q in _grids(world):
        grid = Grid(world, p, q)
        if not grid.in_grid:
            continue
        res = driver.run_one(grid, n, nb, _variant(VARIANTS[3]), OPTIONS(**VARIANTS[3]), 16.0,
                             SOLVE, after_panel=_corrupt(n, nb))
        parallel_assert(res.passed is False and res.residual > 1e3,
                        f"{p}x{q}: residual {res.residual}", grid.all)


def _cfg(text_grids, ns, nbs):
    cfg = config.default_config(1)
    cfg = config.apply_overrides(cfg, 1, ns=ns, nbs=nbs)
    cfg.grids = text_grids
    return cfg


def test_driver_reports_failed_skips_big_grids_and_leaves_extra_ranks_idle():
    world = comm.init("mpi")
    cfg = _cfg([(1, 1), (world.size + 1, 1)], [30], [8])
    out = io.StringIO() if world.rank == 0 else None
    notes = io.StringIO()
    d = driver.Driver(world, cfg, out, solve=SOLVE, make_options=OPTIONS, notes=notes,
                      after_panel=_corrupt(30, 8))
    failed = d.run()
    if world.rank == 0:
        text = out.getvalue()
        ok = (failed == 1 and "...... FAILED" in text
              and "     0 tests completed and passed residual checks," in text
              and "     1 tests completed and failed residual checks," in text
              and "     1 tests skipped because of illegal input values." in text
              and f"grid {world.size + 1}x1 needs" in notes.getvalue())
        parallel_assert(ok, text[-1500:] + notes.getvalue(), world)
    else:
        parallel_assert(d.results == [] and failed == 0, "idle rank ran something", world)


def test_driver_every_combination_passes():
    world = comm.init("mpi")
    cfg = _cfg([(p, q) for p, q in _grids(world)], [21, 3], [4])
    cfg.pfacts, cfg.nbmins = [0, 2], [2, 4]
    out = io.StringIO() if world.rank == 0 else None
    d = driver.Driver(world, cfg, out, solve=SOLVE, make_options=OPTIONS)
    failed = d.run()
    ok, text = failed == 0, ""
    if world.rank == 0:
        text = out.getvalue()
        runs = len(_grids(world)) * 2 * 4
        ok = ok and text.count("...... PASSED") == runs
        ok = ok and f"{runs:6d} tests completed and passed" in text
    parallel_assert(ok, text[-800:], world)
