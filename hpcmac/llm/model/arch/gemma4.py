"""Gemma 4 (``gemma4``), its text model: sliding-window layers and full-attention layers
as ``layer_types`` says (by default five sliding to one full, the last layer full), each a
sandwich (:class:`~.blocks.SandwichLayer`: the attention's and the MLP's inputs and outputs
RMS-normalised, the layer's output times its ``layer_scalar``); a GeGLU MLP
(``gelu_pytorch_tanh``); the embedding times ``sqrt(hidden_size)``; the logits soft-capped
(``final_logit_softcapping``: ``cap * tanh(logits / cap)``); a tied head by default.

Attention: RMSNorm on each head of Q and K (weights as stored: Gemma 4's norms are ``w``,
not Gemma 3's ``1 + w``) and on each head of V (no weight), logits unscaled
(``attention_scale`` 1). The full-attention layers have their own head size and KV heads
(``global_head_dim``, ``num_global_key_value_heads``, or as transformers 5 saves them,
``per_layer_config``), kept as :attr:`~.fields.ModelConfig.by_layer_type`; with
``attention_k_eq_v`` they have no ``v_proj`` (V is K's projection, normalised apart). Rotary
per layer type (``rope_parameters.sliding_attention`` / ``.full_attention``): the sliding
layers' default rope (theta 1e4), the full layers' ``proportional`` rope (theta 1e6, a
quarter of each half-head's pairs rotated at the whole head's frequencies, the rest not).

The folder as released (``model_type`` ``gemma4``: the text model described by the nested
``text_config`` and stored under ``model.language_model.``; the vision and audio towers not
loaded), or the text model alone (``gemma4_text``, as transformers' ``Gemma4ForCausalLM``
saves it: :mod:`.gemma4_text`). Refused in one line naming the field: per-layer input
embeddings (``hidden_size_per_layer_input`` > 0: Gemma 4 E2B / E4B), KV shared across layers
(``num_kv_shared_layers``), bidirectional attention over all tokens, another activation or
rope type.

The MoE block (``enable_moe_block``: 26B-A4B): in every layer ``num_experts`` routed
experts (``top_k_experts`` a token, ``moe_intermediate_size`` wide, GeGLU) beside the dense
MLP, chosen from the layer's residual by a router that RMS-normalises it, scales it by
``router.scale / sqrt(hidden)``, and weights each chosen expert (softmax, top-k,
renormalised) by its ``per_expert_scale`` (:class:`~.blocks.ResidualRoutedExperts`).

Float checkpoints only; no GGUF form yet.
"""

from __future__ import annotations

import math

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch import qwen3_5
from hpcmac.llm.model.arch.base import Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, ResidualRoutedExperts, SandwichLayer
from hpcmac.llm.model.arch.fields import ModelConfig, hf_fields, json_float, json_int

_SLIDING = SandwichLayer(GQA(sliding=True), MLP(), scalar=True)
_FULL = SandwichLayer(GQA(), MLP(), scalar=True)
_SLIDING_MOE = SandwichLayer(GQA(sliding=True), MLP(), True, ResidualRoutedExperts())
_FULL_MOE = SandwichLayer(GQA(), MLP(), True, ResidualRoutedExperts())
_KINDS = ("sliding_attention", "full_attention")
#: transformers' Gemma4TextConfig rope when config.json names none
_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                            "rope_theta": 1_000_000.0}}


def _refuse_unless(ok: bool, where: str, field: str, value, expected: str) -> None:
    if not ok:
        raise UsageError(f"{where}: field {field!r} = {value!r} is not supported; expected "
                         f"{expected}")


def _layer_types(raw: dict, n: int, where: str) -> list[str]:
    """transformers' pattern (five sliding, one full) unless given; the last layer full
    (transformers makes it so, whatever the list says)."""
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _KINDS for t in types):
        raise UsageError(f"{where}: field 'layer_types': expected a list of {n} entries, each "
                         f"{' or '.join(map(repr, _KINDS))}, found {types!r}")
    return [*types[:-1], "full_attention"]


def _rope(params: dict, kind: str, where: str) -> tuple[float, dict]:
    """(theta, the scaling dict) of one layer type's ``rope_parameters``."""
    p = params.get(kind)
    at = f"rope_parameters.{kind}"
    if not isinstance(p, dict):
        raise UsageError(f"{where}: field {at!r} = {p!r}: expected an object")
    kind_ = p.get("rope_type", "default")
    _refuse_unless(kind_ in ("default", "proportional"), where, f"{at}.rope_type", kind_,
                   "'default' or 'proportional'")
    scaling = {"rope_type": kind_}
    if kind_ == "proportional":
        f = json_float(p, "partial_rotary_factor", where, 1.0)
        _refuse_unless(0 < f <= 1, where, f"{at}.partial_rotary_factor", f, "a number in (0, 1]")
        scaling.update(partial_rotary_factor=f, factor=json_float(p, "factor", where, 1.0))
    return json_float(p, "rope_theta", where, 10_000.0), scaling


