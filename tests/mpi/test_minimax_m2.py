"""minimax_m2 (MiniMax-M2) against transformers at any rank count: the whole model on one
rank, tensor parallel over all ranks, a pipeline of all ranks (and 2 x 2 at four ranks).

Odd shapes: 5 query heads over 1 KV head and 6 over 2 (heads the rank counts do not
divide, fewer KV heads than ranks: the full-width Q/K norm's sums of squares are summed
over the group with each shared KV head counted once), 6 and 5 experts of odd widths (21,
13 columns), 2 and 3 of them per token; rotary on half and on a quarter of each head (the
second given as the released checkpoints' ``rotary_dim``); tied and untied. The oracle is
transformers (``family_util``): 16 greedy tokens equal and logits within 1e-4 of the
largest, two prompts together, prefilled in chunks of 3.
"""

from __future__ import annotations

import pytest
from family_util import cases_fixture, matches_transformers

from hpcmac.errors import UsageError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
#: case -> (seed, config.json fields); seeds whose greedy runs are not degenerate
CASES = {
    "5q-1kv-half-rope": (4, dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=21, num_hidden_layers=4,
        num_attention_heads=5, num_key_value_heads=1, head_dim=12, num_local_experts=6,
        num_experts_per_tok=2,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))),
    "6q-2kv-quarter-rope-tied": (10, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=13, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, num_local_experts=5,
        num_experts_per_tok=3, tie_word_embeddings=True, rotary_dim=4,
        rope_parameters=dict(rope_type="default", rope_theta=5e4))),
}


checkpoints = cases_fixture("minimax_m2", CASES, VOCAB)
test_matches_transformers = matches_transformers("minimax_m2", CASES)


def test_rotary_dim_maps_to_partial_rotary():
    from hpcmac.llm.model.arch import config_from_hf

    raw = dict(model_type="minimax_m2", **CASES["6q-2kv-quarter-rope-tied"][1])
    assert config_from_hf(raw).rope_dim == 4


@pytest.mark.parametrize("field, value, says", [
    ("qk_norm_type", "per_head", "'qk_norm_type' = 'per_head' is not supported"),
    ("scoring_func", "softmax", "'scoring_func' = 'softmax' is not supported"),
    ("shared_intermediate_size", 64, "'shared_intermediate_size' = 64 is not supported"),
    ("attn_type_list", [0, 1, 1, 1], "'attn_type_list' asks for linear-attention layers"),
    ("rope_parameters", dict(rope_type="longrope", rope_theta=1e4),
     "rope_type 'longrope' is not supported"),
])
def test_unsupported_field_is_one_line(field, value, says):
    from hpcmac.llm.model.arch import config_from_hf

    raw = {"model_type": "minimax_m2", **CASES["5q-1kv-half-rope"][1], field: value}
    with pytest.raises(UsageError) as e:
        config_from_hf(raw, "m2/config.json")
    msg = str(e.value)
    assert msg.startswith("m2/config.json: ") and says in msg and "\n" not in msg, msg
