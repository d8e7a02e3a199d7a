"""HPL passes with each rank's address space capped at 1.3x its piece of [A | b] (np 1, 2, 4).

Each job is a fresh ``mpirun`` of ``hpl_capped_job.py``: the cap is taken after start-up
(RLIMIT_AS, as ``ulimit -v``), a second copy of the piece is shown to be refused under it,
and one HPL run (generate, factor, solve, check) must PASS inside it. A fresh process,
because an MPI test run after others inherits an allocator holding their freed memory,
which a copy could reuse without growing the address space. Linux only.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS is Linux's"),
    pytest.mark.timeout(600),
]

JOB = Path(__file__).with_name("hpl_capped_job.py")


@pytest.mark.parametrize("np_", [1, 2, 4])
def test_hpl_passes_under_a_cap_of_1_3x_the_matrix(np_):
    env = dict(os.environ, HPCMAC_QUIET_TRANSPORT="1", HPCMAC_MPIRUN_TIMEOUT="500")
    env.pop("OMPI_COMM_WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "hpcmac.mpirun", str(np_), sys.executable,
                           "-m", "mpi4py", str(JOB)], capture_output=True, text=True, env=env,
                          timeout=560)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count("capped HPL PASSED") == np_, proc.stdout[-2000:]
