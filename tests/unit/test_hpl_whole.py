"""bench.hpl --whole-job's pure parts: finding xhpl, reading its result line, a job's wall/RSS."""

import sys

import pytest

from hpcmac.bench import hpl_whole
from hpcmac.errors import UsageError


def test_xhpl_must_be_named_and_executable(tmp_path, monkeypatch):
    monkeypatch.delenv("HPCMAC_XHPL", raising=False)
    with pytest.raises(UsageError, match="--xhpl PATH or HPCMAC_XHPL"):
        hpl_whole.find_xhpl(None)
    text = tmp_path / "xhpl"
    text.write_text("not a program")
    with pytest.raises(UsageError, match="not an executable"):
        hpl_whole.find_xhpl(str(text))
    text.chmod(0o755)
    monkeypatch.setenv("HPCMAC_XHPL", str(text))
    assert hpl_whole.find_xhpl(None) == str(text)


def test_result_line_of_netlib_output():
    out = ("T/V                N    NB     P     Q               Time                 Gflops\n"
           "--------------------------------------------------------------------------------\n"
           "WR11C2R4        1000   192     2     2               0.05             1.3836e+01\n")
    m = hpl_whole._LINE.search(out)
    assert m and m.group(1) == "1000" and float(m.group(5)) == 0.05
    assert float(m.group(6)) == pytest.approx(13.836)


def test_run_job_reports_wall_peak_rss_and_exit_code(tmp_path):
    code = "import sys; b = bytearray(64 * 2**20); b[::4096] = b'x' * len(b[::4096]); sys.exit(3)"
    wall, peak, text, rc = hpl_whole.run_job([sys.executable, "-c", code], None, str(tmp_path),
                                             60.0)
    assert rc == 3 and wall > 0 and peak > 64 * 2**20
