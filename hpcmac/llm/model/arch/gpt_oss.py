"""gpt-oss (``gpt_oss``): grouped-query attention with Q/K/V/O biases and a learned sink
logit per head, layers alternating between a ``sliding_window`` (128) and full attention
as ``layer_types`` says; every layer routed experts (4 of 32 or 128) chosen by the top-k
router logits (with a bias), softmax over those k, each expert a clamped SwiGLU with
biases (``swiglu_limit``, ``swiglu_alpha``) stored gate/up interleaved; YaRN rope.

Float checkpoints, and the MXFP4 experts as published (``*_blocks`` / ``*_scales``,
``quant_method: mxfp4``), kept 4-bit (:mod:`~hpcmac.llm.model.mxfp4`; a tensor-parallel
cut of the experts' columns off their groups of 32 dequantizes ``down_proj``); any
other quantization is refused in one line. The sliding layers' cache keeps every token
and masks by the window. No GGUF form yet.
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch.base import Family
from hpcmac.llm.model.arch.blocks import GQA, InterleavedMoE, Layer
from hpcmac.llm.model.arch.fields import (
    ModelConfig,
    hf_fields,
    hf_moe_fields,
    json_float,
    json_int,
)
from hpcmac.llm.model.rope import ROPE_TYPES

_SLIDING = Layer(GQA(sinks=True, sliding=True), InterleavedMoE())
_FULL = Layer(GQA(sinks=True), InterleavedMoE())
_KINDS = ("sliding_attention", "full_attention")
#: transformers' GptOssConfig defaults when config.json names no rope
_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096)


def from_hf(raw: dict, where: str) -> ModelConfig:
    base = hf_fields(raw, where)
    if not raw.get("rope_parameters") and not raw.get("rope_scaling"):
        base["rope_scaling"] = dict(_ROPE)
    if raw.get("rope_theta") is None and (raw.get("rope_parameters") or {}).get(
            "rope_theta") is None:
        base["rope_theta"] = 150000.0
    kind = base["rope_scaling"].get("rope_type")
    if kind not in ROPE_TYPES:
        raise UsageError(f"{where}: rope_type {kind!r} is not supported; expected one of "
                         f"{', '.join(ROPE_TYPES)}")
    n = base["n_layers"]
    types = raw.get("layer_types")
    if types is None:  # transformers' default: sliding first, then alternating
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _KINDS for t in types):
        raise UsageError(f"{where}: field 'layer_types': expected a list of {n} entries, each "
                         f"{' or '.join(map(repr, _KINDS))}, found {types!r}")
    bias = bool(raw.get("attention_bias", True))
    moe = hf_moe_fields(raw, where)
    I = json_int(raw, "intermediate_size", where)
    return ModelConfig(
        **{**base, "attention_bias": bias, "o_bias": bias,
           "norm_eps": json_float(raw, "rms_norm_eps", where, 1e-5)},
        **{**moe, "n_experts_per_tok": json_int(raw, "num_experts_per_tok", where,
                                                json_int(raw, "experts_per_token", where, 4)),
           "moe_intermediate": I},
        sliding_window=json_int(raw, "sliding_window", where, 0),
        layer_types=list(types),
        swiglu_limit=json_float(raw, "swiglu_limit", where, 7.0),
        swiglu_alpha=json_float(raw, "swiglu_alpha", where, 1.702))


FAMILY = Family(
    summary=("attention sinks, alternating sliding-window and full layers, top-k-then-softmax "
             "router with a bias, clamped SwiGLU experts with biases, YaRN"),
    model_type="gpt_oss", gguf_arch=None, from_hf=from_hf, from_gguf=None,
    layer=lambda cfg, i: _SLIDING if cfg.is_sliding(i) else _FULL, hf_class="GptOssConfig",
    quant_methods={"mxfp4": "the published MXFP4 experts, kept 4-bit"},
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=21, num_hidden_layers=2,
              num_attention_heads=5, num_key_value_heads=1, head_dim=12,
              num_local_experts=6, num_experts_per_tok=4, sliding_window=8,
              max_position_embeddings=256))
