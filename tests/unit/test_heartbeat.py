"""A stopped or silent rank ends the job after HPCMAC_HEARTBEAT_TIMEOUT (hpcmac.comm.heartbeat);
a rank that finishes early and waits in MPI_Finalize is not taken for dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcmac.comm.heartbeat import ALL_PAIRS, peers_of, timeout_from_env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def test_peers():
    assert peers_of(0, 1) == []
    assert peers_of(2, 4) == [0, 1, 3]
    big = 1000
    assert big > ALL_PAIRS
    for r in (0, 1, 999):
        p = peers_of(r, big)
        assert r not in p and (r + 1) % big in p and (r - 1) % big in p and len(p) <= 20
    # every rank is watched by someone, and watching is symmetric
    for r in range(0, big, 97):
        assert all(r in peers_of(q, big) for q in peers_of(r, big))


def test_timeout_from_env(monkeypatch):
    for raw, want in (("", 30.0), ("5", 5.0), ("0", 0.0), ("nan", 30.0), ("-1", 30.0),
                      ("x", 30.0)):
        monkeypatch.setenv("HPCMAC_HEARTBEAT_TIMEOUT", raw)
        assert timeout_from_env() == want


SCRIPT = """
import os, sys, time
from hpcmac import comm
from hpcmac.lifecycle import run_cli

def main(argv):
    g = comm.init("mpi")
    print(f"up {g.rank} {os.getpid()}", flush=True)
    if g.rank == 0 or sys.argv[2] == "all":
        time.sleep(float(sys.argv[1]))  # with "0" the others wait in MPI_Finalize meanwhile
    return 0

raise SystemExit(run_cli(main))
"""


def mpirun(np_, args, timeout):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_QUIET_TRANSPORT="1",
               HPCMAC_HEARTBEAT_TIMEOUT="3")
    return subprocess.Popen([str(ROOT / "tools" / "mpirun"), str(np_), sys.executable, "-c",
                             SCRIPT, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_finishing_early_is_not_silence():
    proc = mpirun(2, ["8", "0"], 60)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "no heartbeat" not in err


def test_stopped_rank_ends_the_job():
    proc = mpirun(2, ["60", "all"], 60)
    pids = {}
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, proc.communicate()
        _, rank, pid = line.split()
        pids[int(rank)] = int(pid)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        _out, err = proc.communicate(timeout=30)
    finally:
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0 and 3 <= elapsed < 15, (elapsed, err)
    lines = [ln for ln in err.splitlines() if "no heartbeat" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0 (")
    assert "from rank 1 (" in lines[0]
    assert "Traceback" not in err
