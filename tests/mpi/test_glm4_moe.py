"""glm4_moe (GLM-4.5 to 4.7) against transformers at any rank count: the whole model on one
rank, tensor parallel over all ranks, a pipeline of all ranks (and 2 x 2 at four ranks).

Odd shapes: 5 query heads over 1 KV head and 6 over 2 (heads the rank counts do not
divide, fewer KV heads than ranks), 6 and 5 experts of odd widths (21, 13 columns), odd
MLP widths; rotary on half and on a quarter of each head; QK-norm on and off; Q/K/V
biases; one and two shared experts; one and two dense first layers; grouped and
ungrouped routing. The oracle is transformers itself (``family_util``: rank 0 runs it,
each prompt alone): 16 greedy tokens equal and logits within 1e-4 of the largest at every step,
with two prompts run together, prefilled in chunks of 3 tokens.
"""

from __future__ import annotations

import pytest
from family_util import cases_fixture, matches_transformers

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
#: case -> (seed, config.json fields); seeds whose greedy runs are not degenerate
CASES = {
    "qknorm-bias-grouped": (32, dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=73, moe_intermediate_size=21,
        num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, head_dim=12,
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5,
        attention_bias=True, use_qk_norm=True, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))),
    "quarter-rope-tied": (31, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=61, moe_intermediate_size=13,
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        n_routed_experts=5, num_experts_per_tok=3, n_group=1, topk_group=1,
        first_k_dense_replace=2, n_shared_experts=2, routed_scaling_factor=2.0,
        attention_bias=False, use_qk_norm=False, norm_topk_prob=False,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=5e4,
                             partial_rotary_factor=0.25))),
}

checkpoints = cases_fixture("glm4_moe", CASES, VOCAB)
test_matches_transformers = matches_transformers("glm4_moe", CASES)
