"""``launch doctor`` on the namespace mesh: all green, then the faults it must name.

The test injects a downed cable end, an MTU mismatch, a stale hpcmac on one host
(its ``python`` field runs a Python that finds an older hpcmac first) and a host
ssh cannot reach; doctor must fail with exit 1 and print, for each, the row and
the command that fixes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from netns import AGENT

import hpcmac

pytestmark = pytest.mark.timeout(120)

PY = sys.executable


def doctor(mesh, hostfile, *extra, cwd=None):
    # cwd: away from the source tree, whose hpcmac/ a remote "python -" would import first
    return subprocess.run([PY, "-m", "hpcmac.launch", "doctor", "--hostfile", str(hostfile),
                           "--ssh", AGENT, "--timeout", "20", *extra], env=mesh.env(),
                          capture_output=True, text=True, timeout=90, cwd=cwd)


def rows(out: str) -> list[list[str]]:
    return [ln.split(None, 3) for ln in out.splitlines()]


def test_a_healthy_mesh_passes(mesh):
    res = doctor(mesh, mesh.path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all" in res.stdout.splitlines()[-1] and "checks passed on 4 hosts" in res.stdout
    # every cable end was pinged through its own interface
    for lk in mesh.hf.links:
        for e in lk.ends:
            assert f"{e.addr} -> {lk.peer_of(e.host).addr}: rtt" in res.stdout


def test_doctor_names_a_downed_link_an_mtu_mismatch_a_stale_install_and_a_lost_host(
        mesh, healed, tmp_path):
    # a stale hpcmac on mac4: its Python finds an older hpcmac first
    old = tmp_path / "old" / "hpcmac"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text('__version__ = "0.0.9"\n')
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "python3"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={old.parent} exec {PY} "$@"\n')
    wrapper.chmod(0o755)
    (bindir / "mpirun").symlink_to(os.path.join(os.path.dirname(PY), "mpirun"))
    d = json.loads(open(mesh.path).read())
    d["hosts"][3]["python"] = str(wrapper)
    for h in d["hosts"][:3]:
        h["python"] = PY
    hostfile = tmp_path / "mesh-4-stale.json"
    hostfile.write_text(json.dumps(d))
    mesh.run("mac1", ["ip", "link", "set", "en3", "down"])       # the mac1-mac2 cable
    mesh.run("mac3", ["ip", "link", "set", "en5", "mtu", "1500"])  # mac3-mac4: 1500 vs 9000
    try:
        res = doctor(mesh, hostfile, cwd=tmp_path)
    finally:
        mesh.run("mac3", ["ip", "link", "set", "en5", "mtu", "9000"])
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    lines = out.splitlines()

    def failure(host, check):
        for i, ln in enumerate(lines):
            parts = ln.split()
            if parts[:1] == [host] and " ".join(parts[1:]).startswith(check + " ") \
                    and " FAIL " in ln:
                assert lines[i + 1].split()[0] == "fix:", lines[i + 1]
                return ln, lines[i + 1].split("fix:", 1)[1].strip()
        raise AssertionError(f"no FAIL row for {host} {check}:\n{out}")

    row, fix = failure("mac1", "link mac1-mac2 en3")
    assert "interface is down" in row and fix == "ip link set en3 up"
    row, fix = failure("mac2", "link mac1-mac2 en3")
    assert "no carrier" in row and fix.endswith("on mac1: ip link set en3 up")
    row, fix = failure("mac3", "link mac3-mac4 mtu")
    assert "mac3 en5 1500 vs mac4 en5 9000" in row and fix == "ip link set en5 mtu 9000"
    row, fix = failure("mac4", "hpcmac")
    assert f"0.0.9, but mac1 has {hpcmac.__version__}" in row
    assert fix == f"{wrapper} -m pip install hpcmac=={hpcmac.__version__}"
    assert out.splitlines()[-1].endswith("checks failed on mac1, mac2, mac3, mac4")
    # the other cables are fine and say so
    assert any(ln.startswith("mac1") and "link mac1-mac3 en4" in ln and " ok " in ln
               for ln in lines)
    # a host ssh cannot reach
    d["hosts"][2]["ssh"] = "mac9.local"
    hostfile.write_text(json.dumps(d))
    res = doctor(mesh, hostfile)
    assert res.returncode == 1
    row = next(ln for ln in res.stdout.splitlines() if ln.startswith("mac3 ") and "ssh" in ln)
    assert "FAIL" in row and "no namespace" in row
    assert mesh.wait_idle(5) == []
