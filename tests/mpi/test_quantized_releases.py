"""Releases kept in their precision, against transformers at any rank count: DeepSeek V3's,
DeepSeek V3.2's, MiniMax M2's, Qwen3-Next's and Qwen3.5's layers as their FP8 checkpoints
store them (``fixtures.fp8_checkpoint``: every linear projection but the family's
``fp8_float`` ones e4m3 with a float32 ``weight_scale_inv`` per 128 x 128 block,
``amax / 448`` by torch's float8_e4m3fn; DeepSeek's own quantization_config), and Kimi K2
Thinking's INT4 (``fixtures.int4_checkpoint``: the routed experts compressed-tensors
pack-quantized, symmetric 4-bit with a bfloat16 scale per 32, read as MLX affine).

The oracle is transformers on the dequantized float32 model (the same weights: FP8 codes
times block scales in float32, what the releases' own dequantization gives; INT4 codes
times their scale, exact): 16 greedy
tokens equal and logits within 1e-4 of the largest, at np 1 (whole model), tensor N
and pipeline N (``family_util``). The kernels' own bound per product (``2 gamma_n sum
|w||x|`` from float32 BLAS) is tests/unit/test_llm_float_formats.py's. Shapes have sizes
of 128s where blocks matter, a partial last block of rows (kv_a: 128 + 16) and cuts off
the blocks under tensor 2 (DeepSeek's dense MLP of 384 columns, o_proj's 2 heads of 32
inputs a rank), which the loader dequantizes and the planner counts as float32.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest
from family_util import N_NEW, check_case, write_cases

from hpcmac.errors import UsageError
from hpcmac.testing import world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
#: case -> (model_type, format, seed, config.json fields)
CASES = {
    "deepseek_v3": ("deepseek_v3", "fp8", 3, dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, n_shared_experts=1, max_position_embeddings=256)),
    "minimax_m2": ("minimax_m2", "fp8", 4, dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))),
    # the linear-attention releases (Qwen3-Next-80B-A3B-*-FP8, Qwen3.5-*-FP8): the Gated
    # DeltaNet's fused in_proj_qkvz (rows of several ranges a rank under tensor 2) and
    # out_proj e4m3, in_proj_ba (Qwen3.5: in_proj_a, in_proj_b) float as released
    "qwen3_next": ("qwen3_next", "fp8", 6, dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, max_position_embeddings=256)),
    "qwen3_5": ("qwen3_5_text", "fp8", 7, dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        max_position_embeddings=256)),
    # DeepSeek-V3.2: V3's projections and the indexer's wq_b and wk e4m3, its weights_proj
    # float, as released. 8 index heads: with 4, a key scores exactly 0 whenever all four
    # relus are 0 (1 in 16), and a top-k boundary on such a tie is broken one way by
    # torch.topk and another by argpartition (both right; seen at position 16 here)
    "deepseek_v32": ("deepseek_v32", "fp8", 8, dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, n_shared_experts=1, index_n_heads=8,
        index_head_dim=32, index_topk=4, max_position_embeddings=256)),
    # K2 Thinking: experts INT4 in groups of 32 (tensor 2 cuts their 64 columns at 32)
    "kimi_k2": ("kimi_k2", "int4", 5, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=5,
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=12, v_head_dim=10, n_shared_experts=1, max_position_embeddings=256)),
}
#: what the stage says it kept, per format
KEPT = {"fp8": {"fp8 e4m3 b128"}, "int4": {"compressed-tensors int4 g32"}}


def build(name, path, seed, fields):
    """A random float model quantized as the case's release is; transformers runs the
    dequantized copy (``path + "-float"``; Kimi K2 as DeepSeek-V3, its architecture)."""
    import json

    import torch
    import transformers

    from hpcmac.llm.model.fixtures import fp8_checkpoint, int4_checkpoint, random_checkpoint

    model_type, fmt = CASES[name][:2]
    arch = "deepseek_v3" if model_type == "kimi_k2" else model_type
    random_checkpoint(arch, path + "-src", seed=seed, initializer_range=0.1, **fields)
    (fp8_checkpoint if fmt == "fp8" else int4_checkpoint)(path + "-src", path, path + "-float")
    cfg = Path(path) / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "model_type": model_type}))
    return transformers.AutoModelForCausalLM.from_pretrained(
        path + "-float", dtype=torch.float32, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def checkpoints():
    out = {}
    from contextlib import ExitStack

    with ExitStack() as stack:
        for name, (_, _, seed, fields) in CASES.items():
            out.update(stack.enter_context(write_cases(name, {name: (seed, fields)}, VOCAB,
                                                       build=build)))
        yield out


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(checkpoints, name):
    if world().size > 2 and name != "deepseek_v3":  # the suite's budget: one case there
        pytest.skip("at 4 ranks the DeepSeek case covers the layouts")
    check_case(f"{CASES[name][1]} {name}", checkpoints[name])


def test_kept_as_stored_and_counted(checkpoints):
    """Every quantized tensor is held as stored (numpy and MLX), the planner's count
    (weights.stage_nbytes) is the numpy stage's bytes, whole and as tensor rank 1 of 2,
    and the stage holds at most 1.1x the file beyond MLA's absorbed kv_b (kept float32 by
    design: 3 more bytes a weight). MLX gives numpy's tokens (rank 0)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.fixtures import stage_greedy
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import open_checkpoint, stage_nbytes

    g = world()
    if g.rank == 0:
        for name in CASES:
            path, prompts, ref = checkpoints[name]
            cfg = load_config(path)
            n = cfg.n_layers
            st = load_stage(path, 0, n)
            assert set(st.formats) == KEPT[CASES[name][1]]
            assert stage_nbytes(path, 0, n, True, True) == st.nbytes
            # tensor rank 1 of 2, even and 2:1 (171 + 85 expert columns: off the blocks,
            # so its experts' down_proj is dequantized, and counted so)
            for shares in ([1.0, 1.0], [2.0, 1.0]):
                shard = make_shards(cfg, shares)[1]
                part = load_stage(path, 1, n, False, True, shard=shard, reduce=lambda a: a)
                assert stage_nbytes(path, 1, n, False, True, shard=shard) == part.nbytes
            ck = open_checkpoint(path)
            kv_b = sum(ck.numel(t) for t in ck.names() if t.endswith("kv_b_proj.weight"))
            file = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
            backends = ("numpy", "mlx") if find_spec("mlx") else ("numpy",)
            for backend in backends:
                s = st if backend == "numpy" else load_stage(path, 0, n, backend=backend)
                assert s.nbytes <= 1.1 * file + 3 * kv_b, (name, backend, s.nbytes, file)
                if backend == "mlx":
                    assert stage_greedy(s, prompts[0], N_NEW) == ref[0][0]
            floats = load_stage(path, 0, n, keep_quantized=False)
            assert st.nbytes < (0.4 if CASES[name][1] == "fp8" else 0.7) * floats.nbytes
    g.barrier()


