"""Local launches as a new user makes them: ``hostfiles/localhost.json`` declares this
machine's cores (``"slots": "auto"``), and a bare ``python`` in the command is the launching
interpreter (or the hosts' ``python``) even when the venv is not activated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcmac.errors import UsageError
from hpcmac.launch.hostfile import load, local_cores, parse

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "hostfiles" / "localhost.json"


def test_localhost_hostfile_declares_this_machines_cores():
    hf = load(LOCAL)
    assert hf.total_slots() == local_cores() == len(os.sched_getaffinity(0))


def test_auto_slots_only_for_this_machine():
    hf = parse({"hosts": [{"name": "a", "ssh": "127.0.0.1", "slots": "auto"},
                          {"name": "b", "ssh": "b", "slots": 3}]})
    assert [h.slots for h in hf.hosts] == [local_cores(), 3]
    with pytest.raises(UsageError, match=r"host 'mac1': field 'slots' \"auto\" counts this "
                                         r"machine's cores"):
        parse({"hosts": [{"name": "mac1", "ssh": "mac1.local", "slots": "auto"}]}, "f.json")
    with pytest.raises(UsageError, match="field 'slots' should be an integer"):
        parse({"hosts": [{"name": "localhost", "slots": "four"}]}, "f.json")


@pytest.mark.timeout(120)
def test_launch_without_an_activated_venv_runs_this_interpreter():
    bindir = os.path.dirname(sys.executable)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != os.path.abspath(bindir))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(PATH=path or "/usr/bin:/bin", PYTHONPATH=str(ROOT))
    code = "import sys, hpcmac; print(sys.executable)"
    res = subprocess.run([sys.executable, "-m", "hpcmac.launch", "--hostfile", str(LOCAL),
                          "--np", "2", "--oversubscribe", "--", "python", "-c", code],
                         env=env, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [ln for ln in res.stdout.splitlines() if ln.strip()] == [sys.executable] * 2
