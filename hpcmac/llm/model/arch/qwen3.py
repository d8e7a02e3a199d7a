"""Qwen3 (dense): grouped-query attention with RMSNorm on each head of Q and K."""

from __future__ import annotations

from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, Layer
from hpcmac.llm.model.arch.fields import ModelConfig, gguf_fields, hf_fields

_LAYER = Layer(GQA(), MLP())


def from_hf(raw: dict, where: str) -> ModelConfig:
    return ModelConfig(**{**hf_fields(raw, where), "qk_norm": True})


def from_gguf(meta) -> ModelConfig:
    return ModelConfig(**gguf_fields(meta, "qwen3"))


FAMILY = Family(
    quant_methods=FP8,
    mlx_quant_tested=True,
    summary="Llama's layers with Q/K RMSNorm",
    model_type="qwen3", gguf_arch="qwen3", from_hf=from_hf, from_gguf=from_gguf,
    layer=lambda cfg, i: _LAYER, hf_class="Qwen3Config",
    tiny=dict(vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
              num_attention_heads=3, num_key_value_heads=3, head_dim=16,
              max_position_embeddings=256))
