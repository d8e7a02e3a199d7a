"""hpcmac-mpirun (hpcmac/mpirun.py; tools/mpirun runs it): the settings it adds, and real
launches: ``python`` in the command is this venv's interpreter even when PATH has another,
the wall-clock cap is announced and ends the job with 124, bad arguments are one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcmac import mpirun

ROOT = Path(__file__).resolve().parents[2]
BIN = os.path.dirname(sys.executable)


def test_parse_np_accepts_bare_and_mpirun_spellings():
    assert mpirun.parse_np(["4", "python", "x.py"]) == (4, ["python", "x.py"])
    assert mpirun.parse_np(["-np", "2", "--mca", "a", "b", "cmd"]) == (2, ["--mca", "a", "b",
                                                                           "cmd"])
    assert mpirun.parse_np(["-n", "3", "cmd"]) == (3, ["cmd"])
    for bad in (["python"], ["0", "cmd"], ["-np"], ["2"]):
        with pytest.raises(ValueError):
            mpirun.parse_np(bad)


def test_plan_root_oversubscribe_threads_and_path():
    argv, env = mpirun.plan(4, ["python", "-m", "hpcmac"], "/v/bin", "/v/bin/mpirun", 2, 0,
                            {"PATH": "/usr/bin"})
    assert argv[:4] == ["/v/bin/mpirun", "-np", "4", "--oversubscribe"]
    assert argv[-3:] == ["python", "-m", "hpcmac"]
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"
    assert env["PATH"] == "/v/bin:/usr/bin"
    argv, env = mpirun.plan(2, ["cmd"], "/v/bin", "/v/bin/mpirun", 16, 1000,
                            {"PATH": "/usr/bin", "OMP_NUM_THREADS": "3"})
    assert "--oversubscribe" not in argv and "OMPI_ALLOW_RUN_AS_ROOT" not in env
    assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "3"
    _, env = mpirun.plan(2, ["cmd"], "/v/bin", "/v/bin/mpirun", 16, 1000, {})
    assert env["OMP_NUM_THREADS"] == "8"


def _env(**extra):
    # a PATH without this venv: ranks must still get this interpreter for "python"
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != os.path.abspath(BIN))
    # no thread count either (tests/conftest.py sets one): the launcher's own is checked
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCMAC_MPIRUN"))
           and k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    env.update(PATH=path or "/usr/bin:/bin", PYTHONPATH=str(ROOT), **extra)
    env.pop("HPCMAC_VENV", None)
    return env


@pytest.mark.timeout(120)
def test_python_in_the_command_is_the_launching_interpreter():
    code = "import sys, os; print(sys.executable, os.environ['OMP_NUM_THREADS'])"
    res = subprocess.run([sys.executable, "-m", "hpcmac.mpirun", "2", "python", "-c", code],
                         env=_env(), capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split("\n")
    ranks = [ln for ln in lines if ln.strip()]
    assert len(ranks) == 2
    threads = str(max(1, mpirun.cores() // 2))
    assert all(ln == f"{os.path.join(BIN, 'python')} {threads}" for ln in ranks), ranks


@pytest.mark.timeout(120)
def test_the_cap_is_announced_and_ends_the_job_with_124():
    t0 = time.monotonic()
    res = subprocess.run([str(ROOT / "tools" / "mpirun"), "2", "sleep", "60"],
                         env=_env(HPCMAC_MPIRUN_TIMEOUT="2", HPCMAC_VENV=str(Path(BIN).parent)),
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 124
    assert time.monotonic() - t0 < 30
    assert "error: tools/mpirun: the job ran past HPCMAC_MPIRUN_TIMEOUT=2 s" in res.stderr


@pytest.mark.parametrize("args", [["x", "cmd"], ["2"], []])
def test_bad_arguments_are_one_line_and_exit_2(args):
    res = subprocess.run([sys.executable, "-m", "hpcmac.mpirun", *args], env=_env(),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    if args:
        assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: hpcmac-mpirun: ")
