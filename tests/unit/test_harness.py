"""The MPI test harness cannot hang, and one rank's failure fails all."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = ROOT / "tools" / "mpirun"


def run_case(case: str, np_: int, timeout_s: int, extra=()):
    env = dict(os.environ, HPCMAC_VENV=str(Path(sys.executable).parents[1]))
    cmd = [str(MPIRUN), str(np_), sys.executable, "-m", "mpi4py", "-m", "hpcmac.testing",
           str(ROOT / "tests" / "harness" / case), "-q", *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    return proc, time.monotonic() - t0


@pytest.mark.timeout(120)
def test_deadlock_ends_within_timeout_naming_the_test():
    proc, took = run_case("case_deadlock.py", 2, 100, ["--timeout", "5"])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert took < 60, f"deadlock took {took:.0f}s to end"
    assert "test_deliberate_deadlock" in out, out[-3000:]
    assert "Timeout" in out, out[-3000:]


@pytest.mark.timeout(120)
def test_failure_on_one_rank_fails_every_rank():
    proc, _ = run_case("case_one_rank_fails.py", 2, 100)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "failed on 1/2 ranks: rank 1: the last rank says no" in out, out[-3000:]
    # both ranks report the failure, rank 1 prefixed
    assert "[rank 1]" in out and "FAILED" in out


def test_unknown_command_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "hpcmac", "nosuchcommand"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "info" in lines[0] and "hpl" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "hpcmac", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("hpcmac ")
    out = subprocess.run([sys.executable, "-m", "hpcmac", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "commands:" in out.stdout
