"""kimi_k2 (Kimi K2's own ``model_type``) against transformers at any rank count: a random
DeepSeek-V3 checkpoint (5 latent-attention heads, Q LoRA, 6 experts of 13 columns in 2
groups, a dense first layer) whose config.json then says ``kimi_k2``, as K2's does;
transformers runs it as the DeepSeek-V3 it is. 16 greedy tokens equal and logits within
1e-4 of the largest in every layout of the rank count (``family_util``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from family_util import build_checkpoint, check_case, write_cases

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
CASES = {"k2": (1, dict(
    vocab_size=VOCAB, hidden_size=40, intermediate_size=37, moe_intermediate_size=13,
    num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5, n_routed_experts=6,
    num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=24,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
    n_shared_experts=1, routed_scaling_factor=2.827, norm_topk_prob=True,
    max_position_embeddings=256))}


def build_k2(model_type, path, seed, fields):
    model = build_checkpoint("deepseek_v3", path, seed, fields)
    cfg = Path(path) / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_type": "kimi_k2"}))
    return model


@pytest.fixture(scope="module")
def checkpoints():
    with write_cases("kimi_k2", CASES, VOCAB, build=build_k2) as out:
        yield out


def test_matches_transformers(checkpoints):
    from hpcmac.llm.model.config import load_config

    path = checkpoints["k2"][0]
    assert load_config(path).arch == "kimi_k2"
    check_case("kimi_k2", checkpoints["k2"])
