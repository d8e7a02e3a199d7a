"""Llama (SmolLM2, Llama 3): grouped-query attention, optional biases, SwiGLU MLP.

GGUF ``llama`` files hold Q/K rows permuted for llama.cpp's rotary layout.
"""

from __future__ import annotations

from hpcmac.llm.model.arch.base import Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, Layer
from hpcmac.llm.model.arch.fields import ModelConfig, gguf_fields, hf_fields

_LAYER = Layer(GQA(), MLP())


def from_hf(raw: dict, where: str) -> ModelConfig:
    return ModelConfig(**hf_fields(raw, where))


def from_gguf(meta) -> ModelConfig:
    return ModelConfig(**gguf_fields(meta, "llama"))


FAMILY = Family(
    mlx_quant_tested=True,
    summary="grouped-query attention, optional biases, SwiGLU MLP (SmolLM2, Llama 3)",
    model_type="llama", gguf_arch="llama", from_hf=from_hf, from_gguf=from_gguf,
    layer=lambda cfg, i: _LAYER, hf_class="LlamaConfig", gguf_qk_permuted=True,
    tiny=dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256))
