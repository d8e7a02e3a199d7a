"""A real multi-host run: 4 namespace "Macs" cabled as a full mesh of /30 links.

Ranks start in their own namespaces (own hostname) through Open MPI's launch
agent hook, exactly as they would over ssh; the tests check the job passes,
that the bytes crossed the mesh links, and that the route check sees what
the mesh needs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HPL, MESH_JOB
from netns import AGENT

pytestmark = pytest.mark.timeout(120)

PY = sys.executable


def launch(mesh, job, *extra, timeout=60):
    """Run ``python -m hpcmac.launch`` from the first host, as a user would on it."""
    argv = ["timeout", "-k", "5", str(timeout), PY, "-m", "hpcmac.launch",
            "--hostfile", mesh.path, "--agent", AGENT, "--timeout", str(timeout - 10),
            *extra, "--", PY, *job]
    return subprocess.run(mesh.argv(mesh.hf.names[0], argv), env=mesh.env(),
                          capture_output=True, text=True, timeout=timeout + 15)


def test_route_check_finds_the_missing_routes_and_the_printed_commands_fix_them(bare_mesh):
    m = bare_mesh
    check = [PY, "-m", "hpcmac.launch", "routes", "--hostfile", m.path, "--os", "linux",
             "--check", "--ssh", AGENT]
    before = subprocess.run(check, env=m.env(), capture_output=True, text=True, timeout=60)
    assert before.returncode == 1, before.stderr
    cmds = [ln for ln in before.stdout.splitlines() if not ln.startswith("#")]
    # 4 hosts x 3 peers x 2 other addresses of each peer
    assert len(cmds) == 24
    host = None
    for line in before.stdout.splitlines():
        if line.startswith("# on "):
            host = line[5:]
        elif not line.startswith("#"):
            m.run(host, line.split())
    after = subprocess.run(check, env=m.env(), capture_output=True, text=True, timeout=60)
    assert after.returncode == 0, after.stdout + after.stderr
    assert "every host has a direct route" in after.stdout


def test_job_passes_across_four_hosts_and_its_bytes_cross_the_mesh_links(mesh):
    before = mesh.counters()
    res = launch(mesh, MESH_JOB)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert any(line.rstrip().endswith("PASSED") for line in res.stdout.splitlines()), out
    if "selftest" in MESH_JOB[1]:
        for name in mesh.hf.hosts:
            assert f"on {name.ssh}" in res.stdout  # every rank on its own host
    after = mesh.counters()
    # every cable the job's pattern uses carried real traffic
    names = mesh.hf.names
    for i, j in busy_pairs(len(names)):
        a, b = names[i], names[j]
        lk = mesh.hf.link_between(a, b)
        sent = [after[(x, lk.end_of(x).iface)][1] - before[(x, lk.end_of(x).iface)][1]
                for x in (a, b)]
        assert max(sent) > 2**18, f"only {sent} bytes crossed the {a}-{b} cable"
    mgmt = management_bytes(before, after, mesh)
    assert max(mgmt.values()) < 2**19, f"MPI bytes went over the management ports: {mgmt}"


def busy_pairs(n: int) -> list[tuple[int, int]]:
    """Rank pairs that exchange data: HPL's 2 x 2 grid talks along rows and columns
    (row-major ranks), the comm check around the ring."""
    if HPL:
        q = 2
        return [(r, s) for r in range(n) for s in range(r + 1, n)
                if r // q == s // q or r % q == s % q]
    return [(r, (r + 1) % n) for r in range(n)]


def test_dry_run_on_the_mesh_launches_nothing(mesh):
    res = launch(mesh, MESH_JOB, "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "btl_tcp_if_include 10.77.0.0/18" in res.stdout
    assert mesh.wait_idle(1) == []


def test_mlx_ring_across_four_hosts_through_mlx_launch(mesh, tmp_path):
    """``--via mlx --backend ring``: mlx.launch reaches each host with "ssh" (here the
    namespace agent under that name) and MLX's ring runs over the converted hostfile."""
    pytest.importorskip("mlx.core")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").symlink_to(AGENT)
    env = {**mesh.env(), "PATH": f"{bindir}:{mesh.env()['PATH']}", "TMPDIR": str(tmp_path)}
    before = mesh.counters()
    check = str(Path(__file__).with_name("mlx_ring_check.py"))
    res = subprocess.run(["timeout", "-k", "5", "60", PY, "-m", "hpcmac.launch", "--hostfile",
                          mesh.path, "--via", "mlx", "--backend", "ring", "--timeout", "50",
                          "--", PY, check], env=env, capture_output=True, text=True, timeout=80)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "mlx ring all_sum over 4 ranks ... PASSED" in res.stdout
    for h in mesh.hf.hosts:
        assert f"on {h.ssh}" in res.stdout
    after = mesh.counters()
    names = mesh.hf.names
    for i, a in enumerate(names):  # the ring's links carried the all_sum
        lk = mesh.hf.link_between(a, names[(i + 1) % len(names)])
        iface = lk.end_of(a).iface
        assert after[(a, iface)][1] - before[(a, iface)][1] > 2**20
    mgmt = management_bytes(before, after, mesh)
    assert max(mgmt.values()) < 2**19, f"ring bytes went over the management ports: {mgmt}"
    assert mesh.wait_idle(10) == []


