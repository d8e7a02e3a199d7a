"""Blocked generation and the blocked check against the whole-matrix formulas; phase memory."""

import sys

import numpy as np
import pytest

from hpcmac.comm.grid import Grid
from hpcmac.comm.local import LocalGroup
from hpcmac.hpl import matgen, memory, report, residual
from hpcmac.hpl.config import Variant
from hpcmac.hpl.driver import run_one
from hpcmac.linalg.lu import LUOptions, hpl_solve


@pytest.mark.parametrize("width", [1, 3, 7, 100])
def test_column_blocks_of_any_width_are_the_entries(width):
    n = 23
    rows, cols = np.arange(2, 19), np.array([0, 1, 5, 8, 9, 13, 22, 23])
    want = matgen.entries(rows, cols, n)
    got = np.full_like(want, np.nan)
    for j0, j1, block in matgen.column_blocks(rows, cols, n, width=width):
        got[:, j0:j1] = block
    np.testing.assert_array_equal(got, want)


def test_fill_writes_into_a_strided_view():
    n = 17
    big = np.zeros((40, 30), order="F")
    view = big[3:20, 2:29:2]  # 17 x 14, not contiguous
    matgen.fill(view, np.arange(17), np.arange(14), n)
    np.testing.assert_array_equal(view, matgen.entries(np.arange(17), np.arange(14), n))
    assert big[:3].sum() == 0 and big[:, 3].sum() == 0


def test_regenerated_check_equals_the_stored_one_and_numpy():
    n, nb = 57, 8
    grid = Grid(LocalGroup(), 1, 1)
    full = matgen.entries(np.arange(n), np.arange(n + 1), n)
    x = np.linspace(-3.0, 1.0, n)
    stored = residual.check_solution(matgen.generate(n, nb, grid), x)
    regen = residual.check_regenerated(n, nb, grid, x)
    want = dict(norm_a_inf=np.abs(full[:, :n]).sum(1).max(),
                norm_a_1=np.abs(full[:, :n]).sum(0).max(),
                norm_b_inf=np.abs(full[:, n]).max(),
                resid0=np.abs(full[:, :n] @ x - full[:, n]).max(),
                norm_x_inf=3.0, norm_x_1=np.abs(x).sum())
    for key, value in want.items():
        assert stored[key] == pytest.approx(value, rel=1e-12), key
        assert regen[key] == pytest.approx(value, rel=1e-12), key


def test_check_solution_leaves_the_matrix_alone():
    grid = Grid(LocalGroup(), 1, 1)
    a = matgen.generate(30, 4, grid)
    before = a.local.copy()
    residual.check_solution(a, np.ones(30))
    np.testing.assert_array_equal(a.local, before)


PHASE_PEAK_CHECK = """\
import time
import numpy as np
from hpcmac.hpl import memory
big = np.ones(60 * 2**20 // 8)  # 60 MiB, touched: this fresh process's high so far
del big
mark = memory.peak_rss_bytes()
meter = memory.PhasePeak(interval_s=0.005)
meter.start()  # a phase below the mark: sampled
mid = np.ones(20 * 2**20 // 8)
deadline = time.monotonic() + 10  # a loaded machine may not run the sampler at once
while meter._high < memory.rss_bytes() and time.monotonic() < deadline:
    time.sleep(0.005)
del mid
low = meter.stop()
assert memory.peak_rss_bytes() >= mark, "the mark was reset"
assert low < mark - 30 * 2**20, (low, mark)
assert low >= memory.rss_bytes() + 15 * 2**20, (low, memory.rss_bytes())
meter.start()  # a phase that sets a new high: the mark itself
top = np.ones(100 * 2**20 // 8)
del top
high = meter.stop()
assert high == memory.peak_rss_bytes() > mark, (high, memory.peak_rss_bytes(), mark)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-phase peaks are Linux's")
def test_phase_peak_is_its_own_and_leaves_the_kernels_mark_alone():
    # a fresh process: this one's history (earlier tests' peaks) would decide the marks
    import subprocess

    proc = subprocess.run([sys.executable, "-c", PHASE_PEAK_CHECK], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_run_one_reports_phases_in_the_record():
    grid = Grid(LocalGroup(), 1, 1)
    res = run_one(grid, 300, 32, Variant(0, 1, 1, 1, 2, 2, 4), LUOptions(), 16.0, hpl_solve)
    rec = res.record()
    assert res.passed
    assert list(rec)[:12] == ["tv", "n", "nb", "p", "q", "time_s", "gflops", "residual",
                              "passed", "norm_a_inf", "norm_x_inf", "norm_b_inf"]
    assert rec["time_generate_s"] > 0 and rec["time_check_s"] > 0
    assert rec["matrix_mb"] == [round(300 * 301 * 8 / 2**20, 1)]
    assert set(rec["peak_rss_phase_mb"]) == {"generate", "solve", "check"}
    assert rec["peak_rss_mb"][0] == max(rec["peak_rss_phase_mb"].values())
    text = report.phase_lines(res)
    assert "Max aggregated wall time generate" in text and "check" in text
    assert f"{rec['peak_rss_mb'][0]:.1f}" in text


def test_a_phase_that_raises_leaves_no_meter_behind():
    from hpcmac.hpl.driver import _Phases

    phases = _Phases()
    with pytest.raises(MemoryError):
        with phases.phase("solve"):
            assert phases._meter in memory._sampler._meters or memory.rss_bytes() == 0
            raise MemoryError
    assert phases._meter not in memory._sampler._meters
    assert "solve" not in phases.peak
    with phases.phase("check"):
        pass
    assert phases.peak["check"] > 0 and phases._meter not in memory._sampler._meters
