"""GLM-4.7-Flash (``glm4_moe_lite``): DeepSeek-V3's multi-head latent attention (optional
Q LoRA, interleaved or rotate-half rope on the shared rotary key) with GLM-4's MoE (sigmoid
scores, correction bias, group-limited top-k, ``routed_scaling_factor``, shared experts);
which layers are dense is ``mlp_layer_types`` (``dense`` / ``sparse`` per layer; unset: the
first dense, the rest sparse), not ``first_k_dense_replace``.

Refused in one line naming the field: ``attention_bias`` (the latent projections have no
biases here), a ``partial_rotary_factor`` other than 1 (the rotary key is rotated whole),
an ``mlp_layer_types`` entry other than dense or sparse or of another length than the
layers. The multi-token-prediction layer is not run, as transformers does not.

GGUF: llama.cpp's converter writes it as ``deepseek2`` (DeepSeek-V3's names and metadata;
the dense layers the first ``leading_dense_block_count``, the MTP layers counted in
``block_count`` by ``nextn_predict_layers``), told from DeepSeek-V3 and Kimi K2 by GLM's
vocabulary (``tokenizer.ggml.pre`` ``glm4``).
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch import deepseek_v3
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import MLA, MLP, Layer, MoE, sigmoid_grouped
from hpcmac.llm.model.arch.fields import ModelConfig, json_float

_DENSE = Layer(MLA(), MLP())
_SPARSE = Layer(MLA(), MoE(route=sigmoid_grouped, correction_bias=True))


def from_hf(raw: dict, where: str) -> ModelConfig:
    if raw.get("attention_bias"):
        raise UsageError(f"{where}: field 'attention_bias' = true is not supported; "
                         "expected false (no biases on the latent projections)")
    params = raw.get("rope_parameters") or {}
    partial = json_float(params, "partial_rotary_factor", where,
                         json_float(raw, "partial_rotary_factor", where, 1.0))
    if partial != 1.0:
        raise UsageError(f"{where}: field 'partial_rotary_factor' = {partial:g} is not "
                         "supported; expected 1 (the rotary key is rotated whole)")
    cfg = deepseek_v3.from_hf({**raw, "first_k_dense_replace": 0}, where)
    types = raw.get("mlp_layer_types")
    if types is None:
        types = ["dense"] + ["sparse"] * (cfg.n_layers - 1)
    if not isinstance(types, list) or len(types) != cfg.n_layers or \
            any(t not in ("dense", "sparse") for t in types):
        raise UsageError(f"{where}: field 'mlp_layer_types' = {types!r}: expected "
                         f"{cfg.n_layers} entries, each 'dense' or 'sparse'")
    cfg.mlp_only_layers = [i for i, t in enumerate(types) if t == "dense"]
    return cfg


def write_gguf_meta(w, cfg: ModelConfig) -> None:
    """DeepSeek-V3's metadata (llama.cpp's ``deepseek2``), the dense layers as the count of
    leading ones: a model whose dense layers are not the first ones has no GGUF form."""
    from dataclasses import replace

    k = len(cfg.mlp_only_layers)
    if cfg.mlp_only_layers != list(range(k)):
        raise UsageError(f"glm4_moe_lite GGUF: dense layers {cfg.mlp_only_layers} are not the "
                         "first ones (llama.cpp's leading_dense_block_count)")
    deepseek_v3.write_gguf_meta(w, replace(cfg, first_k_dense=k))


FAMILY = Family(
    mlx_quant_tested=True,
    quant_methods=FP8,
    summary=("GLM-4.7-Flash: DeepSeek-V3's latent attention with GLM-4's routing, shared experts, "
             "dense layers by `mlp_layer_types`"),
    model_type="glm4_moe_lite", gguf_arch="deepseek2", from_hf=from_hf,
    from_gguf=lambda meta: deepseek_v3.mla_from_gguf(meta, "glm4_moe_lite"),
    write_gguf_meta=write_gguf_meta, gguf_pre=("glm4",),
    layer=lambda cfg, i: _SPARSE if cfg.is_moe_layer(i) else _DENSE,
    hf_class="Glm4MoeLiteConfig",
    tiny=dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
              num_experts_per_tok=3, n_group=4, topk_group=2, q_lora_rank=24,
              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
              n_shared_experts=1, routed_scaling_factor=1.8, max_position_embeddings=256))
