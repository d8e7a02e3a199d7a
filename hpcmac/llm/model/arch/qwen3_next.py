"""Qwen3-Next (``qwen3_next``): hybrid layers as ``layer_types`` says (by default three
Gated DeltaNet linear-attention layers, then one full-attention layer:
``full_attention_interval`` 4); the linear layers' projections fused per key head
(``in_proj_qkvz``, ``in_proj_ba``); full attention with per-head Q/K RMSNorm, an output gate
(``q_proj`` twice as wide: each head's query, then its gate) and rotary on the first
``partial_rotary_factor`` (0.25) of each head; RMSNorms scaling by ``1 + w``; routed experts
by softmax top-k, renormalised (``norm_topk_prob``, true unless set), plus one shared expert
(``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate x)``, on every
``decoder_sparse_step``-th layer but ``mlp_only_layers`` (dense MLPs).

The linear layers' conv and recurrent states are per-sequence caches
(:class:`~hpcmac.llm.model.cache.KVCache`); tensor parallelism splits them by value heads
(:mod:`hpcmac.llm.model.spec`). The multi-token-prediction weights (``mtp.*``) are not
run, as transformers does not. mlx-lm's folders (float or quantized) are read too: its
``sanitize`` stores the RMSNorms as ``1 + w`` and the conv as (C, K, 1), which the reader
recognises by the conv's shape and reads back as Hugging Face's
(``SafetensorsCheckpoint.mlx_lm_sanitized``). Refused in one line naming the field: a
``hidden_act`` other than silu, a layer type other than linear or full attention, value
heads not a multiple of key heads.

GGUF (llama.cpp's ``qwen3next``): the linear attention's shapes from ``ssm.*``
(``group_count`` key heads, ``time_step_rank`` value heads, ``state_size`` the key head's
size, ``inner_size`` all the values, ``conv_kernel``), the layers from
``full_attention_interval``, the rotary part ``rope.dimension_count``; the RMSNorms stored
as ``1 + w`` (read as they are), ``in_proj_qkvz`` split into ``attn_qkv`` and
``attn_gate``, ``-exp(A_log)`` as ``ssm_a``, the conv (C, K) (put back by the blocks'
GGUF forms, :mod:`.blocks`); every layer routed, renormalised, the shared expert's width
``expert_shared_feed_forward_length``; the MTP layers ``nextn_predict_layers`` counts in
``block_count`` left out. Refused in one line: the older fused ``ssm_in``, value heads not
a multiple of key heads.
"""

from __future__ import annotations

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch.base import FP8, Family
from hpcmac.llm.model.arch.blocks import GQA, MLP, GatedDeltaNet, Layer, MoE, softmax_topk
from hpcmac.llm.model.arch.fields import (
    ModelConfig,
    gguf_fields,
    gguf_moe_fields,
    hf_fields,
    hf_moe_fields,
    json_float,
    json_int,
)

_KINDS = ("linear_attention", "full_attention")
_FULL = GQA(output_gate=True)
_LINEAR = GatedDeltaNet(fused=True)
_SPARSE = MoE(route=softmax_topk, shared="shared_expert", shared_gate=True)


