"""jobs/: the batch scripts are valid shell, their HPL.dat files parse, and the plain
shell equivalents run for real on this machine (the Slurm ones run in tests/cluster)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOBS = ROOT / "jobs"
SCRIPTS = [p for p in sorted(JOBS.glob("*.sh")) + sorted(JOBS.glob("*.sbatch"))
           if p.name != "env.sh"]  # env.sh is sourced by the others


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_job_script_is_valid_shell(script):
    res = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    text = script.read_text()
    assert text.startswith("#!/bin/sh") and "set -eu" in text
    if script.suffix == ".sbatch":
        assert "#SBATCH --ntasks=" in text and "#SBATCH --job-name=" in text
        assert (JOBS / script.name.replace(".sbatch", ".sh")).exists()  # a plain twin


def test_every_sbatch_has_a_plain_shell_twin_and_the_three_jobs_exist():
    names = {p.stem for p in JOBS.glob("*.sbatch")}
    assert {"hpl", "llm-generate", "comm-bench"} <= names


@pytest.mark.parametrize("dat", sorted((JOBS / "hpl").glob("*.dat")), ids=lambda p: p.name)
def test_hpl_dat_files_parse(dat):
    config = pytest.importorskip("hpcmac.hpl.config")
    cfg = config.parse_hpl_dat(dat.read_text(), str(dat))
    assert cfg.ns


def test_plain_hpl_job_runs_and_passes():
    pytest.importorskip("hpcmac.hpl.__main__")
    env = {**os.environ, "HPCMAC_PYTHON": sys.executable, "NP": "2",
           "HOSTFILE": str(ROOT / "hostfiles" / "localhost.json")}
    dat = ROOT / "jobs" / "hpl" / "HPL-small.dat"
    # the 2 x 2 file on 2 ranks is refused by HPL; give the job a 1 x 2 override file
    text = dat.read_text().splitlines()
    text[10], text[11] = "1  Ps", "2  Qs"
    small = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpcmac-jobs-{os.getpid()}.dat"
    small.write_text("\n".join(text) + "\n")
    try:
        res = subprocess.run(["timeout", "-k", "5", "120", str(JOBS / "hpl.sh"), str(small)],
                             env=env, capture_output=True, text=True, timeout=150)
    finally:
        small.unlink()
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert any(ln.rstrip().endswith("PASSED") for ln in res.stdout.splitlines())
