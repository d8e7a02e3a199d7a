"""MiniMax-M2 / M2.1 (``minimax_m2``): grouped-query attention with RMSNorm over all of Q's
and all of K's projected dimensions (not per head), rotary on the first ``rotary_dim``
dimensions of each head (``partial_rotary_factor``); every layer routed experts
(``block_sparse_moe``, experts ``w1``/``w3``/``w2`` of ``intermediate_size`` columns) chosen
by sigmoid scores plus a correction bias, top ``num_experts_per_tok``, the chosen scores
renormalised; no shared experts, no biases.

The multi-token-prediction modules (``use_mtp``) are not run, as transformers does not.
Refused in one line naming the field: linear-attention layers (``attn_type_list``),
another ``qk_norm_type`` than ``per_layer``, ``use_qk_norm`` or ``use_routing_bias``
false, a ``scoring_func`` other than sigmoid, shared experts, a sliding window.

GGUF (llama.cpp's ``minimax-m2``): the rotary part ``rope.dimension_count`` (``rotary_dim``),
the experts' width ``expert_feed_forward_length``; ``attn_q_norm`` / ``attn_k_norm`` over
all the heads' dimensions, ``exp_probs_b.bias`` the correction bias, the second norm
``ffn_norm``. Refused in one line: an ``expert_gating_func`` other than sigmoid (2).
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import GQA, Layer, MoE, sigmoid_grouped
from hpcmac.llm.model.arch.fields import (
    ModelConfig,
    gguf_fields,
    gguf_moe_fields,
    hf_fields,
    hf_moe_fields,
    json_float,
)

#: sigmoid + correction bias + top-k + renormalised: DeepSeek's router with one group,
#: no scaling
_LAYER = Layer(GQA(full_qk_norm=True),
               MoE(route=sigmoid_grouped, correction_bias=True, module="block_sparse_moe",
                   bias_name="e_score_correction_bias"))

#: the released config.json's own fields: the values we run, and what each must be
_FIXED = {"use_qk_norm": True, "qk_norm_type": "per_layer", "use_routing_bias": True,
          "scoring_func": "sigmoid", "shared_intermediate_size": 0, "sliding_window": None}


def _refuse_unsupported(raw: dict, where: str) -> None:
    for key, want in _FIXED.items():
        if key in raw and raw[key] != want and not (want is None and raw[key] in (0, False)):
            raise UsageError(f"{where}: field {key!r} = {raw[key]!r} is not supported; "
                             f"expected {want!r}")
    kinds = raw.get("attn_type_list")
    if kinds is not None and (not isinstance(kinds, list) or any(k != 1 for k in kinds)):
        raise UsageError(f"{where}: field 'attn_type_list' asks for linear-attention layers "
                         "(0); only full attention (1) is supported")


def from_hf(raw: dict, where: str) -> ModelConfig:
    _refuse_unsupported(raw, where)
    f = hf_fields(raw, where)
    params = raw.get("rope_parameters") or {}
    partial = json_float(params, "partial_rotary_factor", where,
                         json_float(raw, "partial_rotary_factor", where, 0.0))
    if not partial and raw.get("rotary_dim") is not None:  # the released checkpoints' name
        partial = json_float(raw, "rotary_dim", where, 0.0) / f["head_dim"]
    moe = hf_moe_fields(raw, where)
    # every layer is routed; the experts' width is intermediate_size (and the dense width
    # mirrors it, for the tensor-parallel split's check)
    moe["moe_intermediate"] = f["intermediate"]
    return ModelConfig(**{**f, "attention_bias": False, "o_bias": False, "mlp_bias": False},
                       **{**moe, "norm_topk_prob": True},
                       partial_rotary_factor=partial or 1.0)


#: GGUF expert_gating_func: llama.cpp's sigmoid
_SIGMOID = 2


def from_gguf(meta) -> ModelConfig:
    f = gguf_fields(meta, "minimax_m2")
    gating = meta.meta("expert_gating_func")
    if gating is not None and int(gating) != _SIGMOID:
        raise UsageError(f"{meta.where}: metadata {meta.arch}.expert_gating_func = {gating}: "
                         f"expected {_SIGMOID} (sigmoid)")
    moe = gguf_moe_fields(meta)
    rope_dim = int(meta.meta("rope.dimension_count", f["head_dim"]))
    cfg = ModelConfig(**{**f, "qk_norm": False, "intermediate": f["intermediate"] or
                         moe["moe_intermediate"]},
                      **moe, norm_topk_prob=True, partial_rotary_factor=rope_dim / f["head_dim"])
    if cfg.rope_dim != rope_dim:
        raise UsageError(f"{meta.where}: metadata {meta.arch}.rope.dimension_count = "
                         f"{rope_dim}: expected an even number up to the head size "
                         f"{f['head_dim']}")
    return cfg


def write_gguf_meta(w, cfg: ModelConfig) -> None:
    """The per-head lengths and the sigmoid gating, as llama.cpp's converter writes them."""
    import gguf

    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


FAMILY = Family(
    mlx_quant_tested=True,
    quant_methods=FP8,
    summary=("RMSNorm over all of Q's and K's projected dimensions, partial rotary (`rotary_dim`),"
             " sigmoid-routed experts with correction bias in every layer"),
    model_type="minimax_m2", gguf_arch="minimax-m2", from_hf=from_hf, from_gguf=from_gguf,
    write_gguf_meta=write_gguf_meta,
    layer=lambda cfg, i: _LAYER, hf_class="MiniMaxM2Config",
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=20, num_hidden_layers=3,
              num_attention_heads=5, num_key_value_heads=1, head_dim=12,
              num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None,
              rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                   partial_rotary_factor=0.5)))
