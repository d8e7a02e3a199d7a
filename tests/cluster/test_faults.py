"""Faults on the namespace mesh end the job in time, name a host, leave nothing behind.

The namespaces run with ``net.ipv4.tcp_retries2=3`` (see netns.Mesh.create),
the setting docs/mesh.md recommends on a Thunderbolt mesh: a dead link is then
an error in seconds instead of a silent hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from netns import AGENT

pytestmark = pytest.mark.timeout(150)

PY = sys.executable
JOB = ["-m", "hpcmac.launch.selftest", "--mib", "1", "--seconds", "90"]


def start(mesh, env=()):
    argv = ["timeout", "-k", "5", "110", PY, "-m", "hpcmac.launch", "--hostfile", mesh.path,
            "--agent", AGENT, "--timeout", "100", *[f"--env={e}" for e in env], "--", PY, *JOB]
    p = subprocess.Popen(mesh.argv(mesh.hf.names[0], argv), env=mesh.env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait until every rank is up and exchanging (rank 0 has printed the host list)
    deadline = time.monotonic() + 40
    seen = []
    while time.monotonic() < deadline and len(seen) < len(mesh.hf.hosts):
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("rank "):
            seen.append(line)
    assert len(seen) == len(mesh.hf.hosts), f"job did not start: {p.stderr.read()[-2000:]}"
    time.sleep(1.0)
    return p


def finish(p, limit):
    t0 = time.monotonic()
    try:
        out, err = p.communicate(timeout=limit + 30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"job still running {limit + 30} s after the fault")
    return time.monotonic() - t0, out + err


def rank_pid(mesh, host):
    for pid in mesh.pids(host):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read()
        except OSError:
            continue
        if "hpcmac.launch.selftest" in cmd and "hpcmac.launch\0" not in cmd:
            return pid
    raise AssertionError(f"no rank process on {host}: {[(p, _cmd(p)) for p in mesh.pids(host)]}")


def inject(mesh, kind):
    """Break the mac2-mac3 cable (or kill mac3's rank); the host names it involves."""
    a, b = mesh.hf.names[1], mesh.hf.names[2]
    lk = mesh.hf.link_between(a, b)
    if kind == "link-down":
        mesh.run(a, ["ip", "link", "set", lk.end_of(a).iface, "down"])
    elif kind == "iptables-drop":
        iface = lk.end_of(b).iface
        mesh.run(b, ["iptables", "-A", "INPUT", "-i", iface, "-j", "DROP"])
        mesh.run(b, ["iptables", "-A", "OUTPUT", "-o", iface, "-j", "DROP"])
    elif kind == "sigstop":
        os.kill(rank_pid(mesh, b), signal.SIGSTOP)
    else:
        os.kill(rank_pid(mesh, b), signal.SIGKILL)
    return {mesh.hostname[a].split(".")[0], mesh.hostname[b].split(".")[0]}


@pytest.mark.parametrize("kind,limit", [("link-down", 60), ("iptables-drop", 60),
                                        ("kill-9", 5)])
def test_fault_ends_the_job_with_an_error_naming_the_host(healed, kind, limit):
    mesh = healed
    if kind == "iptables-drop" and subprocess.run(["sh", "-c", "command -v iptables"],
                                                  capture_output=True).returncode:
        pytest.skip("iptables is not installed (tools/system-deps installs it as root)")
    p = start(mesh)
    named = inject(mesh, kind)
    elapsed, out = finish(p, limit)
    print(f"{kind}: job ended {elapsed:.1f} s after the fault, exit {p.returncode}")
    assert p.returncode != 0, out[-2000:]
    assert elapsed < limit, f"{kind}: job took {elapsed:.1f} s to end (limit {limit} s)"
    assert "error" in out.lower()
    hosts = {mesh.hostname[n].split(".")[0] for n in mesh.hf.names}
    if kind == "kill-9":
        # Open MPI reports whichever rank noticed first: the dead one or a peer
        assert any(h in out for h in hosts), out[-2000:]
    else:
        assert any(h in out for h in named), out[-2000:]
    left = mesh.wait_idle(10)
    assert left == [], f"left behind: {left}"


@pytest.mark.parametrize("kind", ["iptables-drop", "sigstop"])
def test_silent_peer_ends_the_job_under_default_tcp_settings(default_tcp_mesh, kind):
    """No kernel help (tcp_retries2=15): the heartbeat (hpcmac.comm.heartbeat) ends a
    blackholed link or a stopped rank after HPCMAC_HEARTBEAT_TIMEOUT, naming both hosts,
    with nothing left on any host. (Measured with the default 30 s: 31.8 s.)"""
    mesh = default_tcp_mesh
    if kind == "iptables-drop" and subprocess.run(["sh", "-c", "command -v iptables"],
                                                  capture_output=True).returncode:
        pytest.skip("iptables is not installed (tools/system-deps installs it as root)")
    try:
        p = start(mesh, env=["HPCMAC_HEARTBEAT_TIMEOUT=8"])
        named = inject(mesh, kind)
        elapsed, out = finish(p, 30)
        print(f"{kind}: job ended {elapsed:.1f} s after the fault, exit {p.returncode}")
        assert p.returncode != 0, out[-2000:]
        assert 8 <= elapsed < 30, f"{kind}: job took {elapsed:.1f} s to end"
        beat = [ln for ln in out.splitlines() if "no heartbeat from rank" in ln]
        assert beat and all(any(h in ln for h in named) for ln in beat), out[-2000:]
        left = mesh.wait_idle(10)
        assert left == [], f"left behind: {left}"
    finally:
        mesh.kill_all()
        mesh.heal()


def _cmd(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return "?"
