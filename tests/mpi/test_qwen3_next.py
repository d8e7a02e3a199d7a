"""qwen3_next against transformers at any rank count: the whole model on one rank, tensor
parallel over all ranks, a pipeline of all ranks (and 2 x 2 and tensor 3 at four ranks).

Odd shapes: Gated DeltaNet layers of 2 key heads over 6 value heads (tensor 3 gives each
rank two value heads, the middle one reading both key heads: a key head held twice) and of
4 over 4 (tensor 3 splits them 2 / 1 / 1); full attention of 5 query heads over 1 KV head and 6
over 2, with the output gate and a rotary quarter of each head; 6 and 5 experts, 2 and 3
per token, with a gated shared expert of another width; a dense layer
(``mlp_only_layers``), Q/K/V/O biases, tied embeddings and a given ``layer_types``. The
oracle is transformers' torch path (``family_util``; rank 0 runs it, each prompt alone):
16 greedy tokens equal and logits within 1e-4 of the largest, two prompts prefilled
together in chunks of 3 tokens (each chunk continues the recurrent state) and decoded
together. Then a 300-token prompt and two others, prefilled in chunks of 100 (across the
delta rule's 64-token chunks) and decoded together, in two cache slots (the third prompt
takes the slot the first frees), give each one's tokens alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from family_util import N_NEW, cases_fixture, check_together, matches_transformers

from hpcmac.errors import UsageError
from hpcmac.testing import world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
#: case -> (seed, config.json fields); seeds whose greedy runs are not degenerate
CASES = {
    "k2v6-kv1-moe": (1, dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=5, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=10,
        shared_expert_intermediate_size=14, max_position_embeddings=256)),
    "k4v4-kv2-dense-bias-tied": (2, dict(
        vocab_size=VOCAB, hidden_size=36, intermediate_size=22, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=12, linear_num_key_heads=4,
        linear_num_value_heads=4, linear_key_head_dim=10, linear_value_head_dim=6,
        linear_conv_kernel_dim=3, num_experts=5, num_experts_per_tok=3,
        moe_intermediate_size=9, shared_expert_intermediate_size=11, mlp_only_layers=[1],
        norm_topk_prob=False, attention_bias=True, tie_word_embeddings=True,
        layer_types=["full_attention", "linear_attention", "linear_attention",
                     "full_attention"],
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5),
        max_position_embeddings=256)),
}
LONG = {"long": (1, {**CASES["k2v6-kv1-moe"][1], "max_position_embeddings": 512})}

checkpoints = cases_fixture("qwen3_next", CASES, VOCAB)
long_case = cases_fixture("qwen3_next", LONG, VOCAB, lengths=(300, 300, 41), one="long")
test_matches_transformers = matches_transformers("qwen3_next", CASES)


def test_long_prompt_chunked_then_decoded_together(long_case):
    """Three prompts (300, 300 and 41 tokens) prefilled in chunks of 100 and decoded
    together in two cache slots (the 41-token one in a slot freed by another), tensor
    parallel over all ranks: each sequence's tokens as transformers gives for it alone,
    logits within 1e-4 of the largest."""
    check_together("qwen3_next long", long_case, chunk=100, max_batch=2)


def test_snapshot_restores_a_slot(checkpoints):
    """KVCache.snapshot / restore (rank 0): decode 6 tokens after a prefix, put the prefix's
    states back, decode again: the same tokens; decoding on from zeroed states instead
    gives other logits (the states matter)."""
    from hpcmac.llm.model.stage import Batch, load_stage

    g = world()
    if g.rank == 0:
        path, prompts, ref = checkpoints["k2v6-kv1-moe"]
        st = load_stage(path, 0, 4)
        cache = st.new_cache(2, 64)
        p = prompts[0]
        x = st.forward(st.embed(p), Batch([1], [len(p)], [0]), cache)
        snap = cache.snapshot(1)
        first = int(st.logits(x[-1:]).argmax())

        def decode(n):
            out, tok = [], first
            for pos in range(len(p), len(p) + n):
                h = st.forward(st.embed([tok]), Batch([1], [1], [pos]), cache)
                tok = int(st.logits(h).argmax())
                out.append(tok)
            return out

        a = decode(6)
        assert [first, *a] == ref[0][0][:7]
        cache.restore(1, snap)
        assert decode(6) == a
        cache.restore(1, snap)
        for j in cache.recurrent:
            cache.v[j][1] = 0.0
        h = st.forward(st.embed([first]), Batch([1], [1], [len(p)]), cache)
        assert np.abs(st.logits(h)[0] - ref[0][1][1]).max() > 1e-2
        with pytest.raises(ValueError, match="cannot rewind"):
            st.forward(st.embed([first]), Batch([1], [1], [2]), cache)
        cache.free(1)  # a freed slot's states are zero again
        assert cache.lengths[1] == 0 and not any(
            np.any(cache.k[j][1]) or np.any(cache.v[j][1]) for j in cache.recurrent)
    g.barrier()


@pytest.mark.parametrize("name", ["k2v6-kv1-moe"])
def test_mlx_backend_matches_numpy(checkpoints, name):
    """The MLX backend (rank 0): the prompts together through the one-rank generator (one
    packed prefill, then batched decode) give transformers' tokens."""
    from hpcmac.llm.model.generate import Generator
    from hpcmac.llm.model.stage import load_stage

    g = world()
    if g.rank == 0:
        pytest.importorskip("mlx.core")
        path, prompts, ref = checkpoints[name]
        b = Generator(load_stage(path, 0, 4, backend="mlx"), max_len=64, max_slots=2)
        assert [r.tokens for r in b.generate_batch(prompts, N_NEW)] == [t for t, _ in ref]
    g.barrier()


