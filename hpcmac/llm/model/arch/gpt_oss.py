"""gpt-oss (``gpt_oss``): grouped-query attention with Q/K/V/O biases and a learned sink
logit per head, layers alternating between a ``sliding_window`` (128) and full attention
as ``layer_types`` says; every layer routed experts (4 of 32 or 128) chosen by the top-k
router logits (with a bias), softmax over those k, each expert a clamped SwiGLU with
biases (``swiglu_limit``, ``swiglu_alpha``) stored gate/up interleaved; YaRN rope.

Float checkpoints, and the MXFP4 experts as published (``*_blocks`` / ``*_scales``,
``quant_method: mxfp4``), kept 4-bit (:mod:`~hpcmac.llm.model.mxfp4`; a tensor-parallel
cut of the experts' columns off their groups of 32 dequantizes ``down_proj``); any
other quantization is refused in one line. The sliding layers' cache keeps every token
and masks by the window.

GGUF (llama.cpp's ``gpt-oss``, e.g. ggml-org's gpt-oss-20b/120b files): the experts split
into ``ffn_gate_exps`` / ``ffn_up_exps`` (or one ``ffn_gate_up_exps``: gate's rows, then
up's) and ``ffn_down_exps``, each expert (out, in), with their ``.bias``; the router
``ffn_gate_inp`` (+ bias); the sinks ``attn_sinks.weight``; the second norm
``post_attention_norm``. MXFP4 experts (GGUF type 39) are kept 4-bit, put back together as
the safetensors MXFP4 experts are (``GGUFCheckpoint.get_weight_t``).
What the metadata does not hold is llama.cpp's: sliding layers first, then alternating
(the sliding width is ``attention.sliding_window``); SwiGLU limit 7 and gain 1.702; YaRN's
``beta_fast`` 32 and ``beta_slow`` 1 unless ``rope.scaling.yarn_beta_*`` say otherwise, and
transformers' ``truncate: false`` for gpt-oss.
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch.base import Family
from hpcmac.llm.model.arch.blocks import GQA, InterleavedMoE, Layer
from hpcmac.llm.model.arch.fields import (
    ModelConfig,
    gguf_fields,
    gguf_moe_fields,
    hf_fields,
    hf_moe_fields,
    json_float,
    json_int,
)
from hpcmac.llm.model.rope import ROPE_TYPES

_SLIDING = Layer(GQA(sinks=True, sliding=True), InterleavedMoE(),
                 gguf_post_norm="post_attention_norm")
_FULL = Layer(GQA(sinks=True), InterleavedMoE(), gguf_post_norm="post_attention_norm")
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
        types = _alternating(n)
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


def _alternating(n: int) -> list[str]:
    """Sliding first, then alternating: transformers' default and llama.cpp's fixed pattern."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def from_gguf(meta) -> ModelConfig:
    f = gguf_fields(meta, "gpt_oss")
    rope = f["rope_scaling"]
    if rope.get("rope_type") == "yarn":
        rope.update(beta_fast=float(meta.meta("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(meta.meta("rope.scaling.yarn_beta_slow", 1.0)),
                    truncate=False)
    moe = gguf_moe_fields(meta)
    window = int(meta.need("attention.sliding_window"))
    return ModelConfig(**{**f, "norm_eps": float(meta.meta("attention.layer_norm_rms_epsilon",
                                                           1e-5))},
                       **moe, sliding_window=window, layer_types=_alternating(f["n_layers"]),
                       swiglu_limit=7.0, swiglu_alpha=1.702)


def write_gguf_meta(w, cfg: ModelConfig) -> None:
    """What llama.cpp's converter writes for gpt-oss beyond the common keys: the sliding
    width and YaRN. A model whose layers do not alternate as llama.cpp assumes, or whose
    SwiGLU differs from its constants, has no GGUF form (refused)."""
    import gguf

    if cfg.layer_types != _alternating(cfg.n_layers) or cfg.swiglu_limit != 7.0 or \
            cfg.swiglu_alpha != 1.702:
        raise UsageError("gpt-oss GGUF: llama.cpp's form needs alternating layer_types "
                         "(sliding first), swiglu_limit 7 and alpha 1.702")
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_sliding_window(cfg.sliding_window)
    p = cfg.rope_scaling
    if p.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(p["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(p["original_max_position_embeddings"]))


FAMILY = Family(
    mlx_quant_tested=True,
    summary=("attention sinks, alternating sliding-window and full layers, top-k-then-softmax "
             "router with a bias, clamped SwiGLU experts with biases, YaRN"),
    model_type="gpt_oss", gguf_arch="gpt-oss", from_hf=from_hf, from_gguf=from_gguf,
    write_gguf_meta=write_gguf_meta,
    layer=lambda cfg, i: _SLIDING if cfg.is_sliding(i) else _FULL, hf_class="GptOssConfig",
    quant_methods={"mxfp4": "the published MXFP4 experts, kept 4-bit"},
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=21, num_hidden_layers=2,
              num_attention_heads=5, num_key_value_heads=1, head_dim=12,
              num_local_experts=6, num_experts_per_tok=4, sliding_window=8,
              max_position_embeddings=256))
