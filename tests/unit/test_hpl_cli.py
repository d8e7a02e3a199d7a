"""``python -m hpcmac.hpl`` on bad input, under tools/mpirun: one line on rank 0, exit 2,
no traceback, no hang."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_hpl_config import NETLIB_DAT, with_line

ROOT = Path(__file__).resolve().parents[2]
NP = 2


def run_hpl(args, cwd, np_=NP, timeout=90, quiet=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_MPIRUN_TIMEOUT=str(timeout))
    env.pop("HPCMAC_QUIET_TRANSPORT", None)
    if quiet:
        env["HPCMAC_QUIET_TRANSPORT"] = "1"
    cmd = [str(ROOT / "tools" / "mpirun"), str(np_), sys.executable, "-m", "hpcmac.hpl", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout + 30)


def error_lines(proc):
    """Every non-blank stderr line (the transport log is silenced by HPCMAC_QUIET_TRANSPORT):
    rank 0's error alone, no launcher banner, nothing from other ranks."""
    return [ln for ln in proc.stderr.splitlines() if ln.strip()]


# every grid of the netlib sample needs 4 ranks: make them fit NP so other errors show
FITS = with_line(11, "1 2 1  Ps").replace("2 4 1        Qs", "1 1 2  Qs")
LINES = FITS.splitlines()


@pytest.mark.parametrize(
    "name, text, expect",
    [
        ("missing line", "\n".join(LINES[:17]) + "\n",
         "bad.dat:18: number of NDIVs: expected a line, found end of file"),
        ("text for a number", FITS.replace("29 30 34 35  Ns", "29 30 abc 35"),
         "bad.dat:6: Ns: expected 4 integer(s) (N >= 0), found 'abc'"),
        ("negative N", FITS.replace("29 30 34 35  Ns", "29 -30 34 35"),
         "bad.dat:6: Ns: expected N >= 0, found '-30'"),
        ("every grid too big", NETLIB_DAT,
         "bad.dat:11-12: Ps x Qs: expected at least one grid with P*Q <= 2 (the rank count), "
         "found 2x2 1x4 4x1"),
        ("unknown variant code", FITS.replace("0            BCASTs", "9  BCASTs"),
         "bad.dat:23: BCASTs: expected one of 0=1ring"),
    ],
)
def test_bad_hpl_dat(tmp_path, name, text, expect):
    (tmp_path / "bad.dat").write_text(text)
    proc = run_hpl(["--dat", "bad.dat"], tmp_path)
    lines = error_lines(proc)
    assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1, (name, lines)
    assert lines[0].startswith(f"error: {expect}"), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_hpl_dat_in_working_directory_is_read(tmp_path):
    (tmp_path / "HPL.dat").write_text(FITS.replace("29 30 34 35  Ns", "29 -1 34 35"))
    proc = run_hpl([], tmp_path)
    assert proc.returncode == 2
    assert error_lines(proc) == ["error: HPL.dat:6: Ns: expected N >= 0, found '-1'"]


def test_transport_line_only_once_the_input_is_good(tmp_path):
    """Bad input is one line even with the transport log on; a good run logs the transport."""
    (tmp_path / "HPL.dat").write_text(FITS.replace("29 30 34 35  Ns", "29 -1 34 35"))
    proc = run_hpl([], tmp_path, quiet=False)
    assert proc.returncode == 2
    assert error_lines(proc) == ["error: HPL.dat:6: Ns: expected N >= 0, found '-1'"]
    (tmp_path / "HPL.dat").unlink()
    proc = run_hpl(["-N", "64", "--nb", "16", "-P", "1", "-Q", "2", "--progress", "off"],
                   tmp_path, quiet=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [ln for ln in error_lines(proc) if ln.startswith("transport: ")], proc.stderr


def test_bad_flags_and_missing_file(tmp_path):
    proc = run_hpl(["--dat", "nope.dat"], tmp_path, np_=1)
    assert proc.returncode == 2
    assert error_lines(proc)[0].startswith("error: --dat nope.dat: cannot read")
    proc = run_hpl(["-N", "ten"], tmp_path, np_=1)
    assert proc.returncode == 2 and len(error_lines(proc)) == 1
    assert "argument -N: invalid int value: 'ten'" in error_lines(proc)[0]


def test_help_explains_options_and_fields(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpcmac.hpl", "--help"], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0
    for word in ("--dat", "-N", "--nb", "-P", "-Q", "--json", "--progress", "--blas-threads",
                 "PFACTs", "NBMINs", "NDIVs", "RFACTs", "BCASTs", "DEPTHs", "SWAP",
                 "swapping threshold", "L1 form", "U form", "EQUIL", "ALIGN", "threshold",
                 "PMAP", "device out", "WR11C2R4"):
        assert word in proc.stdout, word
