"""DeepSeek-V3 (and Kimi K2): multi-head latent attention (interleaved rope on the shared
rotary key); the first ``first_k_dense`` layers dense, then routed experts chosen by
sigmoid scores with a correction bias and group-limited top-k, scaled, plus shared experts.

GGUF: ``deepseek2``, with ``attn_kv_b`` or the newer ``attn_k_b``/``attn_v_b`` split.
llama.cpp's converter writes Kimi K2 and GLM-4.7-Flash under ``deepseek2`` too, with the same
layers and names; the vocabulary (``tokenizer.ggml.pre``) tells them apart
(:attr:`~.base.Family.gguf_pre`: ``deepseek-v3``, ``deepseek-llm``, ``deepseek-coder`` here).
``block_count`` counts the MTP layers where ``nextn_predict_layers`` says so (the last ones,
not run). Refused in one line: routing other than sigmoid (``expert_gating_func`` 2;
absent, llama.cpp reads DeepSeek-V2's softmax), and the sparse-attention indexer's tensors
(DeepSeek-V3.2's, which hpcmac does not read from GGUF).
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import MLA, MLP, Layer, MoE, sigmoid_grouped
from hpcmac.llm.model.arch.fields import (
    ModelConfig,
    gguf_fields,
    gguf_moe_fields,
    hf_fields,
    hf_moe_fields,
    json_float,
    json_int,
)

_DENSE = Layer(MLA(), MLP())
_SPARSE = Layer(MLA(), MoE(route=sigmoid_grouped, correction_bias=True))


def from_hf(raw: dict, where: str) -> ModelConfig:
    cfg = ModelConfig(
        **hf_fields(raw, where), **hf_moe_fields(raw, where),
        n_shared_experts=json_int(raw, "n_shared_experts", where, 0),
        first_k_dense=json_int(raw, "first_k_dense_replace", where, 0),
        n_group=json_int(raw, "n_group", where, 0) or 1,
        topk_group=json_int(raw, "topk_group", where, 0) or 1,
        routed_scaling_factor=json_float(raw, "routed_scaling_factor", where, 1.0),
        mla=True)
    q_lora = raw.get("q_lora_rank")
    cfg.q_lora_rank = None if q_lora is None else json_int(raw, "q_lora_rank", where)
    cfg.kv_lora_rank = json_int(raw, "kv_lora_rank", where)
    cfg.qk_nope_head_dim = json_int(raw, "qk_nope_head_dim", where)
    cfg.qk_rope_head_dim = json_int(raw, "qk_rope_head_dim", where)
    cfg.v_head_dim = json_int(raw, "v_head_dim", where)
    cfg.rope_interleave = bool(raw.get("rope_interleave", True))
    cfg.head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    cfg.n_kv_heads = cfg.n_heads
    if cfg.n_experts % cfg.n_group:
        raise UsageError(f"{where}: n_routed_experts {cfg.n_experts} is not a multiple "
                         f"of n_group {cfg.n_group}")
    return cfg


#: GGUF expert_gating_func: llama.cpp's sigmoid
_SIGMOID = 2


def mla_from_gguf(meta, arch: str) -> ModelConfig:
    """The configuration of a ``deepseek2`` file (DeepSeek-V3's layers), labelled ``arch``
    (the family its vocabulary says: :func:`hpcmac.llm.model.arch.gguf_family`)."""
    f = gguf_fields(meta, arch)
    f["n_layers"] -= int(meta.meta("nextn_predict_layers", 0) or 0)  # the MTP layers
    gating = meta.meta("expert_gating_func")
    if gating is None or int(gating) != _SIGMOID:
        raise UsageError(f"{meta.where}: metadata {meta.arch}.expert_gating_func = {gating}: "
                         f"expected {_SIGMOID} (sigmoid; absent or 1, llama.cpp reads "
                         "DeepSeek-V2's softmax routing, which is not supported)")
    if any(".indexer." in n for n in meta.tensors):
        raise UsageError(f"{meta.where}: tensor "
                         f"{next(n for n in meta.tensors if '.indexer.' in n)}: a sparse-"
                         "attention indexer (DeepSeek-V3.2) is not read from GGUF; use the "
                         "safetensors folder")
    cfg = ModelConfig(**f, **gguf_moe_fields(meta), mla=True)
    cfg.q_lora_rank = int(meta.meta("attention.q_lora_rank", 0)) or None
    cfg.kv_lora_rank = int(meta.need("attention.kv_lora_rank"))
    cfg.qk_rope_head_dim = int(meta.need("rope.dimension_count"))
    # newer converters write the absorbed (MQA) lengths as key/value_length
    # and the per-head ones as key/value_length_mla
    head_dim = int(meta.meta("attention.key_length_mla", f["head_dim"]))
    cfg.head_dim = head_dim
    cfg.qk_nope_head_dim = head_dim - cfg.qk_rope_head_dim
    cfg.v_head_dim = int(meta.meta("attention.value_length_mla", 0)
                         or meta.need("attention.value_length"))
    cfg.n_kv_heads = cfg.n_heads
    cfg.n_shared_experts = int(meta.meta("expert_shared_count", 0) or 0)
    cfg.first_k_dense = int(meta.meta("leading_dense_block_count", 0) or 0)
    cfg.routed_scaling_factor = float(meta.meta("expert_weights_scale", 1.0))
    cfg.norm_topk_prob = bool(meta.meta("expert_weights_norm", False))
    cfg.n_group = int(meta.meta("expert_group_count", 1) or 1)
    cfg.topk_group = int(meta.meta("expert_group_used_count", 1) or 1)
    cfg.rope_interleave = True
    if cfg.n_experts % cfg.n_group:
        raise UsageError(f"{meta.where}: metadata {meta.arch}.expert_count {cfg.n_experts} "
                         f"is not a multiple of expert_group_count {cfg.n_group}")
    return cfg


def from_gguf(meta) -> ModelConfig:
    return mla_from_gguf(meta, "deepseek_v3")


def write_gguf_meta(w, cfg: ModelConfig) -> None:
    """The absorbed (MQA) lengths and the MLA and routing metadata, as llama.cpp's converter
    writes them (one KV head: the latent, shared by every query head)."""
    import gguf

    w.add_head_count_kv(1)
    w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    w.add_value_length(cfg.kv_lora_rank)
    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)


FAMILY = Family(
    mlx_quant_tested=True,
    quant_methods=FP8,
    summary=("multi-head latent attention; sigmoid routing with correction bias and group-limited "
             "top-k, shared experts, dense first layers, routed scaling"),
    model_type="deepseek_v3", gguf_arch="deepseek2", from_hf=from_hf, from_gguf=from_gguf,
    layer=lambda cfg, i: _SPARSE if cfg.is_moe_layer(i) else _DENSE, hf_class="DeepseekV3Config",
    write_gguf_meta=write_gguf_meta, gguf_pre=("deepseek-v3", "deepseek-llm", "deepseek-coder"),
    tiny=dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
              n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
              first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=12, v_head_dim=10, n_shared_experts=1,
              routed_scaling_factor=2.5, max_position_embeddings=256))