def hybrid_fields(raw: dict, where: str) -> dict:
    """The :class:`ModelConfig` fields Qwen3-Next and Qwen3.5 read alike: the attention,
    the linear attention's shapes, ``layer_types``, the ``1 + w`` norms (sizes checked)."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"{where}: field 'hidden_act' = {act!r} is not supported; "
                         "expected 'silu'")
    f = hf_fields(raw, where)
    params = raw.get("rope_parameters") or {}
    n = f["n_layers"]
    types = raw.get("layer_types")
    if types is None:
        every = json_int(raw, "full_attention_interval", where, 4)
        if every < 1:
            raise UsageError(f"{where}: field 'full_attention_interval' = {every}: "
                             "expected >= 1")
        types = ["linear_attention" if (i + 1) % every else "full_attention"
                 for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in _KINDS for t in types):
        raise UsageError(f"{where}: field 'layer_types': expected a list of {n} entries, each "
                         f"{' or '.join(map(repr, _KINDS))}, found {types!r}")
    nk = json_int(raw, "linear_num_key_heads", where, 16)
    nv = json_int(raw, "linear_num_value_heads", where, 32)
    if nk < 1 or nv % nk:
        raise UsageError(f"{where}: field 'linear_num_value_heads' = {nv}: expected a "
                         f"multiple of linear_num_key_heads ({nk})")
    kernel = json_int(raw, "linear_conv_kernel_dim", where, 4)
    if kernel < 1:
        raise UsageError(f"{where}: field 'linear_conv_kernel_dim' = {kernel}: expected >= 1")
    return dict(
        **f, qk_norm=True, norm_offset=1.0, layer_types=list(types),
        partial_rotary_factor=json_float(params, "partial_rotary_factor", where,
                                         json_float(raw, "partial_rotary_factor", where,
                                                    0.25)),
        linear_k_heads=nk, linear_v_heads=nv,
        linear_k_dim=json_int(raw, "linear_key_head_dim", where, 128),
        linear_v_dim=json_int(raw, "linear_value_head_dim", where, 128),
        linear_conv_kernel=kernel)


def shared_expert_fields(raw: dict, where: str) -> dict:
    """Routed experts and the one gated shared expert (Qwen3-Next, Qwen3.5-MoE)."""
    moe = hf_moe_fields(raw, where)
    shared = json_int(raw, "shared_expert_intermediate_size", where, 0)
    if not moe["n_experts"]:  # every layer a dense MLP (transformers': num_experts 0)
        return {**moe, "n_experts_per_tok": 0}
    return dict(**moe, n_shared_experts=1 if shared else 0, shared_intermediate=shared)


def from_hf(raw: dict, where: str) -> ModelConfig:
    moe = shared_expert_fields(raw, where)
    moe["norm_topk_prob"] = bool(raw.get("norm_topk_prob", True))
    return ModelConfig(**hybrid_fields(raw, where), **moe,
                       decoder_sparse_step=json_int(raw, "decoder_sparse_step", where, 0) or 1,
                       mlp_only_layers=[json_int({"mlp_only_layers": i}, "mlp_only_layers",
                                                 where)
                                        for i in raw.get("mlp_only_layers") or []])


def layer(cfg: ModelConfig, i: int) -> Layer:
    return Layer(_LINEAR if cfg.is_linear(i) else _FULL,
                 _SPARSE if cfg.is_moe_layer(i) else MLP(), gguf_post_norm="post_attention_norm")


def hybrid_gguf_fields(meta, arch: str) -> dict:
    """The :class:`ModelConfig` fields Qwen3-Next's and Qwen3.5's GGUF files give alike (see
    the module's docstring): the attention, the linear attention's shapes, the layers."""
    f = gguf_fields(meta, arch)
    f["n_layers"] -= int(meta.meta("nextn_predict_layers", 0) or 0)  # the MTP layers
    old = next((n for n in meta.tensors if n.endswith(".ssm_in.weight")), None)
    if old is not None:
        raise UsageError(f"{meta.where}: tensor {old}: the older fused in_proj_qkvz is not "
                         "read; expected attn_qkv and attn_gate (llama.cpp's converter)")
    every = int(meta.need("full_attention_interval"))
    nk, nv = int(meta.need("ssm.group_count")), int(meta.need("ssm.time_step_rank"))
    inner = int(meta.need("ssm.inner_size"))
    if every < 1 or nk < 1 or nv % nk or inner % max(nv, 1):
        raise UsageError(f"{meta.where}: metadata {meta.arch}.ssm.* / full_attention_interval: "
                         f"{nv} value heads of {inner} values over {nk} key heads, a full "
                         f"layer every {every}: expected value heads a multiple of key heads, "
                         "values a multiple of value heads, an interval >= 1")
    rope_dim = int(meta.need("rope.dimension_count"))
    out = dict(**{**f, "qk_norm": True}, norm_offset=0.0,
               layer_types=["linear_attention" if (i + 1) % every else "full_attention"
                            for i in range(f["n_layers"])],
               partial_rotary_factor=rope_dim / f["head_dim"],
               linear_k_heads=nk, linear_v_heads=nv,
               linear_k_dim=int(meta.need("ssm.state_size")), linear_v_dim=inner // nv,
               linear_conv_kernel=int(meta.need("ssm.conv_kernel")))
    if int(f["head_dim"] * out["partial_rotary_factor"]) != rope_dim:
        raise UsageError(f"{meta.where}: metadata {meta.arch}.rope.dimension_count = "
                         f"{rope_dim}: expected an even number up to the head size "
                         f"{f['head_dim']}")
    return out


def gguf_shared_expert_fields(meta) -> dict:
    """Routed experts (renormalised) and the one gated shared expert, from GGUF."""
    shared = int(meta.meta("expert_shared_feed_forward_length", 0) or 0)
    return dict(**gguf_moe_fields(meta), norm_topk_prob=True,
                n_shared_experts=1 if shared else 0, shared_intermediate=shared)


def from_gguf(meta) -> ModelConfig:
    return ModelConfig(**hybrid_gguf_fields(meta, "qwen3_next"),
                       **gguf_shared_expert_fields(meta))


def write_hybrid_gguf_meta(w, cfg: ModelConfig) -> None:
    """What llama.cpp's converter writes for Qwen3-Next and Qwen3.5 beyond the common keys
    (layers that are not every ``full_attention_interval``-th full have no GGUF form)."""
    every = cfg.layer_types.index("full_attention") + 1 if "full_attention" in \
        cfg.layer_types else cfg.n_layers + 1
    if cfg.layer_types != ["linear_attention" if (i + 1) % every else "full_attention"
                           for i in range(cfg.n_layers)]:
        raise UsageError("Qwen3-Next GGUF: llama.cpp's form needs a full-attention layer "
                         "every full_attention_interval-th")
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel)
    w.add_ssm_state_size(cfg.linear_k_dim)
    w.add_ssm_group_count(cfg.linear_k_heads)
    w.add_ssm_time_step_rank(cfg.linear_v_heads)
    w.add_ssm_inner_size(cfg.linear_v_dim * cfg.linear_v_heads)
    w.add_full_attention_interval(every)
    if cfg.n_shared_experts:
        w.add_expert_shared_feed_forward_length(cfg.shared_width)


def write_gguf_meta(w, cfg: ModelConfig) -> None:
    """The hybrid layers' metadata; the experts as llama.cpp's qwen3next has them (every
    layer routed, renormalised)."""
    if not cfg.norm_topk_prob or any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        raise UsageError("Qwen3-Next GGUF: llama.cpp's form needs every layer routed, "
                         "renormalised")
    write_hybrid_gguf_meta(w, cfg)


FAMILY = Family(
    summary=("Gated DeltaNet linear attention on three of four layers (conv and recurrent "
             "state a fixed per-sequence cache), gated full attention with a rotary quarter, "
             "`1 + w` RMSNorms, softmax top-k experts plus a sigmoid-gated shared expert"),
    model_type="qwen3_next", gguf_arch="qwen3next", from_hf=from_hf, from_gguf=from_gguf,
    write_gguf_meta=write_gguf_meta,
    layer=layer, hf_class="Qwen3NextConfig", mlx_quant_tested=True,
    # Qwen3-Next-80B-A3B-*-FP8: every projection e4m3 but in_proj_ba (and the routers)
    quant_methods=FP8, fp8_float=("linear_attn.in_proj_ba",),
    tiny=dict(vocab_size=96, hidden_size=40, intermediate_size=24, num_hidden_layers=4,
              num_attention_heads=5, num_key_value_heads=1, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
              linear_value_head_dim=12, num_experts=6, num_experts_per_tok=2,
              moe_intermediate_size=10, shared_expert_intermediate_size=14,
              max_position_embeddings=256))
