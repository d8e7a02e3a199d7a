"""GLM-4.5 / GLM-4.6 / GLM-4.7 (``glm4_moe``): grouped-query attention with Q/K/V biases
(``attention_bias``; none on the output), optional per-head Q/K RMSNorm (``use_qk_norm``)
and rotary on part of each head
(``partial_rotary_factor``, 0.5 unless set); the first ``first_k_dense_replace`` layers
dense, then routed experts chosen as DeepSeek-V3 does (sigmoid scores, correction bias,
group-limited top-k, ``routed_scaling_factor``) plus shared experts.

The multi-token-prediction layers (``num_nextn_predict_layers``) are not run: decoding
uses the ``num_hidden_layers`` layers, as transformers does.

GGUF (llama.cpp's ``glm4moe``): ``block_count`` counts the MTP layers too
(``nextn_predict_layers``, the last ones: not run); the rotary share is
``rope.dimension_count`` over the head size; the routing from ``expert_*`` as DeepSeek's
(sigmoid gating only; ``exp_probs_b.bias`` the correction bias); the second norm
``post_attention_norm``.
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, Layer, MoE, sigmoid_grouped
from hpcmac.llm.model.arch.fields import (
    ModelConfig,
    gguf_fields,
    gguf_moe_fields,
    hf_fields,
    hf_moe_fields,
    json_float,
    json_int,
)

_DENSE = Layer(GQA(), MLP(), gguf_post_norm="post_attention_norm")
_SPARSE = Layer(GQA(), MoE(route=sigmoid_grouped, correction_bias=True),
                gguf_post_norm="post_attention_norm")
#: GGUF expert_gating_func: llama.cpp's sigmoid
_SIGMOID = 2


def from_hf(raw: dict, where: str) -> ModelConfig:
    params = raw.get("rope_parameters") or {}
    partial = json_float(params, "partial_rotary_factor", where,
                         json_float(raw, "partial_rotary_factor", where, 0.5))
    cfg = ModelConfig(
        **{**hf_fields(raw, where), "o_bias": False}, **hf_moe_fields(raw, where),
        qk_norm=bool(raw.get("use_qk_norm", False)),
        partial_rotary_factor=partial,
        n_shared_experts=json_int(raw, "n_shared_experts", where, 0),
        first_k_dense=json_int(raw, "first_k_dense_replace", where, 0),
        n_group=json_int(raw, "n_group", where, 0) or 1,
        topk_group=json_int(raw, "topk_group", where, 0) or 1,
        routed_scaling_factor=json_float(raw, "routed_scaling_factor", where, 1.0))
    if cfg.n_experts % cfg.n_group:
        raise UsageError(f"{where}: n_routed_experts {cfg.n_experts} is not a multiple "
                         f"of n_group {cfg.n_group}")
    return cfg


def from_gguf(meta) -> ModelConfig:
    f = gguf_fields(meta, "glm4_moe")
    f["n_layers"] -= int(meta.meta("nextn_predict_layers", 0) or 0)  # the MTP layers
    gating = meta.meta("expert_gating_func")
    if gating is not None and int(gating) != _SIGMOID:
        raise UsageError(f"{meta.where}: metadata glm4moe.expert_gating_func = {gating}: "
                         f"expected {_SIGMOID} (sigmoid)")
    rope_dim = int(meta.meta("rope.dimension_count", f["head_dim"]))
    cfg = ModelConfig(
        **f, **gguf_moe_fields(meta),
        partial_rotary_factor=rope_dim / f["head_dim"],
        n_shared_experts=int(meta.meta("expert_shared_count", 0) or 0),
        first_k_dense=int(meta.meta("leading_dense_block_count", 0) or 0),
        routed_scaling_factor=float(meta.meta("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(meta.meta("expert_weights_norm", False)),
        n_group=int(meta.meta("expert_group_count", 1) or 1),
        topk_group=int(meta.meta("expert_group_used_count", 1) or 1))
    if cfg.rope_dim != rope_dim:
        raise UsageError(f"{meta.where}: metadata glm4moe.rope.dimension_count = {rope_dim}: "
                         f"expected an even number up to the head size {f['head_dim']}")
    if cfg.n_experts % cfg.n_group:
        raise UsageError(f"{meta.where}: metadata glm4moe.expert_count {cfg.n_experts} is "
                         f"not a multiple of expert_group_count {cfg.n_group}")
    return cfg


def write_gguf_meta(w, cfg: ModelConfig) -> None:
    """The routing metadata, as llama.cpp's converter writes it (the groups only when
    there are several: its GLM-4.x releases have one)."""
    import gguf

    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if cfg.n_group > 1:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)


FAMILY = Family(
    mlx_quant_tested=True,
    quant_methods=FP8,
    summary=("GLM-4.5 to 4.7: partial rotary, optional QK-norm, DeepSeek's routing, shared "
             "experts, dense first layers"),
    model_type="glm4_moe", gguf_arch="glm4moe", from_hf=from_hf, from_gguf=from_gguf,
    write_gguf_meta=write_gguf_meta,
    layer=lambda cfg, i: _SPARSE if cfg.is_moe_layer(i) else _DENSE, hf_class="Glm4MoeConfig",
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=72, moe_intermediate_size=20,
              num_hidden_layers=3, num_attention_heads=5, num_key_value_heads=1, head_dim=12,
              n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
              first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5,
              attention_bias=True, use_qk_norm=True, max_position_embeddings=256))