def _int4(**weights):
    from hpcmac.llm.model.fixtures import int4_config

    q = int4_config()
    q["config_groups"]["group_0"]["weights"].update(weights)
    return q


@pytest.mark.parametrize("model_type, q, says", [
    ("deepseek_v3", dict(quant_method="fp8", fmt="e5m2", weight_block_size=[128, 128]),
     "fmt 'e5m2'"),
    ("deepseek_v3", dict(quant_method="fp8", fmt="e4m3"), "weight_block_size None"),
    ("deepseek_v3", dict(quant_method="fp8", weight_block_size=[128, 64]),
     "weight_block_size \\[128, 64\\]"),
    ("kimi_k2", _int4(symmetric=False), "weights.symmetric False is not supported"),
    ("kimi_k2", _int4(num_bits=2), "num_bits 2, group_size 32"),
    ("kimi_k2", {**_int4(), "format": "int-quantized"}, "format 'int-quantized'"),
    ("deepseek_v3", _int4(), "quant_method 'compressed-tensors' is not supported for "
                             "deepseek_v3"),
])
def test_refused_in_one_line(model_type, q, says):
    from hpcmac.llm.model.arch import config_from_hf

    raw = dict(CASES["deepseek_v3"][3], model_type=model_type, quantization_config=q)
    with pytest.raises(UsageError, match=says) as e:
        config_from_hf(raw, "m/config.json")
    assert str(e.value).startswith("m/config.json: quantization_config") and \
        "\n" not in str(e.value)
