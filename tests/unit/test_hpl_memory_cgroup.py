"""HPL's rule of thumb, N chosen to fill 80% of memory, holds: one HPL process in a memory
cgroup of 768 MiB (the kernel's hard limit on its resident memory and page cache) at the N
whose matrix is 80% of that, PASSES, and the cgroup never refused an allocation.

Needs root and a writable memory cgroup (v1, or v2 with the memory controller delegated);
skipped otherwise. One rank, no MPI: with several ranks the fixed cost per rank
(interpreter, numpy, MPI, ~55 MB) is more than the 20% the rule leaves at a size that runs
in seconds (docs/hpl.md shows np 2 at 80% of 4 GiB). About 10 s on a quiet 2-core machine
(a 2/3 N^3 = 4.8e11 flop solve); the one deliberately sized test of the rule.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

LIMIT = 768 << 20
ROOT = Path(__file__).resolve().parents[2]


def _make_cgroup(limit: int) -> tuple[Path, str]:
    """(the new cgroup's folder, 'v1' or 'v2') under this process's memory cgroup."""
    lines = [ln.rstrip("\n").split(":", 2) for ln in open("/proc/self/cgroup")]
    for _hid, controllers, rel in lines:
        if "memory" in controllers.split(","):
            parent = Path("/sys/fs/cgroup/memory", rel.lstrip("/"))
            cg = parent / f"hpcmac-hpl80-{os.getpid()}"
            cg.mkdir()
            (cg / "memory.limit_in_bytes").write_text(str(limit))
            return cg, "v1"
    for hid, controllers, rel in lines:
        if hid == "0" and controllers == "":
            parent = Path("/sys/fs/cgroup", rel.lstrip("/"))
            if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                raise OSError("memory controller not delegated")
            cg = parent / f"hpcmac-hpl80-{os.getpid()}"
            cg.mkdir()
            (cg / "memory.max").write_text(str(limit))
            (cg / "memory.swap.max").write_text("0")
            return cg, "v2"
    raise OSError("no memory cgroup")


def _remove(cg: Path) -> None:
    for _ in range(50):  # the cgroup empties once the child is reaped
        try:
            cg.rmdir()
            return
        except OSError:
            time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hpl_at_80_percent_of_a_memory_cgroup(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    try:
        cg, version = _make_cgroup(LIMIT)
    except OSError as exc:
        pytest.skip(f"no writable memory cgroup here ({exc})")
    n = math.isqrt(int(0.8 * LIMIT) // 8)  # 8 N^2 bytes of matrix = 80% of the limit
    try:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_", "PMI_"))}
        env["PYTHONPATH"] = str(ROOT)
        procs = str(cg / "cgroup.procs")
        out = tmp_path / "hpl.json"
        proc = subprocess.run(
            [sys.executable, "-m", "hpcmac.hpl", "-N", str(n), "--nb", "256", "-P", "1",
             "-Q", "1", "--json", str(out), "--progress", "off", "--blas-threads", "1"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
            preexec_fn=lambda: Path(procs).write_text(str(os.getpid())))
        if version == "v1":
            refused = int((cg / "memory.failcnt").read_text())
            peak = int((cg / "memory.max_usage_in_bytes").read_text())
        else:
            events = dict(ln.split() for ln in (cg / "memory.events").read_text().splitlines())
            refused = int(events.get("max", 0)) + int(events.get("oom", 0))
            peak_file = cg / "memory.peak"
            peak = int(peak_file.read_text()) if peak_file.exists() else 0
    finally:
        _remove(cg)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    rec = json.loads(out.read_text())[0]
    assert rec["n"] == n and rec["passed"] and "PASSED" in proc.stdout
    assert rec["matrix_mb"][0] * 2**20 >= 0.79 * LIMIT  # the matrix really is ~80%
    assert refused == 0, f"the cgroup refused {refused} allocations (peak {peak} bytes)"
    assert peak <= LIMIT and rec["peak_rss_mb"][0] * 2**20 <= LIMIT
