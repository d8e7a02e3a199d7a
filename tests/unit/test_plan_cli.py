"""``python -m hpcmac.plan``: answers, output forms, and one-line refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcmac.plan.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "hpcmac.plan", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=60)


def test_hpl_scaling_table_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    p = run("hpl", "--machine", "m3-ultra", "--nodes", "1,2,4", "--link", "2.5gbe,tb5-rdma",
            "--json", str(out), "--plot", str(png))
    assert p.returncode == 0, p.stderr
    recs = json.loads(out.read_text())
    assert [(r["link"], r["nodes"]) for r in recs] == [
        (lk, k) for lk in ("2.5gbe", "tb5-rdma") for k in (1, 2, 4)]
    assert "Gflops" in p.stdout and len(p.stdout.splitlines()) == 7
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # more nodes, more Gflops; RDMA never behind Ethernet
    for lk in ("2.5gbe", "tb5-rdma"):
        g = [r["gflops"] for r in recs if r["link"] == lk]
        assert g == sorted(g)
    assert recs[5]["gflops"] >= recs[2]["gflops"]


def test_json_to_stdout_is_only_json():
    p = run("hpl", "--machine", "m4-pro", "--nodes", "2", "--link", "tb5-tcp", "-N", "40000",
            "--nb", "192", "-P", "1", "-Q", "2", "--json", "-")
    assert p.returncode == 0, p.stderr
    (rec,) = json.loads(p.stdout)
    assert (rec["n"], rec["nb"], rec["p"], rec["q"]) == (40000, 192, 1, 2)


@pytest.mark.parametrize("argv", [
    ["hpl", "--machine", "m3-ultra", "--nodes", "1,2,4", "--link", "2.5gbe,10gbe,tb5-tcp,tb5-rdma"],
    ["hpl", "--machine", "m3-ultra", "--nodes", "4", "--link", "2.5gbe", "--slots", "32",
     "--blas-threads", "1"],
    ["machines"],
])
def test_answers_in_under_a_second(argv, capsys):
    t = time.perf_counter()
    assert main(argv) == 0
    assert time.perf_counter() - t < 1.0
    assert capsys.readouterr().out


def _hostfile(tmp_path: Path, hosts: list[dict], **top) -> str:
    f = tmp_path / "hosts.json"
    f.write_text(json.dumps({"hosts": hosts, **top}))
    return str(f)


def test_hostfile_cluster(tmp_path):
    hf = _hostfile(tmp_path, [{"name": "a", "machine": "m3-ultra", "memory_gb": 512},
                              {"name": "b", "machine": "m3-ultra", "memory_gb": 256}],
                   link="tb5-rdma")
    p = run("hpl", "--hostfile", hf, "--json", "-")
    assert p.returncode == 0, p.stderr
    (rec,) = json.loads(p.stdout)
    assert rec["link"] == "tb5-rdma" and rec["ranks"] == 2
    assert rec["memory_fraction"] == pytest.approx(0.8, rel=0.02)


@pytest.mark.parametrize("args, hosts, top, expect", [
    (["--machine", "m9-ultra"], None, {}, "unknown machine 'm9-ultra'; known: m1-ultra"),
    (["--machine", "m3-ultra", "--nodes", "2", "--link", "wifi"], None, {},
     "unknown link 'wifi'; known: 2.5gbe"),
    (["--machine", "m3-ultra", "--nodes", "2"], None, {},
     "2 nodes but no link type: give --link NAME"),
    ([], [{"name": "a"}, {"name": "b"}], {"link": "10gbe"},
     "host 'a': no field 'machine' (one of m1-ultra"),
    ([], [{"name": "a", "machine": "m3-ultra"}, {"name": "b", "machine": "m3-ultra"}], {},
     "no field 'link' (one of 2.5gbe"),
    ([], [{"name": "a", "machine": "m3-ultra", "memory_gb": -1}], {},
     "field 'memory_gb' must be positive"),
    (["--machine", "m3-ultra", "--calibration", "missing.json"], None, {},
     "calibration missing.json: cannot read: "),
    (["--machine", "m3-ultra", "--nodes", "2", "--comm", "{bad}"], None, {},
     "bench.comm report {bad}: cannot read: "),
    (["--machine", "m3-ultra", "-N", "1000", "--nb", "100", "-P", "2", "-Q", "2"], None, {},
     "-P 2 -Q 2 needs 4 ranks; the cluster has 1"),
    (["--machine", "m3-ultra", "--fill", "1.5"], None, {}, "--fill must be in (0, 1]"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, hosts, top, expect):
    if hosts is not None:
        args = [*args, "--hostfile", _hostfile(tmp_path, hosts, **top)]
    p = run("hpl", *args, cwd=tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert expect in lines[0]


@pytest.mark.parametrize("tensor, expect", [
    ("fast", "field 'tensor' should be an object with numbers 'reduce_s', 'step_s' and "
             "'sync_frac'"),
    ({"reduce_s": 1e-4, "step_s": 0}, "field 'tensor' should be an object with numbers"),
    ({"reduce_s": "x", "step_s": 0, "sync_frac": 0},
     "field 'tensor' should be an object with numbers"),
    ({"reduce_s": -1e-4, "step_s": 0, "sync_frac": 0},
     "'reduce_s', 'step_s' and 'sync_frac' must be numbers >= 0"),
    # NaN and Infinity are not JSON: the strict reader refuses them first
    ({"reduce_s": 1e-4, "step_s": float("nan"), "sync_frac": 0}, "NaN is not a number JSON"),
    ({"reduce_s": 1e-4, "step_s": 0, "sync_frac": float("inf")}, "is not a number JSON"),
    ({"reduce_s": 1e-4, "step_s": 0, "sync_frac": 0, "hop_s": "x"},
     "field 'tensor': 'hop_s' must be a number >= 0"),
    ({"reduce_s": 1e-4, "step_s": 0, "sync_frac": 0, "hop_s": -1e-5},
     "field 'tensor': 'hop_s' must be a number >= 0"),
])
def test_bad_tensor_runtime_figures_are_one_line(tmp_path, tensor, expect):
    f = tmp_path / "node.json"
    f.write_text(json.dumps({"cores": 2, "memory_gb": 8, "dgemm_gflops": {"1": 40},
                             "mem_bw_gbs": {"1": 10}, "tensor": tensor}))
    model = ROOT / "tests" / "unit" / "data" / "plan_qwen3_small.json"
    p = run("llm", str(model), "--calibration", str(f), "--slots", "2", cwd=tmp_path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert str(f) in lines[0] and expect in lines[0]


def test_bad_comm_json_says_how_to_measure(tmp_path):
    f = tmp_path / "comm.json"
    f.write_text(json.dumps({"latency": [], "bandwidth": []}))
    p = run("hpl", "--machine", "m3-ultra", "--comm", str(f))
    assert p.returncode == 2
    assert "python -m hpcmac.bench.comm --json" in p.stderr


@pytest.mark.parametrize("argv, expect", [
    (["hpl", "--machine", "m4", "--slots", "0"], "--slots must be >= 1, got 0"),
    (["hpl", "--machine", "m4", "-N", "0", "--nb", "64", "-P", "1", "-Q", "1"],
     "N must be >= 1, got 0"),
    (["llm", "smollm2", "--machine", "m4", "--bits", "0"], "--bits must be in (0, 64]"),
    (["llm", "smollm2", "--machine", "m4", "--batch", "0"], "--batch must be >= 1, got 0"),
])
def test_bad_numbers_are_refused(argv, expect):
    from hpcmac.errors import UsageError

    with pytest.raises(UsageError, match=expect.replace("(", r"\(").replace("]", r"\]")):
        main(argv)


def test_llm_prints_the_runtime_placement_of_the_chosen_layout(tmp_path):
    """The chosen layout's placement (the runtime's own, hpcmac.llm.parallel.placement)
    printed under its row and stored in the JSON; a header-only model gets none."""
    out = tmp_path / "p.json"
    p = run("llm", "smollm2", "--machine", "m4", "--nodes", "2", "--link", "tb5-rdma",
            "--json", str(out))
    assert p.returncode == 0, p.stderr
    lines = [ln.strip() for ln in p.stdout.splitlines() if "placement:" in ln]
    assert lines == ["placement: pipeline: 2 stages, layers [18, 12] (split by memory)"]
    chosen = [r for r in json.loads(out.read_text()) if r["chosen"]]
    ranks = chosen[0]["placement"]["ranks"]
    assert [(r["host"], r["layers"]) for r in ranks] == [("node0", [0, 18]), ("node1", [18, 30])]
    assert all(0 < r["need_bytes"] < r["budget_bytes"] for r in ranks)
    model = ROOT / "tests" / "unit" / "data" / "plan_qwen3_small.json"
    p = run("llm", str(model), "--machine", "m4", cwd=tmp_path)
    assert p.returncode == 0 and "placement:" not in p.stdout, (p.stdout, p.stderr)
