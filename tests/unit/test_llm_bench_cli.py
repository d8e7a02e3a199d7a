"""``python -m hpcmac.bench.llm``'s arguments: bad input is one line and exit 2, before any
model is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcmac.bench.llm import QUANT_TYPES, quant_types
from hpcmac.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


def test_quant_types_are_upper_cased_and_empty_means_none():
    assert quant_types("q8_0, Q4_0") == ["Q8_0", "Q4_0"]
    assert quant_types("") == [] and quant_types(",") == []
    assert set(quant_types(",".join(QUANT_TYPES))) == set(QUANT_TYPES)


@pytest.mark.parametrize("value", ["Q4_K", "q3", "Q8_0,F16"])
def test_unknown_quant_type_is_a_usage_error(value):
    with pytest.raises(UsageError, match="is not a GGUF type this benchmark can write"):
        quant_types(value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, expect", [
    (["--quant", "Q4_K"], "--quant: 'Q4_K' is not a GGUF type this benchmark can write"),
    (["--steps", "0"], "--threads, --steps, --batch and --rounds must be >= 1"),
    (["--contexts", "64,4k"], "--contexts '64,4k': expected prompt lengths >= 1"),
    (["--family", "gpt_oss"], "--family: invalid choice: 'gpt_oss'"),
    (["--rows", "1,x"], "--rows '1,x': expected activation row counts >= 1"),
    (["--llamacpp-native", "/nonexistent"], "--llamacpp-native /nonexistent: no "
                                            "/nonexistent/bin/python (expected a Python venv"),
    (["--llamacpp-native", sys.prefix], f"--llamacpp-native {sys.prefix}: its Python cannot "
                                        "import llama_cpp"),
])
def test_bad_arguments_are_one_line(tmp_path, argv, expect):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "hpcmac.bench.llm", "--workdir", str(tmp_path),
                        *argv], capture_output=True, text=True, timeout=100, env=env)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert expect in lines[0]
    assert not any(tmp_path.iterdir())  # refused before writing a model


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_family_qwen3_next_gives_the_context_rows(tmp_path):
    """--family qwen3_next: the random model is a Qwen3-Next (linear attention), decoded
    after each --contexts length; the Llama-only rows are not run."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "hpcmac.bench.llm", "--family", "qwen3_next",
                        "--hidden", "128", "--layers", "4", "--intermediate", "64", "--vocab",
                        "128", "--contexts", "8,40", "--rounds", "1", "--steps", "2",
                        "--batch", "2", "--workdir", str(tmp_path / "w"), "--json", str(out)],
                       capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "model: qwen3_next, 4 layers, hidden 128" in p.stdout
    med = json.loads(out.read_text())["median"]
    assert med["ctx8"] > 0 and med["ctx40"] > 0 and med["ctx8_vs_ctx8"] == 1.0
    assert not any(k.startswith(("Q8_0", "MXFP4", "FP8")) or k == "llamacpp" for k in med)


@pytest.mark.timeout(300)
def test_rows_times_both_paths_and_names_the_one_qmatmul_takes(tmp_path, capsys):
    """--rows on a small Q4_0 GGUF: every quantized matrix, the kernel and the tiles timed
    at each row count, and past BLOCK_ROWS the line says qmatmul takes the tiles."""
    from hpcmac.bench import llm_rows
    from hpcmac.llm.model.fixtures import write_gguf
    from hpcmac.llm.model.qkernels import BLOCK_ROWS
    from hpcmac.measure.llm import write_random_llama

    folder = write_random_llama(tmp_path / "llama", 128, 2, 256, 256, heads=2, kv_heads=1)
    gguf = write_gguf(folder, tmp_path / "m.gguf", "Q4_0")
    out = tmp_path / "rows.json"
    rows = [1, 5, BLOCK_ROWS + 1]
    assert llm_rows.run(str(gguf), rows, 2, str(out)) == 0
    doc = json.loads(out.read_text())
    assert doc["matrices"] >= 2 * 4 and 1 in doc["kinds"]  # each layer's four, 4-bit
    for p in ("kernel_ms", "tiles_ms"):
        assert all(len(doc["times"][p][str(m)]) == 2 for m in rows)
        assert all(v > 0 for v in doc["median"][p].values())
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.split()[:1] == ["1"] and ln.endswith("kernel") for ln in lines)
    assert any(ln.split()[:1] == [str(BLOCK_ROWS + 1)] and ln.endswith("tiles") for ln in lines)