def _full_layers(raw: dict, types: list[str], head_dim: int, n_kv: int,
                 where: str) -> tuple[int, int]:
    """(head_dim, KV heads) of the full-attention layers: ``per_layer_config`` as
    transformers 5 saves it (the same for every full layer, nothing for the sliding ones),
    else ``global_head_dim`` (512) and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads`` (else the sliding layers' KV heads)."""
    per = raw.get("per_layer_config")
    if per is None:
        gkv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
        return (json_int(raw, "global_head_dim", where, 512),
                n_kv if gkv is None else json_int(raw, "num_global_key_value_heads", where))
    if not isinstance(per, dict):
        raise UsageError(f"{where}: field 'per_layer_config' = {per!r}: expected an object")
    got = set()
    for i, kind in enumerate(types):
        over = per.get(str(i), per.get(i, {}))
        if kind == "sliding_attention" and over:
            raise UsageError(f"{where}: field 'per_layer_config.{i}' = {over!r} is not "
                             "supported; expected nothing for a sliding layer")
        if kind == "full_attention":
            if not isinstance(over, dict) or set(over) - {"head_dim", "num_key_value_heads"}:
                raise UsageError(f"{where}: field 'per_layer_config.{i}' = {over!r} is not "
                                 "supported; expected head_dim and num_key_value_heads alone")
            got.add((json_int(over, "head_dim", where, head_dim),
                     json_int(over, "num_key_value_heads", where, n_kv)))
    if len(got) > 1:
        raise UsageError(f"{where}: field 'per_layer_config': the full-attention layers differ "
                         f"({sorted(got)}); expected one head_dim and KV head count for all")
    return got.pop() if got else (head_dim, n_kv)


def text_fields(raw: dict, where: str) -> dict:
    """The :class:`ModelConfig` fields of a Gemma 4 text model's ``config.json`` fields."""
    for field, default, ok, expected in (
            ("hidden_size_per_layer_input", 256, lambda v: not v,
             "0 (per-layer input embeddings, Gemma 4 E2B/E4B, are not supported yet)"),
            ("num_kv_shared_layers", 0, lambda v: not v,
             "0 (KV shared across layers is not supported yet)"),
            ("enable_moe_block", False, lambda v: isinstance(v, bool), "true or false"),
            ("use_bidirectional_attention", None, lambda v: v in (None, "vision"),
             "null or 'vision' (text is causal)"),
            ("hidden_activation", "gelu_pytorch_tanh",
             lambda v: v in ("gelu_pytorch_tanh", "gelu_tanh"), "'gelu_pytorch_tanh'")):
        v = raw.get(field, default)
        _refuse_unless(ok(v if v is not None else default), where, field, v, expected)
    base = hf_fields({k: v for k, v in raw.items() if k != "rope_parameters"}, where)
    n = base["n_layers"]
    types = _layer_types(raw, n, where)
    head_dim = json_int(raw, "head_dim", where, 256)
    n_kv = json_int(raw, "num_key_value_heads", where, 4)
    params = raw.get("rope_parameters") or _ROPE
    if not isinstance(params, dict):
        raise UsageError(f"{where}: field 'rope_parameters' = {params!r}: expected an object "
                         "keyed by layer type")
    theta, scaling = _rope({**_ROPE, **params}, "sliding_attention", where)
    full_theta, full_scaling = _rope({**_ROPE, **params}, "full_attention", where)
    full_dim, full_kv = _full_layers(raw, types, head_dim, n_kv, where)
    cap = raw.get("final_logit_softcapping")
    moe = {}
    if raw.get("enable_moe_block"):  # every layer: routed experts beside the MLP
        moe = dict(n_experts=json_int(raw, "num_experts", where),
                   n_experts_per_tok=json_int(raw, "top_k_experts", where),
                   moe_intermediate=json_int(raw, "moe_intermediate_size", where))
        for k, v in moe.items():
            if v < 1:
                raise UsageError(f"{where}: the MoE block's {k} = {v}: expected >= 1")
    return {**base, **moe,
            "head_dim": head_dim, "n_kv_heads": n_kv,
            "intermediate": json_int(raw, "intermediate_size", where),
            "tie_embeddings": bool(raw.get("tie_word_embeddings", True)),
            "max_position": json_int(raw, "max_position_embeddings", where, 131_072),
            "rope_theta": theta, "rope_scaling": scaling,
            "sliding_window": json_int(raw, "sliding_window", where, 512),
            "layer_types": types, "qk_norm": True, "v_norm": True, "attention_scale": 1.0,
            "hidden_act": "gelu_tanh", "embed_scale": math.sqrt(base["hidden"]),
            "final_logit_softcap": 0.0 if cap is None else
            json_float(raw, "final_logit_softcapping", where, 0.0),
            "by_layer_type": {"full_attention": {
                "head_dim": full_dim, "n_kv_heads": full_kv,
                "v_from_k": bool(raw.get("attention_k_eq_v", False)),
                "rope_theta": full_theta, "rope_scaling": full_scaling}}}


def from_hf(raw: dict, where: str) -> ModelConfig:
    text, where = qwen3_5.text_config(raw, where, "gemma4_text")
    return ModelConfig(**{**text_fields(text, where), "arch": raw["model_type"]})


FAMILY = Family(
    summary=("sliding-window and full-attention layers (their own head size and KV heads, "
             "K as V, proportional rope), Q/K/V RMSNorm, sandwich norms, GeGLU, embedding "
             "scale, logit soft-cap; nested `text_config`, tensors under "
             "`model.language_model.`; the MoE block (routed experts beside the MLP, "
             "scaled router); not yet: per-layer embeddings, shared KV"),
    model_type="gemma4", gguf_arch=None, from_hf=from_hf, from_gguf=None,
    layer=lambda cfg, i: (_SLIDING_MOE if cfg.n_experts else _SLIDING) if cfg.is_sliding(i)
    else (_FULL_MOE if cfg.n_experts else _FULL),
    hf_class="Gemma4TextConfig",
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=24, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=24,
              num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
              hidden_size_per_layer_input=0, max_position_embeddings=256,
              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                           "full_attention"]))
