"""kimi_k25 (Kimi K2.5), its text part, against transformers at any rank count: the whole
model on one rank, tensor parallel over all ranks, a pipeline of all ranks (and 2 x 2 at
four ranks).

The folder is laid out as Kimi K2.5 is released: ``config.json`` with the language model
in a nested ``text_config`` (``model_type`` ``kimi_k2``) and a ``vision_config``; the text
model's tensors under ``language_model.``. transformers' own ``Kimi_K25ForConditionalGeneration``
is the oracle (its vision tower left at its random start: the prompts are text). Odd shapes:
5 and 6 latent-attention heads, with and without Q LoRA; 6 and 5 experts of 13 and 11
columns; grouped and ungrouped routing; one and two dense first layers; tied (at the top
level only) and untied. 16 greedy tokens equal and logits within 1e-4 of the largest, two
prompts together, prefilled in chunks of 3 (``family_util``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from family_util import cases_fixture, matches_transformers

from hpcmac.errors import UsageError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
VISION = dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
              num_attention_heads=2, num_hidden_layers=1, hidden_size=16, intermediate_size=24)
#: case -> (seed, (text_config fields, top-level fields)); seeds whose greedy runs are not
#: degenerate
CASES = {
    "qlora-grouped": (1, (dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=37, moe_intermediate_size=13,
        num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5,
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=256), dict(tie_word_embeddings=False))),
    "no-qlora-tied-at-top": (2, (dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=29, moe_intermediate_size=11,
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6,
        n_routed_experts=5, num_experts_per_tok=3, n_group=1, topk_group=1,
        first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=6,
        qk_nope_head_dim=10, v_head_dim=14, n_shared_experts=2, routed_scaling_factor=1.5,
        norm_topk_prob=False, max_position_embeddings=256), dict(tie_word_embeddings=True))),
}


def build_kimi(model_type, path, seed, fields):
    """A random DeepSeek-V3 text model (``fixtures.random_checkpoint``) moved into a Kimi
    K2.5 folder: the config nested, the tensors under ``language_model.``."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    from hpcmac.llm.model.fixtures import random_checkpoint

    text, top = fields
    text_dir = Path(path) / "text"
    random_checkpoint("deepseek_v3", text_dir, seed=seed, initializer_range=0.3,
                      **{**text, "tie_word_embeddings": top["tie_word_embeddings"]})
    text_cfg = json.loads((text_dir / "config.json").read_text())
    text_cfg.update(model_type="kimi_k2", tie_word_embeddings=False)
    tensors = load_file(text_dir / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in tensors.items()},
              Path(path) / "model.safetensors", metadata={"format": "pt"})
    shutil.rmtree(text_dir)
    cfg = {"model_type": "kimi_k25", "architectures": ["Kimi_K25ForConditionalGeneration"],
           "text_config": text_cfg, "vision_config": VISION, "projection_hidden_size": 16,
           **top}
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    return transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager").eval()


checkpoints = cases_fixture("kimi_k25", CASES, VOCAB, build=build_kimi)
test_matches_transformers = matches_transformers("kimi_k25", CASES)


def test_config_from_nested_text_config():
    from hpcmac.llm.model.arch import config_from_hf

    text, top = CASES["no-qlora-tied-at-top"][1]
    cfg = config_from_hf({"model_type": "kimi_k25", "text_config": {**text, "model_type":
                                                                    "kimi_k2"}, **top})
    assert (cfg.arch, cfg.mla, cfg.q_lora_rank, cfg.n_layers, cfg.tie_embeddings) == \
        ("kimi_k25", True, None, 4, True)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, True]


@pytest.mark.parametrize("raw, says", [
    ({"text_config": None}, "field 'text_config' = None: expected an object"),
    ({"text_config": {"model_type": "qwen3"}},
     "field 'text_config.model_type' = 'qwen3' is not supported"),
    ({"text_config": {**CASES["qlora-grouped"][1][0], "rope_scaling": {"type": "longrope"}}},
     "rope_type 'longrope' is not supported"),
    ({"text_config": {k: v for k, v in CASES["qlora-grouped"][1][0].items()
                      if k != "kv_lora_rank"}}, "field 'kv_lora_rank' is missing"),
])
def test_unsupported_field_is_one_line(raw, says):
    from hpcmac.llm.model.arch import config_from_hf

    with pytest.raises(UsageError) as e:
        config_from_hf({"model_type": "kimi_k25", **raw}, "k25/config.json")
    msg = str(e.value)
    assert msg.startswith("k25/config.json") and says in msg and "\n" not in msg, msg


def test_planned_bytes_are_held(checkpoints):
    """weights.stage_nbytes counts the tensors under ``language_model.`` by their canonical
    names, as the loader reads them: what a stage holds, whole and as a tensor rank's part."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import stage_nbytes

    for path, _, _ in checkpoints.values():
        assert stage_nbytes(path, 0, 4, True, True) == load_stage(path, 0, 4).nbytes
        shard = make_shards(load_config(path), [1.0, 1.0])[1]
        part = load_stage(path, 1, 4, False, True, shard=shard, reduce=lambda a: a)
        assert stage_nbytes(path, 1, 4, False, True, shard=shard) == part.nbytes
