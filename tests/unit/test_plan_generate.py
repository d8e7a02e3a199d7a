"""``generate`` takes hpcmac.plan's fastest layout by default and records the prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NODE = {"name": "n", "cores": 2, "memory_gb": 16, "dgemm_gflops": {"1": 30, "2": 55},
        "mem_bw_gbs": {"1": 14, "2": 26}, "read_bw_gbs": {"1": 15, "2": 28},
        "sgemm_gflops": {"1": 60, "2": 110}, "layer_s": 5e-5, "token_s": 2e-5}


def generate(tmp: Path, model: Path, env_extra: dict, *flags: str) -> dict:
    out = tmp / "out.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_MPIRUN_TIMEOUT="120",
               HPCMAC_QUIET_TRANSPORT="1", **env_extra)
    if "HPCMAC_PLAN_CALIBRATION" not in env_extra:
        env.pop("HPCMAC_PLAN_CALIBRATION", None)
    cmd = [str(ROOT / "tools" / "mpirun"), "2", sys.executable, "-m", "hpcmac.llm",
           "generate", "--model", str(model), "--prompt-ids", "1,2,3,4", "--max-tokens", "4",
           "--json", str(out), "--quiet", *flags]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("safetensors")
    from hpcmac.measure.llm import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("m") / "llama", 128, 4, 256, 512,
                              heads=4, kv_heads=2)


def test_layout_from_the_prediction_and_recorded(model, tmp_path):
    cal = tmp_path / "node.json"
    cal.write_text(json.dumps(NODE))
    doc = generate(tmp_path, model, {"HPCMAC_PLAN_CALIBRATION": str(cal)})
    pred, lay = doc["prediction"], doc["layout"]
    assert pred["available"]
    assert (pred["tp"], pred["pp"]) == (lay["tp"], lay["pp"])
    assert lay["why"].startswith("hpcmac.plan predicts")
    best = max((x for x in pred["layouts"] if x["fits"]), key=lambda x: x["decode_tok_s"])
    assert (best["tp"], best["pp"]) == (lay["tp"], lay["pp"])
    assert pred["decode_tok_s"] > 0 and doc["decode_tok_s"] > 0  # predicted next to measured
    # flags still win; the prediction of the layout run is recorded all the same
    doc = generate(tmp_path, model, {"HPCMAC_PLAN_CALIBRATION": str(cal)}, "--pp", "2")
    assert (doc["layout"]["tp"], doc["layout"]["pp"]) == (1, 2)
    assert (doc["prediction"]["tp"], doc["prediction"]["pp"]) == (1, 2)


def test_without_node_figures_no_prediction_and_why(model, tmp_path):
    doc = generate(tmp_path, model, {})
    assert doc["prediction"] == {"available": False, "why": doc["prediction"]["why"]}
    assert "HPCMAC_PLAN_CALIBRATION" in doc["prediction"]["why"]
    assert not doc["layout"]["why"].startswith("hpcmac.plan")
