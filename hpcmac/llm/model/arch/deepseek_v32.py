"""DeepSeek-V3.2 (``deepseek_v32``): DeepSeek-V3's layers (:mod:`.deepseek_v3`) with DeepSeek
Sparse Attention: in every layer a lightning indexer (``self_attn.indexer``: ``index_n_heads``
heads of ``index_head_dim``, its key cached per token beside the latent) scores the cached
tokens for each query, and the latent attention sees only the ``index_topk`` best
(:class:`~hpcmac.llm.model.arch.blocks.IndexedMLA`). The indexer is replicated on every
tensor rank, so every rank selects the same tokens.

``q_lora_rank`` is required (the indexer's query is read from the Q LoRA, as transformers
requires it); ``mlp_layer_types`` must be the dense-first pattern ``first_k_dense_replace``
gives (3 when absent, as transformers defaults). The release is FP8 (e4m3, 128 x 128 blocks),
kept 8-bit as DeepSeek-V3's: every projection, the indexer's ``wq_b`` and ``wk`` too, but
its ``weights_proj`` (bfloat16 in the release). No GGUF form yet.
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch import deepseek_v3
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import MLP, IndexedMLA, Layer, MoE, sigmoid_grouped
from hpcmac.llm.model.arch.fields import ModelConfig, json_int

_DENSE = Layer(IndexedMLA(), MLP())
_SPARSE = Layer(IndexedMLA(), MoE(route=sigmoid_grouped, correction_bias=True))


def from_hf(raw: dict, where: str) -> ModelConfig:
    if raw.get("q_lora_rank") is None:
        raise UsageError(f"{where}: field 'q_lora_rank' is required for deepseek_v32 (the "
                         "indexer's query is projected from the Q LoRA)")
    raw = {"first_k_dense_replace": 3, **raw}
    cfg = deepseek_v3.from_hf(raw, where)
    cfg.rope_interleave = True  # transformers' V3.2 always interleaves the MLA's rope
    for name, default in (("index_n_heads", 64), ("index_head_dim", 128), ("index_topk", 2048)):
        v = json_int(raw, name, where, default)
        if v < 1:
            raise UsageError(f"{where}: field {name!r} = {v}: expected >= 1")
        setattr(cfg, name, v)
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise UsageError(f"{where}: field 'index_head_dim' = {cfg.index_head_dim}: expected at "
                         f"least qk_rope_head_dim ({cfg.qk_rope_head_dim}), its rotated part")
    types = raw.get("mlp_layer_types")
    want = ["dense" if i < cfg.first_k_dense else "sparse" for i in range(cfg.n_layers)]
    if types is not None and types != want:
        raise UsageError(f"{where}: field 'mlp_layer_types' = {types!r}: expected the "
                         f"first_k_dense_replace ({cfg.first_k_dense}) dense-first pattern")
    return cfg


FAMILY = Family(
    mlx_quant_tested=True,
    summary=("DeepSeek-V3's latent attention and routing, plus the lightning indexer's top-k "
             "sparse attention (its key cached per token; replicated under tensor "
             "parallelism)"),
    model_type="deepseek_v32", gguf_arch=None, from_hf=from_hf, from_gguf=None,
    layer=lambda cfg, i: _SPARSE if cfg.is_moe_layer(i) else _DENSE, hf_class="DeepseekV32Config",
    quant_methods=FP8, fp8_float=("indexer.weights_proj",),
    tiny=dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
              n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
              first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=12, v_head_dim=10, n_shared_experts=1,
              routed_scaling_factor=2.5, index_n_heads=8, index_head_dim=12, index_topk=6,
              max_position_embeddings=256))
