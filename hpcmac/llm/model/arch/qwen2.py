"""Qwen2 (and Qwen2.5): grouped-query attention with Q/K/V biases (always), none on the output."""

from __future__ import annotations

from hpcmac.llm.model.arch.base import Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, Layer
from hpcmac.llm.model.arch.fields import ModelConfig, gguf_fields, hf_fields

_LAYER = Layer(GQA(), MLP())


def from_hf(raw: dict, where: str) -> ModelConfig:
    return ModelConfig(**{**hf_fields(raw, where), "attention_bias": True, "o_bias": False})


def from_gguf(meta) -> ModelConfig:
    return ModelConfig(**gguf_fields(meta, "qwen2"))


FAMILY = Family(
    mlx_quant_tested=True,
    summary="Llama's layers with Q/K/V biases",
    model_type="qwen2", gguf_arch="qwen2", from_hf=from_hf, from_gguf=from_gguf,
    layer=lambda cfg, i: _LAYER, hf_class="Qwen2Config",
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=72, num_hidden_layers=3,
              num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=256))
