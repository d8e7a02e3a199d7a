"""What outside tools read of an HPL rank's memory is its true peak.

``/usr/bin/time -v``, Slurm's accounting and benchmark harnesses read the
``ru_maxrss`` that ``wait4`` returns for the finished process, the kernel's
high-water mark. HPL's per-phase peaks must not reset that mark, so the figure
an outside tool reads is at least the peak the run's own JSON reports.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# what time(1) does: run the command, wait4 for it, report the child's rusage
WAIT4 = """\
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1] + "." + os.environ["OMPI_COMM_WORLD_RANK"], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_wait4_peak_covers_the_json_peak_of_each_rank(tmp_path):
    (tmp_path / "wait4.py").write_text(WAIT4)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_MPIRUN_TIMEOUT="120",
               HPCMAC_QUIET_TRANSPORT="1")
    cmd = [str(ROOT / "tools" / "mpirun"), "2", sys.executable, "wait4.py", "maxrss",
           "-m", "hpcmac.hpl", "-N", "3000", "--nb", "128", "-P", "1", "-Q", "2",
           "--json", "out.json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "out.json").read_text())[0]
    assert record["passed"]
    for rank, peak_mb in enumerate(record["peak_rss_mb"]):
        outside_mb = int((tmp_path / f"maxrss.{rank}").read_text()) / 1024
        assert outside_mb >= 0.95 * peak_mb, (rank, outside_mb, peak_mb)
        # the phases' peaks are their own: none above the process's peak
        assert peak_mb <= outside_mb + 1
    phases = record["peak_rss_phase_mb"]
    assert phases["check"] < phases["solve"]  # the check's peak is not the run's
