"""The ring transport for real: 2 and 4 ranks through mpirun (MPI bootstrap) and mlx.launch.

Each test starts its own launcher with an outer timeout, runs the Group
contract (tests/harness/case_comm_ring.py) or a rank that dies mid-collective
(tests/harness/case_comm_peer_dies.py), and checks the verdict, the time taken
and that no process of the job is left running.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from ports import free_base_port

from hpcmac import comm
from tests.group_contract import GroupContract

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "harness"
VENV_BIN = Path(sys.executable).parent
MLX_LAUNCH = VENV_BIN / "mlx.launch"

pytest.importorskip("mlx.core", reason="the ring transport needs mlx (pip install 'hpcmac[mlx]')")


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_VENV=str(VENV_BIN.parent), **extra)
    env.pop("HPCMAC_TRANSPORT", None)
    return env


def _free_base_port(n: int) -> int:
    """A port p with p..p+n-1 free now (mlx.launch counts up from --starting-port)."""
    return free_base_port(n)   # tests/unit/ports.py: not from the ephemeral range


def mpirun(np_: int, args, env, timeout):
    cmd = [str(ROOT / "tools" / "mpirun"), str(np_), "-x", "PYTHONPATH", "-x",
           "HPCMAC_CASE_LAUNCH", sys.executable, *args]
    return _run(cmd, env, timeout)


def mlx_launch(np_: int, args, env, timeout):
    cmd = ["timeout", "-k", "5", str(timeout), str(MLX_LAUNCH), "-n", str(np_), "--backend",
           "ring", "--starting-port", str(_free_base_port(np_)), "--", sys.executable, *args]
    return _run(cmd, env, timeout + 10)


def _run(cmd, env, timeout):
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout + 20, start_new_session=True)
    return proc, time.monotonic() - t0


def leftovers(marker: str) -> list[str]:
    """Command lines of live processes that carry ``marker`` (ours, by construction)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path("/proc", pid, "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


class TestRingSingletonContract(GroupContract):
    """One process (an MPI singleton): the ring transport is MLX's size-1 group."""

    transport = "ring"

    @pytest.fixture
    def group(self):
        return comm.init("ring", strict=True)


LOG_LINE = {
    ("mpirun", "mpi"): "transport: mpi",
    ("mpirun", "ring"): "transport: ring (split, send/recv and non-MLX dtypes over mpi)",
    ("mlx.launch", "ring"): "transport: ring (no mpi: send/recv to ring neighbours only, "
                            "split to whole/single ranks only)",
}

CONTRACT = [str(HARNESS / "case_comm_ring.py"), "-q", "-p", "no:cacheprovider", "--timeout", "90"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("np_", [2, 4])
def test_ring_contract_under_mpirun(np_):
    env = _env(HPCMAC_CASE_LAUNCH="mpirun", HPCMAC_MPIRUN_TIMEOUT="300")
    proc, _ = mpirun(np_, ["-m", "mpi4py", "-m", "hpcmac.testing", *CONTRACT], env, 300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert " passed" in out and " failed" not in out, out[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("np_", [2, 4])
def test_ring_contract_under_mlx_launch(np_):
    env = _env(HPCMAC_CASE_LAUNCH="mlx")
    proc, _ = mlx_launch(np_, ["-m", "pytest", *CONTRACT], env, 300)
    out = proc.stdout + proc.stderr
    # mlx.launch (0.32) exits 0 even when a rank fails: read every rank's verdict
    assert proc.returncode == 0 and "exited with code" not in out, out[-4000:]
    assert out.count(" passed") == np_ and " failed" not in out, out[-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("launcher,transport", [("mpirun", "mpi"), ("mpirun", "ring"),
                                                ("mlx.launch", "ring")])
@pytest.mark.parametrize("np_", [2, 4])
def test_peer_dying_mid_collective_ends_the_job(launcher, transport, np_):
    marker = f"hpcmac-peer-dies-{uuid.uuid4().hex[:12]}"
    args = [str(HARNESS / "case_comm_peer_dies.py"), transport, marker]
    env = _env(HPCMAC_MPIRUN_TIMEOUT="100")
    if launcher == "mpirun":
        proc, took = mpirun(np_, args, env, 100)
    else:
        proc, took = mlx_launch(np_, args, env, 100)
    out = proc.stdout + proc.stderr
    if launcher == "mpirun":
        assert proc.returncode not in (0, 124, 137), f"rc {proc.returncode}: {out[-3000:]}"
    else:  # mlx.launch (0.32) exits 0 whatever its ranks did; it only warns
        assert proc.returncode not in (124, 137), f"rc {proc.returncode}: {out[-3000:]}"
        assert f"rank {np_ - 1} exited with code 3" in out, out[-3000:]
    assert took < 60, f"the job took {took:.0f}s to end: {out[-2000:]}"
    assert f"rank {np_ - 1} dies now" in out, out[-2000:]
    # rank 0 named the transport once, with what it does not carry itself
    logged = [ln for ln in out.splitlines() if ln.startswith("transport:")]
    assert logged == [LOG_LINE[launcher, transport]], logged
    deadline = time.monotonic() + 10
    while leftovers(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(marker), leftovers(marker)


def _netns_ok() -> bool:
    import shutil

    return os.geteuid() == 0 and shutil.which("ip") is not None and sys.platform.startswith("linux")


@pytest.mark.timeout(60)
@pytest.mark.skipif(not _netns_ok(), reason="needs root and iproute2 for network namespaces")
def test_ring_listens_on_the_cable_towards_its_left_neighbour():
    """Two 'hosts' (network namespaces) joined by one /30 'cable', each with other addresses
    too: the ring bootstrap must pick this host's end of the cable to the left neighbour."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"hpcc-{tag}-a", f"hpcc-{tag}-b"
    net = 10 + int(tag, 16) % 200
    cmds = [["ip", "netns", "add", a], ["ip", "netns", "add", b],
            ["ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"],
            ["ip", "link", "set", f"va{tag}", "netns", a],
            ["ip", "link", "set", f"vb{tag}", "netns", b],
            ["ip", "-n", a, "addr", "add", f"10.213.{net}.1/30", "dev", f"va{tag}"],
            ["ip", "-n", b, "addr", "add", f"10.213.{net}.2/30", "dev", f"vb{tag}"],
            ["ip", "-n", b, "addr", "add", "10.212.0.9/32", "dev", "lo"],
            ["ip", "-n", a, "link", "set", f"va{tag}", "up"],
            ["ip", "-n", b, "link", "set", f"vb{tag}", "up"],
            ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"]]
    probe = ("import json, sys; from hpcmac.comm import ring_env as r; "
             "mine = r.local_ipv4(); "
             "ips = [json.loads(sys.argv[1]), mine]; "
             "print(json.dumps([mine, r.listen_address(1, ['a', 'b'], ips)]))")
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True, timeout=10)
        left_ips = json.dumps(["10.212.7.7", f"10.213.{net}.1"])  # an unreachable one first
        out = subprocess.run(["ip", "netns", "exec", b, sys.executable, "-c", probe, left_ips],
                             capture_output=True, text=True, timeout=30, env=_env(), check=True)
        mine, chosen = json.loads(out.stdout)
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    assert f"10.213.{net}.2" in mine and "10.212.0.9" in mine and mine[-1] == "127.0.0.1", mine
    assert chosen == f"10.213.{net}.2"
