"""``generate`` with tensor parallelism under ``tools/mpirun``: layouts in the JSON, the
same tokens as one rank, and refused layouts (one line, exit 2, before weights load).

The MPI suite (tests/mpi/test_tensor_parity.py) checks tokens and logits of every
architecture; these check what a user of the command line sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = str(ROOT / "tools" / "mpirun")
PY = sys.executable

pytestmark = pytest.mark.timeout(300)


def generate(np_: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["HPCMAC_QUIET_TRANSPORT"] = "1"
    env["HPCMAC_MPIRUN_TIMEOUT"] = "240"
    cmd = [MPIRUN, str(np_), PY, "-m", "hpcmac.llm", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=250, cwd=ROOT)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """7 heads over 1 KV head (MQA), odd widths: nothing divides by 2, 3 or 4."""
    from hpcmac.llm.model.fixtures import random_checkpoint

    return str(random_checkpoint("llama", tmp_path_factory.mktemp("ck") / "llama7", seed=6,
                                 num_hidden_layers=4, hidden_size=56, intermediate_size=97,
                                 num_attention_heads=7, num_key_value_heads=1, vocab_size=101))


def one_rank(path: str, prompt: list[int], n: int) -> list[int]:
    from hpcmac.llm.model.generate import Generator
    from hpcmac.llm.model.stage import load_stage

    return Generator(load_stage(path, 0, 4), max_len=len(prompt) + n).generate(prompt, n).tokens


def error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "layout:" not in proc.stderr, proc.stderr  # refused before loading
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_tensor_3_uneven_shares_json(llama, tmp_path):
    out = tmp_path / "out.json"
    proc = generate(3, "--model", llama, "--prompt-ids", "5,6,7,8", "--max-tokens", "7",
                    "--tp-split", "2,1,1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "layout: tensor 3 (as asked)" in proc.stderr and "heads per tensor rank 3/2/2" \
        in proc.stderr, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["tokens"] == one_rank(llama, [5, 6, 7, 8], 7)
    lay = doc["layout"]
    assert (lay["tp"], lay["pp"]) == (3, 1)
    assert [r["heads"] for r in lay["ranks"]] == [3, 2, 2]  # 7 x (2, 1, 1) / 4
    assert [r["kv_heads"] for r in lay["ranks"]] == [1, 1, 1]  # one KV head, held by all
    assert [r["ffn"] for r in lay["ranks"]] == [49, 24, 24]
    assert lay["split"]["tp_shares"] == [[2.0, 1.0, 1.0]]
    assert len(doc["tensor"]) == 3 and all(t["reduces"] > 0 for t in doc["tensor"])


def test_default_layouts(llama, tmp_path):
    """One prompt on one host: tensor over every rank; a batch: the pipeline."""
    out = tmp_path / "out.json"
    proc = generate(2, "--model", llama, "--prompt-ids", "9,8", "--max-tokens", "5",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "layout: tensor 2 (one sequence over fast links" in proc.stderr, proc.stderr
    assert json.loads(out.read_text())["tokens"] == one_rank(llama, [9, 8], 5)
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4]}\n')
    proc = generate(2, "--model", llama, "--batch", str(batch), "--max-tokens", "4",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "pipeline: 2 stages" in proc.stderr
    assert json.loads(out.read_text())["layout"]["why"].startswith("2 sequences keep")


def test_pipeline_2_x_tensor_2_batch(llama, tmp_path):
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "out.json"
    proc = generate(4, "--model", llama, "--batch", str(batch), "--max-tokens", "5",
                    "--tp", "2", "--pp", "2", "--prefill-chunk", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert (doc["layout"]["tp"], doc["layout"]["pp"]) == (2, 2)
    assert [r["stage"] for r in doc["layout"]["ranks"]] == [0, 0, 1, 1]
    for p, seq in zip(prompts, doc["sequences"]):
        assert seq["tokens"] == one_rank(llama, p, 5)


@pytest.mark.parametrize("np_, args, expect", [
    (4, ("--tp", "3"), "error: --tp 3: 4 ranks do not split into tensor groups of 3"),
    (3, ("--tp-split", "2,1"), "error: --tp-split 2,1: 3 ranks do not split into tensor "
                               "groups of 2"),
    (2, ("--tp", "2", "--tp-split", "1,1,1"),
     "error: --tp-split '1,1,1' has 3 shares but --tp is 2"),
    (2, ("--tp", "0"), "error: --tp 0: expected a positive number of ranks"),
])
def test_refused_layouts(llama, np_, args, expect):
    line = error_line(generate(np_, "--model", llama, "--prompt-ids", "1", *args))
    assert line.startswith(expect), line


def test_share_that_does_not_fit_is_refused(llama, tmp_path):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"hosts": [{"name": "localhost", "slots": 2,
                                         "memory_gb": 1e-6}]}))
    line = error_line(generate(2, "--model", llama, "--prompt-ids", "1", "--tp", "2",
                               "--hostfile", str(hf)))
    assert f"rank 0 on {os.uname().nodename} (stage 0, tensor rank 0: layers [0, 4), " \
           "4 of 7 heads) needs" in line, line
    assert "--tp-split" in line
