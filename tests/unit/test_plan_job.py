"""hpcmac.plan.job: the cluster a running job is on, and its layouts ranked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcmac.plan import job

SMALL = str(Path(__file__).parent / "data" / "plan_qwen3_small.json")
NODE = {"name": "n", "cores": 2, "memory_gb": 16, "dgemm_gflops": {"1": 30, "2": 55},
        "mem_bw_gbs": {"1": 14, "2": 26}, "read_bw_gbs": {"1": 15, "2": 28},
        "sgemm_gflops": {"1": 60, "2": 110}, "layer_s": 5e-5, "token_s": 2e-5}


def test_one_host_from_a_calibration(tmp_path, monkeypatch):
    cal = tmp_path / "node.json"
    cal.write_text(json.dumps(NODE))
    monkeypatch.setenv(job.CALIBRATION_ENV, str(cal))
    cl, why = job.job_cluster(["h", "h"])
    assert why == "" and len(cl.nodes) == 1 and cl.nodes[0].slots == 2
    preds, why = job.predict_layouts(SMALL, ["h", "h"])
    assert why == "" and {(p.tp, p.pp) for p in preds} == {(1, 2), (2, 1)}
    # one host: the tensor group streams half the weights each, over shared memory
    assert preds[0].layout == "tensor"
    many, _ = job.predict_layouts(SMALL, ["h", "h"], sequences=32)
    assert all(p.batch == 32 for p in many)


def test_hosts_from_the_hostfile_and_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv(job.CALIBRATION_ENV, raising=False)
    monkeypatch.delenv(job.COMM_ENV, raising=False)
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"hosts": [{"name": "a", "machine": "m3-ultra", "memory_gb": 256},
                                        {"name": "b", "machine": "m3-ultra"}],
                              "link": "2.5gbe"}))
    cl, why = job.job_cluster(["a", "b"], str(hf))
    assert why == "" and cl.link.name == "2.5gbe" and cl.nodes[0].rates.memory_gb == 256
    preds, _ = job.predict_layouts(SMALL, ["a", "b"], hostfile=str(hf))
    assert preds[0].layout == "pipeline"  # two all-reduces per layer over 2.5 GbE cost more
    cl, why = job.job_cluster(["a", "b"])
    assert cl is None and job.CALIBRATION_ENV in why
    hf.write_text(json.dumps({"hosts": [{"name": "a", "machine": "m3-ultra"},
                                        {"name": "b", "machine": "m3-ultra"}]}))
    cl, why = job.job_cluster(["a", "b"], str(hf))
    assert cl is None and "'link'" in why
    cl, _ = job.job_cluster(["a", "b"], str(hf), transport="rdma")
    assert cl.link.name == "tb5-rdma"
    assert job.job_cluster(["a", "b", "a"], str(hf))[0] is None


@pytest.mark.parametrize("backend, quantize, bits, act", [
    ("numpy", None, 32.0, 4), ("mlx", None, 16.0, 2), ("mlx", 4, 4.5, 2)])
def test_runtime_shape(backend, quantize, bits, act):
    shape, a = job.runtime_shape(SMALL, backend, quantize)
    assert (shape.bits, a) == (bits, act)
