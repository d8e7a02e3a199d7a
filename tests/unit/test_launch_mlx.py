"""Every shipped and every discovered hostfile, converted by ``--via mlx``, is accepted by
the real ``mlx.launch`` (its own hostfile parser and backend checks) for ring and jaccl.

Only the spawning is stubbed: ``mlx._distributed_utils.launch._launch_with_io`` records
what each rank would run instead of starting ssh. What ``mlx.launch`` would refuse,
hpcmac refuses first, in one line naming the host.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpcmac.errors import UsageError
from hpcmac.launch import discover, runner
from hpcmac.launch.hostfile import load

launch_mod = pytest.importorskip("mlx._distributed_utils.launch")

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data" / "launch"
SHIPPED = sorted((ROOT / "hostfiles").glob("*.json"))
SUFFIXES = [("thunderbolt", "thunderbolt.json"), ("ports", "ports.txt"), ("ibv", "ibv.txt"),
            ("ibv_devinfo", "ibv_devinfo.txt"), ("rdma_ctl", "rdma_ctl.txt"),
            ("memsize", "memsize.txt"), ("en0", "en0.txt")]
DISCOVERED = {"mesh3": ["mac1", "mac2", "mac3"], "studio4": ["mac1", "mac2", "mac3", "mac4"]}
# (hostfile, backend) pairs hpcmac refuses before mlx.launch, and what the line says
REFUSED = {
    ("localhost.json", "jaccl"): "needs at least two Macs",
    ("discovered-mesh3.json", "jaccl"): "host 'mac1': no RDMA device towards 'mac2'",
}


def discovered(name: str, tmp: Path) -> Path:
    probes = [discover.Probe(name=h, **{k: (DATA / name / f"{h}.{sfx}").read_text()
                                        for k, sfx in SUFFIXES}) for h in DISCOVERED[name]]
    data, _ = discover.plan_hostfile(probes)
    path = tmp / f"discovered-{name}.json"
    path.write_text(json.dumps(data))
    return path


def run_mlx_launch(argv: list[str], monkeypatch) -> list:
    """mlx.launch's main() on ``argv`` with spawning recorded; each rank's arguments."""
    calls = []
    monkeypatch.setattr(launch_mod, "_launch_with_io",
                        lambda cls, arguments, verbose: calls.append(arguments))
    monkeypatch.setattr(sys, "argv", ["mlx.launch", *argv])
    launch_mod.main()
    assert len(calls) == 1
    return [args for args, _ in calls[0]]


CASES = [(p.name, b) for p in SHIPPED for b in ("ring", "jaccl")] + \
    [(f"discovered-{n}.json", b) for n in DISCOVERED for b in ("ring", "jaccl")]


@pytest.mark.parametrize("name,backend", CASES)
def test_real_mlx_launch_accepts_the_converted_hostfile(name, backend, tmp_path, monkeypatch):
    if name.startswith("discovered-"):
        path = discovered(name.removeprefix("discovered-").removesuffix(".json"), tmp_path)
    else:
        path = ROOT / "hostfiles" / name
    hf = load(path)
    opts = runner.Options(via="mlx", backend=backend)
    if (name, backend) in REFUSED:
        with pytest.raises(UsageError, match=REFUSED[(name, backend)]):
            runner.plan(hf, ["python", "x.py"], opts, str(tmp_path))
        return
    p = runner.plan(hf, ["python", "x.py"], opts, str(tmp_path))
    for f, content in p.files.items():
        Path(f).write_text(content)
    ranks = run_mlx_launch(p.argv[1:], monkeypatch)
    written = json.loads(next(iter(p.files.values())))
    assert len(ranks) == len(written["hosts"])
    for rank, (r, host, python, _cwd, files, env, command) in enumerate(ranks):
        assert r == rank and host == written["hosts"][rank]["ssh"]
        assert python == sys.executable and command == ["x.py"]
        if backend == "ring" and len(ranks) > 1:
            ring = json.loads(files["MLX_HOSTFILE"])
            assert [e.split(":")[0] for e in ring[rank]] == written["hosts"][rank]["ips"]
        if backend == "jaccl":
            matrix = json.loads(files["MLX_IBV_DEVICES"])
            assert all((d is None) == (i == j) for i, row in enumerate(matrix)
                       for j, d in enumerate(row))
            coord = next(e for e in env if e.startswith("MLX_JACCL_COORDINATOR="))
            assert coord.split("=")[1].split(":")[0] == written["hosts"][0]["ips"][0]
    if hf.links and backend == "ring":  # the ring runs over the cables, not Ethernet
        cable_addrs = {e.addr for lk in hf.links for e in lk.ends}
        assert all(ip in cable_addrs for h in written["hosts"] for ip in h["ips"])


def test_localhost_json_becomes_local_ranks_mlx_launch_starts_without_ssh(tmp_path,
                                                                          monkeypatch):
    hf = load(ROOT / "hostfiles" / "localhost.json")
    p = runner.plan(hf, ["python", "x.py"], runner.Options(via="mlx", np=2), str(tmp_path))
    for f, content in p.files.items():
        Path(f).write_text(content)
    ranks = run_mlx_launch(p.argv[1:], monkeypatch)
    assert [host for _, host, *_ in ranks] == ["127.0.0.1", "127.0.0.1"]
    ring = json.loads(ranks[0][4]["MLX_HOSTFILE"])
    assert len(ring) == 2 and len({e for r in ring for e in r}) == 2  # one port each


def test_a_real_two_rank_ring_job_through_via_mlx_on_localhost_json():
    """No ssh, no links, no 'ips' in the file: two local ranks all_sum over MLX's ring."""
    import os
    import subprocess

    from ports import free_base_port

    port = free_base_port(2)   # tests/unit/ports.py: not from the ephemeral range
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-m", "hpcmac.launch", "--hostfile", str(ROOT / "hostfiles" /
         "localhost.json"), "--via", "mlx", "--np", "2", "--port", str(port), "--timeout", "60",
         "--", "python", str(ROOT / "tests" / "cluster" / "mlx_ring_check.py")],
        env=env, capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "mlx ring all_sum over 2 ranks ... PASSED" in res.stdout
    assert sorted(ln.split(" on ")[0] for ln in res.stdout.splitlines() if " on " in ln) == [
        "rank 0", "rank 1"]
