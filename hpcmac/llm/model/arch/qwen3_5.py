"""Qwen3.5 (``qwen3_5``), its text part: Qwen3-Next's hybrid layers (:mod:`.qwen3_next`:
Gated DeltaNet on three of four layers, gated full attention with a rotary quarter of each
head, ``1 + w`` RMSNorms) with the linear attention's projections unfused
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and a dense SwiGLU MLP in
every layer. The folder is laid out as released: the language model described by the
nested ``text_config`` (``model_type`` ``qwen3_5_text``; the top level's
``tie_word_embeddings`` wins when given) and stored under ``model.language_model.``; the
vision tower (``model.visual.``) and the multi-token-prediction weights (``mtp.``) are not
loaded. A folder of the text model alone (``qwen3_5_text``, as transformers'
``Qwen3_5ForCausalLM`` saves it) is the same family (:mod:`.qwen3_5_text`).

Rotary is multimodal (``mrope_section``, interleaved) but a text prompt's three position
components are all its token position, so every section rotates alike: the rope of one
position, on the first ``partial_rotary_factor`` of each head. Refused in one line naming
the field: a ``text_config`` that is not an object or of another ``model_type``, and what
:func:`.qwen3_next.hybrid_fields` refuses.

GGUF (llama.cpp's ``qwen35``): read as Qwen3-Next's (:func:`.qwen3_next.hybrid_gguf_fields`),
with the linear attention unfused and its value heads in llama.cpp's tiled order
(``attn_qkv``'s v rows, ``attn_gate``, ``ssm_beta``, ``ssm_alpha``, ``ssm_a``, ``ssm_dt``,
the conv's v channels and ``ssm_out``'s columns: key head ``kh``'s ``r``-th value head at
``r * nk + kh``), put back in Hugging Face's grouped order (:mod:`.blocks`);
``rope.dimension_sections`` (mrope) read with text positions, as above.
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch import qwen3_next
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, GatedDeltaNet, Layer
from hpcmac.llm.model.arch.fields import ModelConfig

_LINEAR = Layer(GatedDeltaNet(), MLP(), gguf_post_norm="post_attention_norm")
_FULL = Layer(GQA(output_gate=True), MLP(), gguf_post_norm="post_attention_norm")
#: transformers' Qwen3.5 mrope_section (of 32 rotated pairs), which llama.cpp's converter
#: writes when the config has none (for text they do not matter: every component is the
#: token position; llama.cpp needs them to sum to at most the rotated pairs)
MROPE_SECTIONS = (11, 11, 10)


def text_config(raw: dict, where: str, text_type: str) -> tuple[dict, str]:
    """(the text model's config.json fields, where they are) of a released folder (its
    ``text_config``, the top level's ``tie_word_embeddings``, BOS and EOS filled in), or of
    a text-only one (``model_type`` ``text_type``: itself)."""
    if raw.get("model_type") == text_type:
        return raw, where
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UsageError(f"{where}: field 'text_config' = {text!r}: expected an object "
                         "(the language model's configuration)")
    kind = text.get("model_type", text_type)
    if kind != text_type:
        raise UsageError(f"{where}: field 'text_config.model_type' = {kind!r} is not "
                         f"supported; expected {text_type!r}")
    text = dict(text)
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "quantization"):
        if raw.get(key) is not None and (key == "tie_word_embeddings" or text.get(key) is None):
            text[key] = raw[key]
    return text, f"{where} (text_config)"


def from_hf(raw: dict, where: str) -> ModelConfig:
    text, where = text_config(raw, where, "qwen3_5_text")
    return ModelConfig(**{**qwen3_next.hybrid_fields(text, where), "arch": raw["model_type"]})


def from_gguf(meta) -> ModelConfig:
    return ModelConfig(**qwen3_next.hybrid_gguf_fields(meta, "qwen3_5"))


def write_gguf_meta(w, cfg: ModelConfig) -> None:
    """The hybrid layers' metadata and the mrope sections, as llama.cpp's converter writes
    them."""
    qwen3_next.write_hybrid_gguf_meta(w, cfg)
    sections = cfg.rope_scaling.get("mrope_section")
    if not sections:  # transformers' proportions over this model's rotated pairs
        pairs = cfg.rope_dim // 2
        a = round(pairs * MROPE_SECTIONS[0] / sum(MROPE_SECTIONS))
        sections = [a, a, pairs - 2 * a]
    w.add_rope_dimension_sections((list(sections) + [0] * 4)[:4])


FAMILY = Family(
    mlx_quant_tested=True,
    summary=("Qwen3.5's text part: Qwen3-Next's hybrid Gated DeltaNet / gated-attention "
             "layers, unfused linear-attention projections, dense MLPs; mrope read with "
             "text positions; nested `text_config`, tensors under `model.language_model.`"),
    model_type="qwen3_5", gguf_arch="qwen35", from_hf=from_hf, from_gguf=from_gguf,
    write_gguf_meta=write_gguf_meta,
    layer=lambda cfg, i: _LINEAR if cfg.is_linear(i) else _FULL,
    hf_class="Qwen3_5TextConfig",
    # Qwen3.5-*-FP8: every projection e4m3 but in_proj_a and in_proj_b (and the routers)
    quant_methods=FP8, fp8_float=("linear_attn.in_proj_a", "linear_attn.in_proj_b"),
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=24, num_hidden_layers=4,
              num_attention_heads=5, num_key_value_heads=1, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
              linear_value_head_dim=12, max_position_embeddings=256))
