"""Kimi K2.5 (``kimi_k25``), its text part: the language model is DeepSeek-V3's (multi-head
latent attention; sigmoid routing with correction bias, groups and scaling; shared experts;
dense first layers), described by the nested ``text_config`` (``model_type``
``deepseek_v3`` or ``kimi_k2``) and stored under ``language_model.`` (the loader reads it
by its canonical names). The vision tower and projector are not loaded: prompts are text.

``tie_word_embeddings`` is the top level's when given, else the text model's. Refused in
one line naming the field: a ``text_config`` that is not an object or of another
``model_type``. The checkpoints as released are INT4 (compressed-tensors pack-quantized
experts), kept 4-bit by the loader, as are float checkpoints of the architecture. Their
tiktoken-style tokenizer is read by :mod:`hpcmac.llm.model.tokenizer`. No GGUF form yet.
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch import deepseek_v3
from hpcmac.llm.model.arch.base import INT4, Family
from hpcmac.llm.model.arch.fields import ModelConfig

_TEXT_TYPES = ("deepseek_v3", "kimi_k2")


def from_hf(raw: dict, where: str) -> ModelConfig:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UsageError(f"{where}: field 'text_config' = {text!r}: expected an object "
                         "(the language model's configuration)")
    kind = text.get("model_type", "deepseek_v3")
    if kind not in _TEXT_TYPES:
        raise UsageError(f"{where}: field 'text_config.model_type' = {kind!r} is not "
                         f"supported; expected one of {', '.join(_TEXT_TYPES)}")
    cfg = deepseek_v3.from_hf({**text, "model_type": "kimi_k25"}, f"{where} (text_config)")
    if raw.get("tie_word_embeddings") is not None:
        cfg.tie_embeddings = bool(raw["tie_word_embeddings"])
    if cfg.bos_token_id is None and isinstance(raw.get("bos_token_id"), int):
        cfg.bos_token_id = raw["bos_token_id"]
    if not cfg.eos_token_ids and raw.get("eos_token_id") is not None:
        eos = raw["eos_token_id"]
        cfg.eos_token_ids = [e for e in (eos if isinstance(eos, list) else [eos])
                             if isinstance(e, int) and not isinstance(e, bool)]
    return cfg


FAMILY = Family(
    quant_methods=INT4,
    summary=("Kimi K2.5's text part: DeepSeek-V3's layers from the nested `text_config`, tensors "
             "under `language_model.` (vision tower not loaded); tiktoken-style tokenizer"),
    model_type="kimi_k25", gguf_arch=None, from_hf=from_hf, from_gguf=None,
    layer=deepseek_v3.FAMILY.layer, hf_class="Kimi_K25Config")
