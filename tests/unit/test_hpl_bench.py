"""The HPL benchmark's pure parts: the input it writes, what it reads from hpcc."""

import argparse

import pytest

from hpcmac.bench import hpl as bench
from hpcmac.hpl import config

HPCCOUTF = """\
================================================================================
T/V                N    NB     P     Q               Time                 Gflops
--------------------------------------------------------------------------------
WR11C2R4        2000   128     1     1               0.30              1.788e+01
--------------------------------------------------------------------------------
||Ax-b||_oo/(eps*(||A||_oo*||x||_oo+||b||_oo)*N)=        0.0033034 ...... PASSED
================================================================================
HPL_Tflops=0.0178765
HPL_time=0.298678
HPL_eps=1.11022e-16
HPL_RnormI=1.55392e-12
HPL_Anorm1=523.014
HPL_AnormI=522.676
HPL_Xnorm1=1840.3
HPL_XnormI=4.05224
HPL_BnormI=0.49996
HPL_N=2000
HPL_NB=128
HPL_nprow=1
HPL_npcol=1
"""


def test_parse_hpccoutf():
    rec = bench.parse_hpccoutf(HPCCOUTF)
    assert rec["gflops"] == pytest.approx(17.8765)
    assert rec["time_s"] == pytest.approx(0.298678)
    assert (rec["norm_a_inf"], rec["norm_x_inf"], rec["norm_b_inf"]) == (522.676, 4.05224, 0.49996)
    assert rec["passed"] is True and rec["residual"] == pytest.approx(0.0033034)
    with pytest.raises(RuntimeError):
        bench.parse_hpccoutf("no HPL here")


def test_input_file_is_one_wr11c2r4_run():
    text = bench.hpl_dat(8000, 256, 1, 2, device=8) + bench.HPCC_TAIL
    cfg = config.parse_hpl_dat(text, "hpccinf.txt")
    assert (cfg.ns, cfg.nbs, cfg.grids, cfg.device) == ([8000], [256], [(1, 2)], 8)
    assert [r[3].tv for r in cfg.runs(2)] == ["WR11C2R4"]


def test_netlib_norms_at_n2000_as_hpcc_printed_them():
    """Debian's netlib HPL (hpcc) printed these norms for N=2000; hpcmac's matrix gives them."""
    import numpy as np
    import scipy.linalg

    from hpcmac.hpl import matgen

    n = 2000
    m = matgen.entries(np.arange(n), np.arange(n + 1), n)
    rec = bench.parse_hpccoutf(HPCCOUTF)
    assert float(f"{np.abs(m[:, :n]).sum(axis=1).max():.6g}") == rec["norm_a_inf"]
    assert float(f"{np.abs(m[:, :n]).sum(axis=0).max():.6g}") == 523.014  # HPL_Anorm1
    assert float(f"{np.abs(m[:, n]).max():.6g}") == rec["norm_b_inf"]
    x = scipy.linalg.solve(m[:, :n], m[:, n])
    assert float(f"{np.abs(x).max():.6g}") == rec["norm_x_inf"]
    assert float(f"{np.abs(x).sum():.5g}") == 1840.3  # HPL_Xnorm1


def test_grid_argument():
    assert bench._grid("1x2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        bench._grid("2by2")


def test_mxp_beside_fp64_in_the_same_rounds(tmp_path, capsys):
    """--mxp runs real MPI jobs of both programs (tiny N) and reports the ratio per grid."""
    import json

    out = tmp_path / "b.json"
    code = bench.main(["--mxp", "-N", "400", "--nb", "32", "--grids", "1x1", "--repeat", "2",
                       "--dgemm-n", "200", "--json", str(out), "--timeout", "120"])
    assert code == 0, capsys.readouterr()
    row = json.loads(out.read_text())["rows"][0]
    assert row["grid"] == "1x1" and row["passed"] and len(row["mxp_runs"]) == 2
    fp64, mxp = row["fp64_runs"], row["mxp_runs"]
    assert all(r["tv"] == "WR11C2R4" and r["n"] == 400 for r in fp64 + mxp)
    assert all(r["precision"] == "float32" and r["iterations"] >= 1 for r in mxp)
    ratios = sorted(m["gflops"] / f["gflops"] for f, m in zip(fp64, mxp))
    assert row["ratio"] == pytest.approx(sum(ratios) / 2)  # median of the two rounds
    assert 0 < row["refine_share"] < 1
    assert "HPL-MxP" in capsys.readouterr().out
