"""``python -m hpcmac.hpl_mxp`` on bad input, under tools/mpirun: one line on rank 0, exit 2,
no traceback, no hang; and the pure parts (matrix, report) without MPI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcmac import comm
from hpcmac.comm.grid import Grid
from hpcmac.hpl_mxp import matgen
from hpcmac.hpl_mxp.report import MxPResult, result_lines, write_json
from tests.unit.test_hpl_config import NETLIB_DAT

ROOT = Path(__file__).resolve().parents[2]
FITS = NETLIB_DAT.replace("2 1 4        Ps", "1 2 1  Ps").replace("2 4 1        Qs", "1 1 2  Qs")


def run_mxp(args, cwd, np_=2, timeout=90):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_MPIRUN_TIMEOUT=str(timeout),
               HPCMAC_QUIET_TRANSPORT="1")
    cmd = [str(ROOT / "tools" / "mpirun"), str(np_), sys.executable, "-m", "hpcmac.hpl_mxp",
           *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout + 30)


@pytest.mark.parametrize("args, dat, expect", [
    (["--precision", "float16"], None,
     "--precision float16: the numpy backend factors in float32 only"),
    (["--backend", "cuda"], None, "--backend: expected one of numpy, mlx, found 'cuda'"),
    (["--restart", "0"], None, "--restart: expected an integer >= 1, found 0"),
    (["--diag", "-1"], None, "--diag: expected a number >= 0, found -1.0"),
    (["--maxit", "1_0"], None, "python -m hpcmac.hpl_mxp: argument --maxit: expected an "
     "integer (ASCII digits), found '1_0'"),
    (["-N", "2000000", "-P", "1", "-Q", "2"], None, "-N: Ns: N=2000000 needs "),
    ([], FITS.replace("16.0         threshold", "0.0 threshold"),
     "bad.dat:13: threshold: expected a number > 0 for HPL-MxP"),
    ([], FITS.replace("29 30 34 35  Ns", "29 x 34 35"),
     "bad.dat:6: Ns: expected 4 integer(s) (N >= 0), found 'x'"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, args, dat, expect):
    if dat is not None:
        (tmp_path / "bad.dat").write_text(dat)
        args = [*args, "--dat", "bad.dat"]
    proc = run_mxp(args, tmp_path)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith(f"error: {expect}"), lines
    if "needs" in expect:  # says what would fit
        assert "available per rank (largest N that fits: " in lines[0], lines
    assert "Traceback" not in proc.stderr + proc.stdout


def test_matrix_is_hpl_off_the_diagonal_and_dominant_on_it():
    from hpcmac.hpl import matgen as hpl_matgen

    grid = Grid(comm.init("local"), 1, 1)
    n = 97
    a, b = matgen.generate(n, 16, grid)
    full = hpl_matgen.generate(n, 16, grid).local  # netlib's [A | b]
    off = ~np.eye(n, dtype=bool)
    assert np.array_equal(a.local[off], full[:, :n][off]) and np.array_equal(b, full[:, n])
    assert np.allclose(np.diag(a.local), np.abs(a.local * off).sum(axis=1), rtol=1e-14)
    half, _ = matgen.generate(n, 16, grid, diag=0.5)
    assert np.allclose(np.diag(half.local), 0.5 * np.diag(a.local), rtol=1e-14)


def test_report_of_a_breakdown_is_failed_and_json_has_no_nan(tmp_path):
    nan = float("nan")
    res = MxPResult(tv="WR11C2R4", n=10, nb=4, p=1, q=1, time_s=0.1, gflops=0.0,
                    residual=nan, passed=False, norm_a_inf=1.0, norm_x_inf=nan,
                    norm_b_inf=0.5, resid0=nan, history=[nan], note="zero pivot")
    text = result_lines(res, 16.0)
    assert "FAILED" in text and "PASSED" not in text and "NOT converged: zero pivot" in text
    write_json(str(tmp_path / "r.json"), [res])
    def strict(const):
        raise AssertionError(f"{const} is not JSON")

    rec = json.loads((tmp_path / "r.json").read_text(), parse_constant=strict)[0]
    assert rec["residual"] == "nan" and rec["passed"] is False and rec["history"] == ["nan"]
