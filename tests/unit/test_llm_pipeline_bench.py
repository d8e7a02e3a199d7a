"""``python -m hpcmac.bench.llm_pipeline``: its ceiling model, and one small real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcmac.bench.llm_pipeline import ceilings

ROOT = Path(__file__).resolve().parents[2]


def _docs(bw_ratio: float) -> list[dict]:
    # one rank: a step of B sequences takes 20 ms + B x 2 ms
    ref = {f"batch{b}": {"decode_tok_s": b / (0.020 + b * 0.002)} for b in (4, 16, 64)}
    return [{"ranks": 1, "mem_gb_s": 20.0, "results": ref},
            {"ranks": 2, "mem_gb_s": 20.0 * bw_ratio, "results": {}}]


def test_ceiling_model():
    w, c, x = ceilings(_docs(2.0), [4, 16, 64])
    assert w == pytest.approx(0.020) and c == pytest.approx(0.002)
    # two stages, each with its own memory bandwidth: (W + B c) / (W + B c / 2)
    assert x[(2, 4)] == pytest.approx(28 / 24)
    assert x[(2, 64)] == pytest.approx(148 / 84)
    # the two ranks share 1.5x one rank's bandwidth: streaming takes W * 2 / 1.5
    shared = ceilings(_docs(1.5), [4, 16, 64])[2]
    assert shared[(2, 4)] == pytest.approx(28 / (20 * 2 / 1.5 + 4))
    # one batch size: nothing to fit
    assert ceilings(_docs(2.0), [4]) is None


def test_small_run_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    from hpcmac.llm.model.fixtures import random_checkpoint

    model = random_checkpoint("llama", tmp_path / "llama", seed=3, num_hidden_layers=4)
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HPCMAC_MPIRUN_TIMEOUT="240")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcmac.bench.llm_pipeline", "--model", str(model),
         "--ranks", "1,2", "--batches", "2,4", "--new", "4", "--prompt-len", "8",
         "--batch-prompt-len", "4", "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["ranks"] for r in runs] == [1, 2]
    assert all(r["mem_gb_s"] > 0 for r in runs)
    two = runs[1]["results"]
    hidden = runs[1]["hidden"]
    fwd, back = two["batch4"]["bytes_per_token"]
    # one hidden vector + 20 bytes of metadata per token + a 16-byte header per
    # micro-batch; 4-byte ids + a 4-byte micro-batch id back. Micro-batches form from
    # the sequences ready when a slot frees (at most ceil(4 / 2) = 2 each), so a loaded
    # machine sometimes sends one alone: between 1/2 and 1 micro-batch per token, the
    # same count both ways
    per_mb = (fwd - 4 * hidden - 20) / 16
    assert 0.5 - 1e-9 <= per_mb <= 1 + 1e-9, (fwd, hidden)
    assert back == pytest.approx(4 + 4 * per_mb)
    assert all(r["results"]["batch4"]["decode_tok_s"] > 0 for r in runs)
    assert "estimated ceiling" in proc.stdout and "memory GB/s" in proc.stdout


def test_llm_bench_subcommand_passes_its_flags(capsys):
    """``python -m hpcmac.llm bench --ranks ...`` reaches the benchmark's own parser."""
    from hpcmac.llm.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--ranks", "x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --ranks 'x': expected comma-separated integers", err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "--batches" in capsys.readouterr().out
