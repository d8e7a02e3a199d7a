"""glm4_moe_lite (GLM-4.7-Flash) against transformers at any rank count: the whole model on
one rank, tensor parallel over all ranks, a pipeline of all ranks (and 2 x 2 at four ranks).

Odd shapes: 5 and 6 latent-attention heads (the rank counts do not divide them), with and
without Q LoRA, interleaved and rotate-half rope; 6 and 5 experts of odd widths (13, 11
columns), 2 and 3 per token, grouped and ungrouped, renormalised or not; one and two shared
experts; dense layers given by ``mlp_layer_types`` (one not at the front) and by its
default; tied and untied. The oracle is transformers (``family_util``): 16 greedy tokens
equal and logits within 1e-4 of the largest, two prompts together, prefilled in chunks of 3.
"""

from __future__ import annotations

import pytest
from family_util import cases_fixture, matches_transformers

from hpcmac.errors import UsageError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
#: case -> (seed, config.json fields); seeds whose greedy runs are not degenerate
CASES = {
    "qlora-interleaved-grouped": (1, dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=37, moe_intermediate_size=13,
        num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5,
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
        v_head_dim=10, n_shared_experts=1, routed_scaling_factor=1.8, norm_topk_prob=True,
        rope_interleave=True, mlp_layer_types=["dense", "sparse", "dense", "sparse"],
        bos_token_id=None, eos_token_id=None,
        rope_parameters=dict(rope_type="default", rope_theta=1e4))),
    "no-qlora-rotate-half-tied": (2, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=29, moe_intermediate_size=11,
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6,
        n_routed_experts=5, num_experts_per_tok=3, n_group=1, topk_group=1,
        q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=6, qk_nope_head_dim=10,
        v_head_dim=14, n_shared_experts=2, routed_scaling_factor=2.5, norm_topk_prob=False,
        rope_interleave=False, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None, rope_parameters=dict(rope_type="default", rope_theta=5e4))),
}


checkpoints = cases_fixture("glm4_moe_lite", CASES, VOCAB)
test_matches_transformers = matches_transformers("glm4_moe_lite", CASES)


def test_dense_layers_from_mlp_layer_types():
    from hpcmac.llm.model.arch import config_from_hf

    one = config_from_hf(dict(model_type="glm4_moe_lite", **CASES["qlora-interleaved-grouped"][1]))
    two = config_from_hf(dict(model_type="glm4_moe_lite", **CASES["no-qlora-rotate-half-tied"][1]))
    assert [one.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert [two.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


@pytest.mark.parametrize("field, value, says", [
    ("attention_bias", True, "'attention_bias' = true is not supported"),
    ("partial_rotary_factor", 0.5, "'partial_rotary_factor' = 0.5 is not supported"),
    ("mlp_layer_types", ["dense", "moe", "sparse", "sparse"], "'mlp_layer_types' = "),
    ("mlp_layer_types", ["dense", "sparse"], "expected 4 entries"),
    ("rope_parameters", dict(rope_type="longrope", rope_theta=1e4),
     "rope_type 'longrope' is not supported"),
])
def test_unsupported_field_is_one_line(field, value, says):
    from hpcmac.llm.model.arch import config_from_hf

    raw = {"model_type": "glm4_moe_lite", **CASES["qlora-interleaved-grouped"][1], field: value}
    with pytest.raises(UsageError) as e:
        config_from_hf(raw, "flash/config.json")
    msg = str(e.value)
    assert msg.startswith("flash/config.json: ") and says in msg and "\n" not in msg, msg
