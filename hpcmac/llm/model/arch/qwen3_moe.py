"""Qwen3-MoE: Qwen3's attention; routed experts by softmax top-k (optionally renormalised)
every ``decoder_sparse_step``-th layer except ``mlp_only_layers``, which are dense."""

from __future__ import annotations

from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, Layer, MoE, softmax_topk
from hpcmac.llm.model.arch.fields import (
    ModelConfig,
    gguf_fields,
    gguf_moe_fields,
    hf_fields,
    hf_moe_fields,
    json_int,
)

_DENSE = Layer(GQA(), MLP())
_SPARSE = Layer(GQA(), MoE(route=softmax_topk))


def from_hf(raw: dict, where: str) -> ModelConfig:
    return ModelConfig(**hf_fields(raw, where), **hf_moe_fields(raw, where), qk_norm=True,
                       decoder_sparse_step=json_int(raw, "decoder_sparse_step", where, 0) or 1,
                       mlp_only_layers=[json_int({"mlp_only_layers": i}, "mlp_only_layers", where)
                                        for i in raw.get("mlp_only_layers") or []])


def from_gguf(meta) -> ModelConfig:
    # Qwen3-MoE checkpoints all normalise
    return ModelConfig(**gguf_fields(meta, "qwen3_moe"), **gguf_moe_fields(meta),
                       norm_topk_prob=True)


FAMILY = Family(
    quant_methods=FP8,
    mlx_quant_tested=True,
    summary=("Q/K RMSNorm; softmax top-k experts, optional renormalisation, `decoder_sparse_step`,"
             " `mlp_only_layers`"),
    model_type="qwen3_moe", gguf_arch="qwen3moe", from_hf=from_hf, from_gguf=from_gguf,
    layer=lambda cfg, i: _SPARSE if cfg.is_moe_layer(i) else _DENSE, hf_class="Qwen3MoeConfig",
    tiny=dict(vocab_size=96, hidden_size=48, intermediate_size=72, moe_intermediate_size=24,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
              num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
              max_position_embeddings=256))
