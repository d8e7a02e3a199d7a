"""A plain script that raises on one rank ends the whole job (python -m mpi4py asks for an
abort at exit; hpcmac's own at-exit finalizer must not wait in MPI_Finalize instead)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
from hpcmac import comm
world = comm.init("mpi")
if world.rank == 1:
    raise MemoryError("rank 1 ran out")
world.bcast_obj(None, 1)  # rank 0 waits here for a rank that is gone
"""


@pytest.mark.timeout(120)
def test_an_uncaught_exception_on_one_rank_ends_the_job(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_QUIET_TRANSPORT="1",
               HPCMAC_MPIRUN_TIMEOUT="90", HPCMAC_HEARTBEAT_TIMEOUT="0")
    t0 = time.monotonic()
    proc = subprocess.run([str(ROOT / "tools" / "mpirun"), "2", sys.executable, "-m", "mpi4py",
                           str(tmp_path / "job.py")], capture_output=True, text=True,
                          env=env, timeout=110)
    took = time.monotonic() - t0
    assert proc.returncode not in (0, 124), proc.stderr[-2000:]
    assert "rank 1 ran out" in proc.stderr
    assert took < 30, f"the job took {took:.0f} s to end: a rank waited"
