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
    assert "argument -N: expected an integer (ASCII digits), found 'ten'" in error_lines(proc)[0]


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


def test_hostile_inputs_are_one_line_before_any_work(tmp_path):
    """Special files, NaN, non-ASCII digits, a matrix that cannot fit, an output that
    cannot be written: each one line and exit 2, before a matrix is generated."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "nan.dat").write_text(with_line(13, "nan  threshold"))
    (tmp_path / "digits.dat").write_text(with_line(6, "29 30 ٣٤ 35  Ns"))
    (tmp_path / "sub").mkdir()
    cases = [
        (["--dat", "fifo"], "error: --dat fifo: expected a regular file, found a pipe (FIFO)"),
        (["--dat", "/dev/zero"], "error: --dat /dev/zero: expected a regular file, found a "
                                 "character device"),
        (["--dat", "nan.dat"], "error: nan.dat:13: threshold: expected a finite number"),
        (["--dat", "digits.dat"], "error: digits.dat:6: Ns: expected 4 integer(s) (N >= 0), "
                                  "found '٣٤'"),
        (["-N", "10000000"], "error: -N: Ns: N=10000000 needs "),
        (["-N", "50", "--json", "no/such/dir.json"], "error: --json no/such/dir.json: cannot "
                                                     "write: directory 'no/such' does not exist"),
        (["-N", "50", "--json", "sub"], "error: --json sub: cannot write: it is a directory"),
        (["-N", "50", "--json", ""], "error: python -m hpcmac.hpl: argument --json: expected "
                                     "a file name ('-': standard output), found ''"),
    ]
    for args, start in cases:
        proc = run_hpl(args, tmp_path, np_=1, timeout=60)
        lines = error_lines(proc)
        assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith(start), (args, lines)
    assert "largest N that fits" in run_hpl(["-N", "10000000"], tmp_path, np_=1).stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "digits.dat", "fifo", "nan.dat", "sub"]  # no output was started


def test_outputs_replaced_whole_and_locked(tmp_path):
    """HPL.out and --json are written beside and renamed; a second job on the same
    file refuses to start with one line."""
    from hpcmac.hpl.config import DEFAULT_DAT

    dat = DEFAULT_DAT.format(n=40, nb=8, p=1, q=1)
    dat = dat.replace("HPL.out      output", "res.out  output").replace("6            device",
                                                                        "8  device")
    (tmp_path / "HPL.dat").write_text(dat)
    (tmp_path / "res.out").write_text("the previous results\n")
    from hpcmac.io.outputs import OutputLock

    with OutputLock(str(tmp_path / "res.json"), "test"):
        proc = run_hpl(["--json", "res.json"], tmp_path, np_=1, timeout=60)
    assert proc.returncode == 2
    assert error_lines(proc) == [
        f"error: --json res.json: another job (pid {os.getpid()}) is writing it (wait for it, "
        "or choose another file)"]
    assert (tmp_path / "res.out").read_text() == "the previous results\n"
    proc = run_hpl(["--json", "res.json"], tmp_path, np_=1)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "res.out").read_text()
    assert text.rstrip().endswith("=" * 80) and "End of Tests." in text
    import json

    assert [r["n"] for r in json.loads((tmp_path / "res.json").read_text())] == [40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["HPL.dat", "res.json", "res.out"]


def _dat(tmp_path, outfile: str, ns: str = "40", count: int = 1):
    from hpcmac.hpl.config import DEFAULT_DAT

    dat = DEFAULT_DAT.format(n=ns, nb=8, p=1, q=1)
    dat = dat.replace("HPL.out      output", f"{outfile}  output").replace(
        "6            device", "8  device").replace("1            # of problems sizes",
                                                      f"{count}  # of problems sizes")
    (tmp_path / "HPL.dat").write_text(dat)


def test_outputs_through_a_device_and_a_symlink(tmp_path):
    """HPL.out to a null device (mknod'd here, never /dev's) and --json through a
    symlink into another folder: the device stays a device, the link a link, and the
    link's target gets the results (issue 32: both used to be replaced by files)."""
    import json
    import stat

    try:
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.mknod(tmp_path / "full", stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("mknod needs root")
    _dat(tmp_path, "null")
    (tmp_path / "results").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "results" / "r.json")
    proc = run_hpl(["--json", "link.json"], tmp_path, np_=1, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)
    assert (tmp_path / "link.json").is_symlink()
    assert [r["n"] for r in json.loads((tmp_path / "results" / "r.json").read_text())] == [40]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "HPL.dat", "full", "link.json", "null", "results"]
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["r.json"]
    # a full disk: one line naming the path, exit 1, the device untouched; at np 2 too
    # (rank 0 shares the failure after the run: no abort banner)
    # --json to a FIFO: one JSON list, written once (a reader gets a document, and no
    # second open waits for a reader that has gone)
    import threading

    os.mkfifo(tmp_path / "pipe")
    got = []
    reader = threading.Thread(target=lambda: got.append((tmp_path / "pipe").read_text()))
    reader.start()
    _dat(tmp_path, "null", ns="40 48", count=2)
    proc = run_hpl(["--json", "pipe"], tmp_path, np_=1, timeout=60)
    reader.join(30)
    assert proc.returncode == 0, proc.stderr
    assert [r["n"] for r in json.loads(got[0])] == [40, 48] and (tmp_path / "pipe").is_fifo()
    proc = run_hpl(["--json", "full"], tmp_path, np_=1, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc) == ["error: --json full: cannot write: no space left on device"]
    _dat(tmp_path, "full")  # HPL.out to a full disk at np 2
    proc = run_hpl(["-P", "1", "-Q", "2"], tmp_path, np_=2, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc) == [
        "error: HPL.dat:3: output file full: cannot write: no space left on device"]
    assert stat.S_ISCHR(os.lstat(tmp_path / "full").st_mode)


def test_killed_sweep_leaves_no_temporary_for_long(tmp_path):
    """kill -9 mid-sweep leaves HPL.out's temporary behind; the next run removes it."""
    import signal
    import time

    _dat(tmp_path, "res.out", ns="300 300 300 300 300 300 300 300", count=8)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_QUIET_TRANSPORT="1")
    proc = subprocess.Popen([sys.executable, "-m", "hpcmac.hpl", "--json", "r.json"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (tmp_path / "r.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the first result is in: the sweep is under way
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = [p.name for p in tmp_path.glob(".res.out.*.tmp")]
    assert len(left) == 1, sorted(p.name for p in tmp_path.iterdir())
    _dat(tmp_path, "res.out")
    done = run_hpl(["--json", "r.json"], tmp_path, np_=1, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["HPL.dat", "r.json", "res.out"]