def test_mlx_ring_rank_failure_is_the_job_exit_code(mesh, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").symlink_to(AGENT)
    env = {**mesh.env(), "PATH": f"{bindir}:{mesh.env()['PATH']}", "TMPDIR": str(tmp_path)}
    code = "import os, sys, time; r = int(os.environ['MLX_RANK']); time.sleep(30 * (r != 2)); " \
           "sys.exit(7 if r == 2 else 0)"
    res = subprocess.run(["timeout", "-k", "5", "60", PY, "-m", "hpcmac.launch", "--hostfile",
                          mesh.path, "--via", "mlx", "--backend", "ring", "--timeout", "50",
                          "--", PY, "-c", code],
                         env=env, capture_output=True, text=True, timeout=80)
    assert res.returncode == 7, res.stderr[-2000:]
    assert "rank 2 exited with code 7" in res.stderr
    assert mesh.wait_idle(10) == []


def management_bytes(before, after, mesh) -> dict[str, int]:
    """Bytes each host sent on its management port (``en0``) between two counter reads."""
    return {h: after[(h, "en0")][1] - before[(h, "en0")][1] for h in mesh.hf.names}


def test_hpcmac_ring_transport_across_four_hosts(mesh):
    """hpcmac's ``ring`` transport (MLX ring bootstrapped over MPI) under mpirun: the
    allreduce bytes go through MLX's ring over the mesh cables, not over the
    management Ethernet that each host lists first and that routes to every peer."""
    pytest.importorskip("mlx.core")
    before = mesh.counters()
    res = launch(mesh, ["-m", "hpcmac.launch.selftest", "--mib", "8", "--no-p2p"],
                 "--transport", "ring", "--env", "HPCMAC_TRANSPORT_STRICT=1")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "transport: ring" in res.stderr
    assert res.stdout.rstrip().endswith("PASSED"), out[-2000:]
    after = mesh.counters()
    names = mesh.hf.names
    for i, a in enumerate(names):
        lk = mesh.hf.link_between(a, names[(i + 1) % len(names)])
        sent = [after[(x, lk.end_of(x).iface)][1] - before[(x, lk.end_of(x).iface)][1]
                for x in (lk.ends[0].host, lk.ends[1].host)]
        assert max(sent) > 2**20, f"only {sent} bytes on the {lk.label} cable"
    mgmt = management_bytes(before, after, mesh)
    assert max(mgmt.values()) < 2**19, f"ring bytes went over the management ports: {mgmt}"
