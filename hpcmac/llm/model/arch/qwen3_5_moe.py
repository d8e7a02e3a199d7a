"""Qwen3.5-MoE (``qwen3_5_moe``), its text part: :mod:`.qwen3_5`'s layers and folder layout
with routed experts in every layer instead of the dense MLP: softmax top-k, always
renormalised, plus one shared expert (``shared_expert_intermediate_size``) scaled by
``sigmoid(shared_expert_gate x)``, as Qwen3-Next's. The text-only folder
(``qwen3_5_moe_text``) is the same family (:mod:`.qwen3_5_moe_text`).

GGUF (llama.cpp's ``qwen35moe``): :mod:`.qwen3_5`'s form, with Qwen3-Next's experts
(:func:`.qwen3_next.gguf_shared_expert_fields`).
"""

from __future__ import annotations

from hpcmac.llm.model.arch import qwen3_5, qwen3_next
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import GQA, GatedDeltaNet, Layer, MoE, softmax_topk
from hpcmac.llm.model.arch.fields import ModelConfig

_MOE = MoE(route=softmax_topk, shared="shared_expert", shared_gate=True)
_LINEAR = Layer(GatedDeltaNet(), _MOE, gguf_post_norm="post_attention_norm")
_FULL = Layer(GQA(output_gate=True), _MOE, gguf_post_norm="post_attention_norm")


def from_hf(raw: dict, where: str) -> ModelConfig:
    text, where = qwen3_5.text_config(raw, where, "qwen3_5_moe_text")
    return ModelConfig(**{**qwen3_next.hybrid_fields(text, where), "arch": raw["model_type"]},
                       **{**qwen3_next.shared_expert_fields(text, where),
                          "norm_topk_prob": True})


def from_gguf(meta) -> ModelConfig:
    return ModelConfig(**qwen3_next.hybrid_gguf_fields(meta, "qwen3_5_moe"),
                       **qwen3_next.gguf_shared_expert_fields(meta))


FAMILY = Family(
    summary=("Qwen3.5-MoE's text part: `qwen3_5`'s layers with softmax top-k experts "
             "(renormalised) plus a sigmoid-gated shared expert in every layer"),
    model_type="qwen3_5_moe", gguf_arch="qwen35moe", from_hf=from_hf, from_gguf=from_gguf,
    write_gguf_meta=qwen3_5.write_gguf_meta,
    layer=lambda cfg, i: _LINEAR if cfg.is_linear(i) else _FULL,
    hf_class="Qwen3_5MoeTextConfig", mlx_quant_tested=True,
    quant_methods=FP8, fp8_float=qwen3_5.FAMILY.fp8_float,
    tiny=dict(vocab_size=96, hidden_size=40, num_hidden_layers=4, num_attention_heads=5,
              num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
              num_experts=6, num_experts_per_tok=2, moe_intermediate_size=10,
              shared_expert_intermediate_size=14, max_position_embeddings=256))
