"""The batch scripts in jobs/ under a real Slurm: sbatch, run, PASSED."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SLURM_SCRIPT

pytestmark = pytest.mark.timeout(150)


def _env(tmp: Path) -> dict:
    venv_bin = str(Path(sys.executable).parent)
    return {"PWD": str(ROOT), "HPCMAC_ROOT": str(ROOT), "HPCMAC_PYTHON": sys.executable,
            "HPL_DAT": str(ROOT / "jobs" / "hpl" / "HPL-small.dat"),
            "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}


def test_job_script_runs_under_sbatch_and_passes(slurm, tmp_path):
    out = tmp_path / "job.out"
    job = slurm.sbatch(SLURM_SCRIPT, "-n", "4", "--overcommit", f"--output={out}",
                       env=_env(tmp_path))
    state = slurm.wait(job, timeout=120)
    text = out.read_text() if out.exists() else "(no output file)"
    assert state == "COMPLETED", f"job {job} ended {state}:\n{text[-3000:]}\n{slurm.log()[-2000:]}"
    passed = [ln for ln in text.splitlines() if ln.rstrip().endswith("PASSED")]
    assert passed, text[-3000:]
    assert not any(ln.rstrip().endswith("FAILED") for ln in text.splitlines())


def test_a_failing_job_is_reported_failed_by_slurm(slurm, tmp_path):
    out = tmp_path / "bad.out"
    env = {**_env(tmp_path), "SELFTEST_MIB": "-1"}  # bad input: the job must exit non-zero
    job = slurm.sbatch(ROOT / "jobs" / "selftest.sbatch", "-n", "2", "--overcommit",
                       f"--output={out}", env=env)
    state = slurm.wait(job, timeout=60)
    assert state == "FAILED", out.read_text() if out.exists() else state
    assert "error:" in out.read_text()
