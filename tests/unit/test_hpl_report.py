"""HPL.out lines in netlib's exact layout, the Gflops formula, the --json record."""

import json

import pytest

from hpcmac.hpl import config, report
from hpcmac.hpl.driver import EPS, scaled_residual


def result(**kw):
    base = dict(tv="WR11C2R4", n=8000, nb=256, p=1, q=2, time_s=3.5, gflops=97.6, residual=0.0043,
                passed=True, norm_a_inf=2000.0, norm_x_inf=5.0, norm_b_inf=0.5)
    base.update(kw)
    return report.RunResult(**base)


def test_gflops_formula():
    n, t = 8000, 4.0
    assert report.gflops(n, t) == pytest.approx((2 / 3 * n**3 + 1.5 * n**2) / t / 1e9, rel=1e-14)
    assert report.gflops(10, 0.0) == 0.0


def test_result_line_matches_netlib_format():
    text = report.result_lines(result(), 16.0)
    lines = text.splitlines()
    # netlib: "W%c%1d%c%c%1d%c%1d%12d %5d %5d %5d %18.2f    %19.4e"
    assert lines[0] == ("WR11C2R4        8000   256     1     2               3.50"
                        "             9.7600e+01")
    assert lines[1].startswith("HPL_pdgesv() start time ") and lines[2] == ""
    assert lines[-1] == ("||Ax-b||_oo/(eps*(||A||_oo*||x||_oo+||b||_oo)*N)=   4.30000000e-03"
                         " ...... PASSED")
    assert "||A||_oo" not in text.split("N)=")[1]


def test_failed_run_prints_the_norms():
    text = report.result_lines(result(residual=1e6, passed=False), 16.0)
    assert "...... FAILED" in text
    assert "||A||_oo . . . . . . . . . . . . . . . . . . . =        2000.000000" in text
    assert "||b||_oo . . . . . . . . . . . . . . . . . . . =           0.500000" in text


def test_header_and_footer():
    cfg = config.default_config(4)
    head = report.header(cfg, EPS)
    assert "N      :    6000 " in head
    assert "P      :       2 " in head and "Q      :       2 " in head
    assert "PFACT  :   Right " in head and "BCAST  :  1ringM " in head
    assert "SWAP   : Mix (threshold = 64)" in head
    assert ("- The relative machine precision (eps) is taken to be               1.110223e-16"
            in head)
    assert report.results_header().splitlines()[1] == (
        "T/V                N    NB     P     Q               Time                 Gflops")
    foot = report.footer(3, 1, 2, 16.0)
    assert "Finished      6 tests with the following results:" in foot
    assert "              1 tests completed and failed residual checks," in foot
    assert "tests completed without checking" in report.footer(3, 0, 0, 0.0)


def test_json_record_fields(tmp_path):
    path = tmp_path / "r.json"
    report.write_json(str(path), [result()])
    recs = json.loads(path.read_text())
    assert list(recs[0]) == ["tv", "n", "nb", "p", "q", "time_s", "gflops", "residual", "passed",
                             "norm_a_inf", "norm_x_inf", "norm_b_inf"]
    assert recs[0]["passed"] is True


def test_scaled_residual_is_netlibs():
    norms = dict(resid0=1e-12, norm_a_inf=1000.0, norm_x_inf=4.0, norm_b_inf=0.5)
    assert scaled_residual(norms, 100) == pytest.approx(1e-12 / (2.0**-53 * 4000.5 * 100))
    assert scaled_residual(norms, 0) == 0.0
