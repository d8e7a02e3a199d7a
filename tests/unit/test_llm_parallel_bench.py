"""``python -m hpcmac.bench.llm_parallel`` end to end on a tiny model (a smoke run, not a
measurement): every layout measured, the all-reduce counts of tensor 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_small_run_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    from hpcmac.llm.model.fixtures import random_checkpoint

    model = random_checkpoint("llama", tmp_path / "llama", seed=1, num_hidden_layers=2)
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "hpcmac.bench.llm_parallel", "--model",
                           str(model), "--prompt-len", "4", "--new", "3", "--batch", "3",
                           "--repeats", "1", "--no-load", "--stream-mib", "8",
                           "--read-rates", "--read-mib", "8", "--settle-s", "0",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())["runs"]["quiet"]
    for lay in ("one rank", "pipeline 2", "tensor 2"):
        assert doc["results"][lay]["single"]["decode_tok_s"] > 0
    t = doc["results"]["tensor 2"]["single"]
    # 2 layers: two all-reduces each, and one for the embedding, per step
    assert t["reduces_per_step"] == pytest.approx(5)
    assert t["reduce_bytes_per_token"] > 0 and t["reduce_ms"] > 0
    assert "of the ceiling" in proc.stdout and "tensor 2 |" in proc.stdout
    # both ways of measuring the bandwidth ceiling: numpy.sum and decode's matvec kernel
    for key in ("mem_gb_s", "mem_gb_s_matvec"):
        assert all(v > 0 for v in doc[key].values()), key
    assert "decode's matvec" in proc.stdout
    # other processes' CPU during the runs, in cores: only for rows long enough for
    # /proc/stat's 10 ms ticks (a tiny run's row may be shorter and then has none)
    from hpcmac.bench.llm_parallel import OTHER_MIN_WALL_S

    cores = os.cpu_count() or 1
    slack = cores * 0.02 / OTHER_MIN_WALL_S  # two ticks per core over the shortest row
    rows = [r for lay in doc["results"].values() for r in lay.values() if "other_cores" in r]
    assert all(0 <= r["other_cores"] <= cores + slack for r in rows), rows
    # --read-rates: calibrate's read bandwidth at 1 and 2 threads just before and just
    # after each 1-sequence run, a pair per layout in every round (the planner's test)
    (rnd,) = doc["rounds"]
    for lay in ("one rank", "pipeline 2", "tensor 2"):
        pair = rnd["read_gb_s"][lay]
        assert all(pair[w][k] > 0 for w in ("before", "after") for k in ("1", "2")), pair
        assert rnd["single"][lay]["decode_tok_s"] > 0
    # consecutive runs share a reading: one's after is the next one's before
    assert rnd["read_gb_s"]["one rank"]["after"] == rnd["read_gb_s"]["pipeline 2"]["before"]


def test_batch_zero_is_the_single_runs_alone_and_negative_a_usage_error():
    """--batch 0 (the planner's calibration test) leaves the batched column empty; a
    negative count is a usage error naming the flag."""
    from hpcmac.bench.llm_parallel import LAYOUTS, build_parser, table
    from hpcmac.errors import UsageError

    assert build_parser().parse_args(["--batch", "0"]).batch == 0
    with pytest.raises(UsageError, match=r"--batch: expected a whole number >= 0, got '-1'"):
        build_parser().parse_args(["--batch", "-1"])
    row = {"decode_tok_s": 2.0, "prefill_tok_s": 5.0, "cpu_s_per_token": 0.5}
    doc = {"results": {lay: {"single": dict(row)} for lay in LAYOUTS},
           "mem_gb_s": {"1": 10.0, "2": 15.0}}
    lines = table(doc, 0).splitlines()
    assert len(lines) == 2 + len(LAYOUTS) + 1
    assert all(line.split(" | ")[4] == "-" for line in lines[2:2 + len(LAYOUTS)]), lines
