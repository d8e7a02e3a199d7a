"""``python -m hpcmac.llm models``, the docs' family table, and the quantization configs
refused before any weights load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcmac.errors import UsageError
from hpcmac.llm import models
from hpcmac.llm.model.arch import NAMES, config_from_hf, families

ROOT = Path(__file__).resolve().parents[2]
#: a small DeepSeek-V3 config.json (the FP8 releases' family)
DSV3 = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=48, intermediate_size=80,
            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, first_k_dense_replace=1)
#: a small Llama config.json (no FP8 releases in the block form: refused)
LLAMA = dict(model_type="llama", vocab_size=96, hidden_size=48, intermediate_size=80,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_docs_table_is_the_commands_output():
    doc = (ROOT / "docs" / "llm.md").read_text()
    begin, end = "<!-- models:begin -->\n", "<!-- models:end -->"
    assert begin in doc and end in doc
    table = doc[doc.index(begin) + len(begin):doc.index(end)]
    assert table == models.markdown(), ("docs/llm.md's family table is stale: paste "
                                        "`python -m hpcmac.llm models --markdown` there")


def test_every_family_listed_with_a_summary():
    got = [r["model_type"] for r in models.rows()]
    assert got == list(NAMES)
    for r in models.rows():
        assert r["summary"] and "\n" not in r["summary"], r["model_type"]
        assert r["checkpoints"][0].startswith("safetensors")
    # GGUF appears exactly for the families with a GGUF architecture
    for n, f in families().items():
        row = next(r for r in models.rows() if r["model_type"] == n)
        assert any(c.startswith("GGUF") for c in row["checkpoints"]) == bool(f.gguf_arch)


def test_command_json():
    out = subprocess.run([sys.executable, "-m", "hpcmac.llm", "models", "--json"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["model_type"] for r in data["families"]] == list(NAMES)
    assert "Q4_K" in data["formats"]["gguf"] and "affine" in data["formats"]["mlx"]


@pytest.mark.parametrize("raw, says", [
    (dict(LLAMA, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": [128, 128]}),
     "quantization_config.quant_method 'fp8' is not supported for llama"),
    (dict(DSV3, quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                     "weight_block_size": [128, 64]}),
     "quantization_config.weight_block_size \\[128, 64\\]: expected \\[b, b\\]"),
    (dict(DSV3, quantization_config={"quant_method": "compressed-tensors",
                                     "format": "pack-quantized"}),
     "quant_method 'compressed-tensors' is not supported for deepseek_v3"),
    (dict(DSV3, model_type="kimi_k2",
          quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"}),
     "quantization_config.config_groups: expected an object"),
    (dict(DSV3, quantization={"group_size": 32, "bits": 4, "mode": "nvfp4"}),
     "quantization: quantization mode 'nvfp4' is not supported"),
    (dict(DSV3, quantization={"group_size": 64, "bits": 4, "mode": "mxfp4"}),
     "mode 'mxfp4' with bits 4, group_size 64: expected bits 4, group_size 32"),
    (dict(DSV3, quantization={"group_size": 64, "bits": 7}),
     "7-bit quantization is not supported"),
    (dict(DSV3, quantization_config="fp8"), "quantization_config: expected a JSON object"),
])
def test_quantization_refused_in_one_line(raw, says):
    with pytest.raises(UsageError, match=says) as e:
        config_from_hf(raw, "m/config.json")
    assert str(e.value).startswith("m/config.json: ") and "\n" not in str(e.value)


def test_quantizations_read_pass():
    config_from_hf(dict(DSV3, quantization={"group_size": 64, "bits": 4,
                                            "model.layers.0.mlp.gate": {"bits": 8,
                                                                        "group_size": 64}}))
    gpt = dict(model_type="gpt_oss", vocab_size=96, hidden_size=40, intermediate_size=21,
               num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
               head_dim=12, num_local_experts=6, num_experts_per_tok=4, sliding_window=8,
               quantization_config={"quant_method": "mxfp4"})
    config_from_hf(gpt)
    from hpcmac.llm.model.fixtures import int4_config

    config_from_hf(dict(DSV3, model_type="kimi_k2", quantization_config=int4_config()))
    for fam in ("deepseek_v3", "kimi_k2"):  # their releases' own quantization_config
        config_from_hf(dict(DSV3, model_type=fam, quantization_config={
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}))


def test_fp8_folder_exits_2_before_weights(tmp_path):
    """The whole command: exit 2, one line naming config.json, no traceback (the folder has
    no weights at all, so reaching them would say something else)."""
    (tmp_path / "config.json").write_text(json.dumps(
        dict(LLAMA, quantization_config={"quant_method": "fp8"})))
    out = subprocess.run([sys.executable, "-m", "hpcmac.llm", "generate", "--model",
                          str(tmp_path), "--prompt-ids", "1,2", "--max-tokens", "1"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json" in lines[0] and "'fp8'" in lines[0], out.stderr