def test_planner_counts_the_bytes_held(checkpoints):
    """weights.stage_nbytes (the planners' count, from headers) is what a stage holds, whole
    and as each tensor rank's part of 2 and 3 (the linear attention's several row ranges,
    a key head held twice)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import stage_nbytes

    g = world()
    if g.rank == 0:
        for name in CASES:
            path = checkpoints[name][0]
            cfg = load_config(path)
            assert stage_nbytes(path, 0, 4, True, True) == load_stage(path, 0, 4).nbytes
            for shard in make_shards(cfg, [1.0, 1.0]) + make_shards(cfg, [1.0, 1.0, 1.0]):
                part = load_stage(path, 1, 4, False, True, shard=shard, reduce=lambda a: a)
                assert stage_nbytes(path, 1, 4, False, True, shard=shard) == part.nbytes
    g.barrier()


_RAW = dict(model_type="qwen3_next", vocab_size=VOCAB, hidden_size=40, intermediate_size=24,
            num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
            linear_value_head_dim=12, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=10, shared_expert_intermediate_size=14)


@pytest.mark.parametrize("field, value, says", [
    ("hidden_act", "gelu", "field 'hidden_act'"),
    ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"], "field 'layer_types'"),
    ("linear_num_value_heads", 5, "field 'linear_num_value_heads'"),
    ("linear_key_head_dim", "8", "field 'linear_key_head_dim'"),
    # mlx-lm's folders are read (test_llm_quantized_checkpoints.py), in MLX's formats only
    ("quantization", {"bits": 7, "group_size": 64}, "7-bit quantization is not supported"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
     "rope_type 'dynamic'"),
])
def test_refused_in_one_line(field, value, says):
    from hpcmac.llm.model.arch import config_from_hf

    cfg = config_from_hf(dict(_RAW))
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.rope_dim == 4 and cfg.norm_offset == 1.0 and cfg.norm_topk_prob
    with pytest.raises(UsageError, match=says) as e:
        config_from_hf({**_RAW, field: value}, "m/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("m/config.json: ")


def test_no_experts_is_dense():
    """num_experts 0 (transformers: a dense MLP in every layer) with its default experts
    per token is a dense model, not a refusal."""
    from hpcmac.llm.model.arch import config_from_hf

    cfg = config_from_hf({**_RAW, "num_experts": 0, "num_experts_per_tok": 10})
    assert cfg.n_experts == cfg.n_shared_experts == 0
    assert not any(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
