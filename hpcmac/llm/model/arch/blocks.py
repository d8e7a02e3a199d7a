"""The shared blocks a family's layers are made of, each described once.

A block owns, for its part of a layer: its tensors (canonical and GGUF names,
shape, class, how tensor parallelism splits it: :class:`~hpcmac.llm.model.spec.TensorSpec`),
how the loader reads them into the layer's weight dict (fused, this rank's
slice), and its forward. The numerics are in :mod:`hpcmac.llm.model.layers`
(attention, MLP, experts, routers) and :mod:`hpcmac.llm.model.rope`; a block
calls them. Communication-free, like all model code: partial results under
tensor parallelism are summed by ``step.sum``, which the stage provides.

Blocks: :class:`GQA` (MHA/GQA/MQA, optional Q/K/V and output biases, optional
per-head Q/K RMSNorm, optional attention sinks and sliding window), :class:`MLA`
(multi-head latent attention, absorbed up-projection), :class:`IndexedMLA` (MLA with
DeepSeek-V3.2's top-k lightning indexer), :class:`GatedDeltaNet` (linear
attention with a per-sequence recurrent state), :class:`MLP` (SwiGLU, optional
biases), :class:`MoE` (routed experts with a router, optional correction bias,
optional shared experts), :class:`InterleavedMoE` (gpt-oss's experts: interleaved
gate/up, biases, clamped SwiGLU), :class:`Layer` (the pre-norm residual layer:
``x + attn(norm x)``, ``x + ffn(norm x)``) and :class:`SandwichLayer` (Gemma's: each block's
output normalised too).
Routers: :func:`softmax_topk`, :func:`sigmoid_grouped`, :func:`topk_softmax`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hpcmac.llm.model import layers, linear_attention
from hpcmac.llm.model.quant import concat_rows
from hpcmac.llm.model.spec import TensorSpec, padded_heads, padded_qkv_source

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.fields import ModelConfig


def tensor(i: int, name: str, gguf: str, shape: tuple[int, ...], kind: str,
           split: str | None = None, axis: int = 0, form: str | None = None) -> TensorSpec:
    """Tensor ``model.layers.{i}.{name}`` of layer ``i``, ``blk.{i}.{gguf}`` in a GGUF file.

    ``form``: the GGUF file stores it in another layout
    (:attr:`~hpcmac.llm.model.spec.TensorSpec.gguf_form`); ``gguf`` is then one name
    (``t``) or ``"a|b|fused"`` (``pairs``, ``pairs_t``), each under ``blk.{i}.``."""
    shape = tuple(int(s) for s in shape)
    if form is None:
        return TensorSpec(f"model.layers.{i}.{name}", shape, kind, split, axis, f"blk.{i}.{gguf}")
    names = tuple(f"blk.{i}.{g}" for g in gguf.split("|"))
    return TensorSpec(f"model.layers.{i}.{name}", shape, kind, split, axis, None,
                      (form, *names))


def _p(i: int) -> str:
    return f"model.layers.{i}."


def norm_weight(ld, cfg: ModelConfig, name: str, sp: TensorSpec | None = None):
    """An RMSNorm weight as the forward multiplies by it: as stored, plus
    ``cfg.norm_offset`` (Qwen3-Next stores ``w`` and scales by ``1 + w``)."""
    w = ld.np(name, sp)
    return ld.be.asarray(w + np.float32(cfg.norm_offset) if cfg.norm_offset else w)


# -- attention ------------------------------------------------------------------

@dataclass(frozen=True)
class GQA:
    """Grouped-query attention: fused QKV; ``cfg.attention_bias`` (Q/K/V biases),
    ``cfg.o_bias``, ``cfg.qk_norm`` (RMSNorm on each head of Q and K); rotate-half rope on
    the first ``cfg.rope_dim`` dimensions of each head (``partial_rotary_factor``).
    The cache holds per-KV-head K and V.

    sinks : a learned logit per query head (``self_attn.sinks``) joins each softmax's
        denominator (gpt-oss)
    sliding : each query sees only the ``cfg.sliding_window`` latest keys; the cache
        still keeps every key, masked by the window (simple first: no ring buffer)
    full_qk_norm : RMSNorm over all of Q's and all of K's projected dimensions
        (MiniMax-M2: ``q_norm`` (H*d,), ``k_norm`` (KV*d,), split with their heads);
        under tensor parallelism the group sums the sums of squares.
    output_gate : ``q_proj`` gives each head its query and then as many gate logits; the
        heads' outputs are multiplied by ``sigmoid(gate)`` before ``o_proj`` (Qwen3-Next)

    ``cfg.v_from_k``: no ``v_proj``, V is K's projection; ``cfg.v_norm``: V's heads
    RMS-normalised without a weight (Gemma 4).
    """

    sinks: bool = False
    sliding: bool = False
    full_qk_norm: bool = False
    output_gate: bool = False

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, H, KV, d = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qd = 2 * d if self.output_gate else d
        out = [tensor(i, "self_attn.q_proj.weight", "attn_q.weight", (H * qd, D), "matrix",
                      "q_gated" if self.output_gate else "q"),
               tensor(i, "self_attn.k_proj.weight", "attn_k.weight", (KV * d, D), "matrix", "kv"),
               tensor(i, "self_attn.v_proj.weight", "attn_v.weight", (KV * d, D), "matrix", "kv")]
        if cfg.attention_bias:
            out += [tensor(i, "self_attn.q_proj.bias", "attn_q.bias", (H * qd,), "vector",
                           "q_gated" if self.output_gate else "q"),
                    tensor(i, "self_attn.k_proj.bias", "attn_k.bias", (KV * d,), "vector", "kv"),
                    tensor(i, "self_attn.v_proj.bias", "attn_v.bias", (KV * d,), "vector", "kv")]
        if cfg.v_from_k:
            out = [t for t in out if ".v_proj." not in t.name]
        out.append(tensor(i, "self_attn.o_proj.weight", "attn_output.weight", (D, H * d),
                          "matrix", "heads_in", 1))
        if cfg.o_bias:
            out.append(tensor(i, "self_attn.o_proj.bias", "attn_output.bias", (D,), "vector",
                              "rank0"))
        if self.full_qk_norm:
            out += [tensor(i, "self_attn.q_norm.weight", "attn_q_norm.weight", (H * d,),
                           "vector", "q"),
                    tensor(i, "self_attn.k_norm.weight", "attn_k_norm.weight", (KV * d,),
                           "vector", "kv")]
        elif cfg.qk_norm:
            out += [tensor(i, "self_attn.q_norm.weight", "attn_q_norm.weight", (d,), "vector"),
                    tensor(i, "self_attn.k_norm.weight", "attn_k_norm.weight", (d,), "vector")]
        if self.sinks:
            out.append(tensor(i, "self_attn.sinks", "attn_sinks.weight", (H,), "vector",
                              "heads"))
        return out

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        be, a = ld.be, _p(i) + "self_attn."
        proj = "qk" if cfg.v_from_k else "qkv"
        qkv = [ld.raw(a + f"{x}_proj.weight") for x in proj]
        w["wqkv"] = be.weight(concat_rows(qkv))
        if cfg.attention_bias:
            w["bqkv"] = be.asarray(np.concatenate([ld.np(a + f"{x}_proj.bias") for x in proj]))
        if cfg.v_norm:
            w["v_norm"] = be.asarray(np.ones(cfg.head_dim, np.float32))
        w["wo"] = ld.w(a + "o_proj.weight")
        if cfg.o_bias and ld.has_part(a + "o_proj.bias"):
            w["bo"] = ld(a + "o_proj.bias")
        if self.full_qk_norm:
            w["q_norm_full"] = ld(a + "q_norm.weight")
            w["k_norm_full"] = ld(a + "k_norm.weight")
            w["qk_norm_n"] = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim)
            sh = ld.shard
            g = cfg.n_heads // cfg.n_kv_heads
            own = [sh.heads[0] <= k * g < sh.heads[1] for k in range(*sh.kv_heads)]
            if sh.size > 1 and not all(own):  # a KV head shared with a lower rank
                w["k_own"] = be.asarray(np.repeat(np.array(own, np.float32), cfg.head_dim))
        elif cfg.qk_norm:
            w["q_norm"] = norm_weight(ld, cfg, a + "q_norm.weight")
            w["k_norm"] = norm_weight(ld, cfg, a + "k_norm.weight")
        pad = padded_heads(cfg, ld.shard)
        if pad is not None:  # part of a KV group: heads padded to whole groups
            w["q_pad"], w["o_take"] = be.index(pad[1]), be.index(pad[2])
            if be.name == "numpy":  # one token's padded QKV row (layers.attention)
                qd = 2 * cfg.head_dim if self.output_gate else cfg.head_dim
                kv = 1 if cfg.v_from_k else 2  # K (and V) rows after the queries
                w["q_src"] = padded_qkv_source(pad[1], len(pad[2]), qd,
                                               kv * ld.shard.n_kv_heads * cfg.head_dim)
        if self.sinks:
            sinks = ld.np(a + "sinks")  # this rank's query heads
            if pad is not None:  # an empty slot's sink: any finite value (its output is dropped)
                sinks = np.concatenate([sinks, np.zeros(1, np.float32)])[pad[1]]
            w["sinks"] = be.asarray(np.ascontiguousarray(sinks, dtype=np.float32))

    def forward(self, be, cfg: ModelConfig, w: dict, x, step, ck, cv):
        return layers.attention(be, cfg, w, x, step.seqs, ck, cv, step.cos, step.sin,
                                step.scale, cfg.sliding_window if self.sliding else 0,
                                step.sum if self.full_qk_norm else None, self.output_gate)


class MLA:
    """Multi-head latent attention (DeepSeek-V3): optional Q LoRA (``cfg.q_lora_rank``),
    the latent and shared rotary key cached, ``kv_b`` absorbed into per-head blocks."""

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, H = cfg.hidden, cfg.n_heads
        nope, rd, r, vd = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                           cfg.v_head_dim)
        a = "self_attn."
        if cfg.q_lora_rank:
            out = [tensor(i, a + "q_a_proj.weight", "attn_q_a.weight", (cfg.q_lora_rank, D),
                          "matrix"),
                   tensor(i, a + "q_a_layernorm.weight", "attn_q_a_norm.weight",
                          (cfg.q_lora_rank,), "vector"),
                   tensor(i, a + "q_b_proj.weight", "attn_q_b.weight",
                          (H * (nope + rd), cfg.q_lora_rank), "matrix", "mla_q")]
        else:
            out = [tensor(i, a + "q_proj.weight", "attn_q.weight", (H * (nope + rd), D),
                          "matrix", "mla_q")]
        out += [tensor(i, a + "kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight", (r + rd, D),
                       "matrix"),
                tensor(i, a + "kv_a_layernorm.weight", "attn_kv_a_norm.weight", (r,), "vector"),
                # absorbed into per-head (nope, r) and (r, vd) blocks: never quantized
                tensor(i, a + "kv_b_proj.weight", "attn_kv_b.weight", (H * (nope + vd), r),
                       "array", "mla_kvb"),
                tensor(i, a + "o_proj.weight", "attn_output.weight", (D, H * vd), "matrix",
                       "mla_o", 1)]
        return out

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        be, a = ld.be, _p(i) + "self_attn."
        nope, vd, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            w["wq_a"] = ld.w(a + "q_a_proj.weight")
            w["q_a_norm"] = ld(a + "q_a_layernorm.weight")
            w["wq_b"] = ld.w(a + "q_b_proj.weight")
        else:
            w["wq"] = ld.w(a + "q_proj.weight")
        w["wkv_a"] = ld.w(a + "kv_a_proj_with_mqa.weight")
        w["kv_a_norm"] = ld(a + "kv_a_layernorm.weight")
        kvb = ld.np(a + "kv_b_proj.weight").reshape(-1, nope + vd, r)
        w["w_uk"] = be.asarray(kvb[:, :nope, :])  # (H, nope, r)
        w["w_uv_t"] = be.asarray(kvb[:, nope:, :].transpose(0, 2, 1))  # (H, r, vd)
        w["wo"] = ld.w(a + "o_proj.weight")

    def forward(self, be, cfg: ModelConfig, w: dict, x, step, ck, cv, ci=None):
        return layers.latent_attention(be, cfg, w, x, step.seqs, ck, cv, step.cos, step.sin,
                                       step.scale, ci)


class IndexedMLA(MLA):
    """:class:`MLA` with DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): each
    query attends only to the ``cfg.index_topk`` cached tokens the indexer scores highest
    (numerics: :func:`~hpcmac.llm.model.layers.index_keep`). The indexer's query comes from
    the Q LoRA (``q_lora_rank`` required), its key is ``LayerNorm(wk x)`` (``index_head_dim``),
    cached per token beside the latent (:meth:`index_dim`).

    Under tensor parallelism the indexer (small: ``index_n_heads * index_head_dim`` rows) is
    replicated, not split: every tensor rank computes the same top-k for its own heads.
    """

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, Hi, di = cfg.hidden, cfg.index_n_heads, cfg.index_head_dim
        a = "self_attn.indexer."
        return super().tensors(cfg, i) + [
            tensor(i, a + "wq_b.weight", "indexer.attn_q_b.weight", (Hi * di, cfg.q_lora_rank),
                   "matrix"),
            tensor(i, a + "wk.weight", "indexer.attn_k.weight", (di, D), "matrix"),
            tensor(i, a + "k_norm.weight", "indexer.k_norm.weight", (di,), "vector"),
            tensor(i, a + "k_norm.bias", "indexer.k_norm.bias", (di,), "vector"),
            tensor(i, a + "weights_proj.weight", "indexer.proj.weight", (Hi, D), "matrix")]

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        super().load(ld, cfg, i, w)
        a = _p(i) + "self_attn.indexer."
        w["ix_wq"] = ld.w(a + "wq_b.weight")
        w["ix_wk"] = ld.w(a + "wk.weight")
        w["ix_norm_w"] = ld(a + "k_norm.weight")
        w["ix_norm_b"] = ld(a + "k_norm.bias")
        w["ix_wts"] = ld.w(a + "weights_proj.weight")

    @staticmethod
    def index_dim(cfg: ModelConfig) -> int:
        """Width of the indexer's key cached per token (the backend's float32 array)."""
        return cfg.index_head_dim


def _rows(i: int, name: str, gguf: str, shape: tuple[int, ...], kind: str, split: str | None,
          axis: int, form_axis: int, index: Callable, post: str | None = None) -> TensorSpec:
    """A tensor of layer ``i`` that a GGUF file stores as the parts ``gguf`` (``a|b``, each
    under ``blk.{i}.``) whose rows (``form_axis`` 0) or columns (1), concatenated, gathered
    by ``index(cfg)`` -> (indices or None, the parts' lengths) give it; ``post``: ``conv``
    (stored (C, K)) or ``neg_log`` (stored ``-exp(x)``) (read by
    :class:`~hpcmac.llm.model.gguf_loader.GGUFCheckpoint`, written by the fixtures)."""
    names = tuple(f"blk.{i}.{g}" for g in gguf.split("|"))
    return TensorSpec(f"model.layers.{i}.{name}", tuple(int(x) for x in shape), kind, split,
                      axis, None, ("rows", form_axis, index, post, *names))


def _untiled(cfg: ModelConfig, hd: int) -> tuple[np.ndarray, tuple[int]]:
    """Rows of ``hd`` per value head back from llama.cpp's tiled order (Qwen3.5's
    converter: key head ``kh``'s ``r``-th value head at ``r * nk + kh``) to the grouped one
    (at ``kh * g + r``, ``g`` value heads per key head)."""
    nk, nv = cfg.linear_k_heads, cfg.linear_v_heads
    g = nv // nk
    head = np.array([r * nk + kh for kh in range(nk) for r in range(g)])
    return (head[:, None] * hd + np.arange(hd)).reshape(-1), (nv * hd,)


def _qkv_untiled(cfg: ModelConfig) -> tuple[np.ndarray, tuple[int]]:
    """``in_proj_qkv`` (and the conv's channels): q and k as stored, v untiled."""
    qk = 2 * cfg.linear_k_heads * cfg.linear_k_dim
    v, (n,) = _untiled(cfg, cfg.linear_v_dim)
    return np.concatenate([np.arange(qk), qk + v]), (qk + n,)


def _qkvz_rows(cfg: ModelConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: q, k, its value heads' v, their z) from
    llama.cpp's ``attn_qkv`` (every q, every k, every v) and ``attn_gate`` (every z)."""
    nk, dk = cfg.linear_k_heads, cfg.linear_k_dim
    gv = cfg.linear_v_heads // nk * cfg.linear_v_dim
    C = 2 * nk * dk + nk * gv
    rows = [np.concatenate([h * dk + np.arange(dk), nk * dk + h * dk + np.arange(dk),
                            2 * nk * dk + h * gv + np.arange(gv), C + h * gv + np.arange(gv)])
            for h in range(nk)]
    return np.concatenate(rows), (C, nk * gv)


@dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5; numerics:
    :mod:`hpcmac.llm.model.linear_attention`): projections to q, k (``linear_k_heads`` of
    ``linear_k_dim``), v and the output gate z (``linear_v_heads`` of ``linear_v_dim``), the
    write strength b and decay input a (one per value head); a depthwise causal conv
    (``linear_conv_kernel``) over q, k, v; the delta rule; a gated RMSNorm; ``out_proj``.
    Its cache is a conv state and a recurrent state per sequence (:meth:`state_shapes`).

    fused : Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba``, laid out per key head;
        otherwise Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
    """

    fused: bool = False

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, nk, nv = cfg.hidden, cfg.linear_k_heads, cfg.linear_v_heads
        dk, dv = cfg.linear_k_dim, cfg.linear_v_dim
        C, a = 2 * nk * dk + nv * dv, "linear_attn."
        # GGUF: llama.cpp's converter splits Qwen3-Next's in_proj_qkvz into attn_qkv (every
        # q, every k, every v) and attn_gate (z); for Qwen3.5 it reorders the value heads
        # from grouped by key head to tiled (see _untiled); it stores -exp(A_log) and the
        # conv as (C, K)
        tiled = not self.fused
        if self.fused:
            out = [_rows(i, a + "in_proj_qkvz.weight", "attn_qkv.weight|attn_gate.weight",
                         (C + nv * dv, D), "matrix", "lin_qkvz", 0, 0, _qkvz_rows),
                   tensor(i, a + "in_proj_ba.weight", "ssm_ba.weight", (2 * nv, D),
                          "matrix", "lin_ba")]
        else:
            out = [_rows(i, a + "in_proj_qkv.weight", "attn_qkv.weight", (C, D), "matrix",
                         "lin_qkv", 0, 0, _qkv_untiled),
                   _rows(i, a + "in_proj_z.weight", "attn_gate.weight", (nv * dv, D),
                         "matrix", "lin_v", 0, 0, lambda c: _untiled(c, c.linear_v_dim)),
                   _rows(i, a + "in_proj_b.weight", "ssm_beta.weight", (nv, D), "matrix",
                         "lin_heads", 0, 0, lambda c: _untiled(c, 1)),
                   _rows(i, a + "in_proj_a.weight", "ssm_alpha.weight", (nv, D), "matrix",
                         "lin_heads", 0, 0, lambda c: _untiled(c, 1))]
        conv = _qkv_untiled if tiled else (lambda c: (None, (C,)))
        one = (lambda c: _untiled(c, 1)) if tiled else (lambda c: (None, (nv,)))
        return out + [
            _rows(i, a + "conv1d.weight", "ssm_conv1d.weight", (C, 1, cfg.linear_conv_kernel),
                  "array", "lin_qkv", 0, 0, conv, "conv"),
            _rows(i, a + "dt_bias", "ssm_dt.bias", (nv,), "vector", "lin_heads", 0, 0, one),
            _rows(i, a + "A_log", "ssm_a", (nv,), "vector", "lin_heads", 0, 0, one, "neg_log"),
            tensor(i, a + "norm.weight", "ssm_norm.weight", (dv,), "vector"),
            _rows(i, a + "out_proj.weight", "ssm_out.weight", (D, nv * dv), "matrix",
                  "lin_v", 1, 1, (lambda c: _untiled(c, c.linear_v_dim)) if tiled else
                  (lambda c: (None, (nv * dv,))))]

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        be, a = ld.be, _p(i) + "linear_attn."
        names = ["in_proj_qkvz", "in_proj_ba"] if self.fused else \
            ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
        # rows [q | k | v | z | b | a] of this rank's heads: one product for all six
        w["w_lin_in"] = be.weight(concat_rows([ld.raw(a + n + ".weight") for n in names]))
        conv = ld.np(a + "conv1d.weight")
        # the backend's arrays: numpy float32, or MLX (the layer runs in MLX's graph)
        w["conv_w"] = be.asarray(conv.reshape(conv.shape[0], conv.shape[2]))
        w["lin_A"] = be.asarray(-np.exp(ld.np(a + "A_log")))
        w["dt_bias"] = ld(a + "dt_bias")
        w["lin_norm"] = ld(a + "norm.weight")
        w["w_lin_out"] = ld.w(a + "out_proj.weight")
        (v0, v1), (k0, _) = ld.shard.lin_v, ld.shard.lin_k
        g = cfg.linear_v_heads // cfg.linear_k_heads
        w["lin_vk"] = be.index(np.arange(v0, v1) // g - k0)  # each value head's key head, locally

    @staticmethod
    def state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) of one sequence, for ``cfg`` (a rank's own heads)."""
        C = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
        return ((cfg.linear_conv_kernel - 1, C),
                (cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim))

    def forward(self, be, cfg: ModelConfig, w: dict, x, step, conv, state):
        return linear_attention.gated_delta_net(be, cfg, w, x, step.seqs, conv, state)


# -- feed-forward -----------------------------------------------------------------

class MLP:
    """Dense gated MLP, gate and up fused: SwiGLU, or GeGLU where ``cfg.hidden_act`` is
    ``gelu_tanh`` (Gemma); ``cfg.mlp_bias``."""

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, I = cfg.hidden, cfg.intermediate
        out = [tensor(i, "mlp.gate_proj.weight", "ffn_gate.weight", (I, D), "matrix", "ffn"),
               tensor(i, "mlp.up_proj.weight", "ffn_up.weight", (I, D), "matrix", "ffn"),
               tensor(i, "mlp.down_proj.weight", "ffn_down.weight", (D, I), "matrix", "ffn", 1)]
        if cfg.mlp_bias:
            out += [tensor(i, "mlp.gate_proj.bias", "ffn_gate.bias", (I,), "vector", "ffn"),
                    tensor(i, "mlp.up_proj.bias", "ffn_up.bias", (I,), "vector", "ffn"),
                    tensor(i, "mlp.down_proj.bias", "ffn_down.bias", (D,), "vector", "rank0")]
        return out

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        be, m = ld.be, _p(i) + "mlp."
        w["w_gu"] = be.weight(concat_rows(
            [ld.raw(m + "gate_proj.weight"), ld.raw(m + "up_proj.weight")]))
        w["w_down"] = ld.w(m + "down_proj.weight")
        if cfg.mlp_bias:
            w["b_gu"] = be.asarray(np.concatenate(
                [ld.np(m + "gate_proj.bias"), ld.np(m + "up_proj.bias")]))
            if ld.has_part(m + "down_proj.bias"):
                w["b_down"] = ld(m + "down_proj.bias")

    def forward(self, be, cfg: ModelConfig, w: dict, x):
        return layers.mlp(be, w, x, act=cfg.hidden_act)


def softmax_topk(xp, logits, w: dict, cfg: ModelConfig):
    """Softmax over the experts, top ``n_experts_per_tok``, renormalised if
    ``norm_topk_prob`` (Qwen3-MoE)."""
    return layers.route_softmax(xp, logits, cfg.n_experts_per_tok, cfg.norm_topk_prob)


def sigmoid_grouped(xp, logits, w: dict, cfg: ModelConfig):
    """Sigmoid scores, the correction bias for the choice only, group-limited top-k
    (``n_group``, ``topk_group``), ``routed_scaling_factor`` (DeepSeek-V3)."""
    return layers.route_grouped_sigmoid(xp, logits, w["router_bias"], cfg)


def topk_softmax(xp, logits, w: dict, cfg: ModelConfig):
    """The router's bias added (``router_b``), the top ``n_experts_per_tok`` logits,
    softmax over those (gpt-oss)."""
    return layers.route_topk_softmax(xp, logits + w["router_b"], cfg.n_experts_per_tok)


@dataclass(frozen=True)
class MoE:
    """Routed experts (one (E, out, in) stack per projection) chosen by ``route``,
    plus ``cfg.n_shared_experts`` shared experts (one SwiGLU of their summed width).

    route : ``(xp, router logits (T, E) float32, weights, cfg) -> (expert ids (T, k),
        weights (T, k))`` on the backend's arrays (``xp``: numpy or mlx.core)
    correction_bias : the router has ``e_score_correction_bias`` (read as ``router_bias``)
    module : the layer's submodule the tensors are under (``mlp``; Mixtral and MiniMax:
        ``block_sparse_moe``, experts ``w1``/``w3``/``w2``)
    bias_name : the correction bias under ``module`` (DeepSeek: under the router, ``gate``)
    shared : the shared experts' submodule under ``module`` (Qwen3-Next: ``shared_expert``)
    shared_gate : the shared experts' output is scaled by ``sigmoid(shared_expert_gate x)``,
        one logit per token (Qwen3-Next)
    """

    route: Callable = softmax_topk
    correction_bias: bool = False
    module: str = "mlp"
    bias_name: str = "gate.e_score_correction_bias"
    shared: str = "shared_experts"
    shared_gate: bool = False

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, E, I = cfg.hidden, cfg.n_experts, cfg.moe_intermediate
        m = self.module + "."
        out = [tensor(i, m + "gate.weight", "ffn_gate_inp.weight", (E, D), "matrix")]
        if self.correction_bias:
            out.append(tensor(i, m + self.bias_name, "exp_probs_b.bias", (E,), "vector"))
        out += [tensor(i, m + "experts.gate", "ffn_gate_exps.weight", (E, I, D), "matrix",
                       "expert_ffn", 1),
                tensor(i, m + "experts.up", "ffn_up_exps.weight", (E, I, D), "matrix",
                       "expert_ffn", 1),
                tensor(i, m + "experts.down", "ffn_down_exps.weight", (E, D, I), "matrix",
                       "expert_ffn", 2)]
        if cfg.n_shared_experts:
            S = cfg.shared_width
            s = m + self.shared + "."
            out += [tensor(i, s + "gate_proj.weight", "ffn_gate_shexp.weight", (S, D), "matrix",
                           "shared_ffn"),
                    tensor(i, s + "up_proj.weight", "ffn_up_shexp.weight", (S, D), "matrix",
                           "shared_ffn"),
                    tensor(i, s + "down_proj.weight", "ffn_down_shexp.weight", (D, S), "matrix",
                           "shared_ffn", 1)]
            if self.shared_gate:
                out.append(tensor(i, m + "shared_expert_gate.weight", "ffn_gate_inp_shexp.weight",
                                  (1, D), "matrix"))
        return out

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        be, m = ld.be, _p(i) + self.module + "."
        w["router"] = ld.w(m + "gate.weight")
        if self.correction_bias:
            w["router_bias"] = ld(m + self.bias_name)
        gate = ld.raw(m + "experts.gate")
        up = ld.raw(m + "experts.up")
        w["e_gu"] = be.weight(concat_rows([gate, up], axis=1))  # (E, 2I, D)
        del gate, up
        w["e_down"] = be.weight(ld.raw(m + "experts.down"))
        if cfg.n_shared_experts:
            s = m + self.shared + "."
            w["s_w_gu"] = be.weight(concat_rows(
                [ld.raw(s + "gate_proj.weight"), ld.raw(s + "up_proj.weight")]))
            w["s_w_down"] = ld.w(s + "down_proj.weight")
            if self.shared_gate:
                w["s_gate"] = ld.w(m + "shared_expert_gate.weight")

    def forward(self, be, cfg: ModelConfig, w: dict, x):
        return layers.moe(be, cfg, w, x, self.route)


class InterleavedMoE:
    """Routed experts as gpt-oss stores them: ``mlp.experts.gate_up_proj`` (E, hidden, 2I)
    with gate and up columns interleaved (gate 2j, up 2j+1), ``gate_up_proj_bias`` (E, 2I),
    ``down_proj`` (E, I, hidden), ``down_proj_bias`` (E, hidden) (inputs first: x @ W);
    a router with a bias (``mlp.router``) choosing by :func:`topk_softmax`; the clamped
    SwiGLU (``cfg.swiglu_limit``, ``cfg.swiglu_alpha``). Loaded into the :class:`MoE`
    layout (gate rows, then up rows, each (out, in)), so the forward is the same."""

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, E, I = cfg.hidden, cfg.n_experts, cfg.moe_intermediate
        e = "mlp.experts."
        # llama.cpp's gpt-oss files split gate and up (or, from newer converters, hold
        # gate's rows then up's in ffn_gate_up_exps) and store each expert (out, in)
        gu = "ffn_gate_exps.{0}|ffn_up_exps.{0}|ffn_gate_up_exps.{0}"
        experts = [tensor(i, e + "gate_up_proj", gu.format("weight"), (E, D, 2 * I), "matrix",
                          "expert_ffn_pairs", 2, form="pairs_t"),
                   tensor(i, e + "gate_up_proj_bias", gu.format("bias"), (E, 2 * I), "vector",
                          "expert_ffn_pairs", 1, form="pairs"),
                   tensor(i, e + "down_proj", "ffn_down_exps.weight", (E, I, D), "matrix",
                          "expert_ffn", 1, form="t"),
                   tensor(i, e + "down_proj_bias", "ffn_down_exps.bias", (E, D), "vector",
                          "rank0", 1)]
        return [tensor(i, "mlp.router.weight", "ffn_gate_inp.weight", (E, D), "matrix"),
                tensor(i, "mlp.router.bias", "ffn_gate_inp.bias", (E,), "vector"), *experts]

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        be, m = ld.be, _p(i) + "mlp."
        w["router"] = ld.w(m + "router.weight")
        w["router_b"] = ld(m + "router.bias")
        gu = ld.raw_t(m + "experts.gate_up_proj")  # kept MXFP4: (E, 2I, D), rows pairs
        if gu is not None:
            w["e_gu"] = be.weight(concat_rows([gu.map(lambda a: a[:, 0::2]),
                                               gu.map(lambda a: a[:, 1::2])], axis=1))
        else:
            gu = ld.np(m + "experts.gate_up_proj")  # (E, D, 2I) this rank's column pairs
            w["e_gu"] = be.weight(np.ascontiguousarray(
                np.concatenate([gu[:, :, 0::2], gu[:, :, 1::2]], axis=2).transpose(0, 2, 1)))
        del gu
        b = ld.np(m + "experts.gate_up_proj_bias")  # (E, 2I)
        w["e_b_gu"] = be.asarray(np.ascontiguousarray(
            np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1)))
        down = ld.raw_t(m + "experts.down_proj")  # kept MXFP4 (E, D, I), else None
        w["e_down"] = be.weight(down if down is not None else np.ascontiguousarray(
            ld.np(m + "experts.down_proj").transpose(0, 2, 1)))  # (E, D, I)
        if ld.has_part(m + "experts.down_proj_bias"):  # added once, after the sum
            w["e_b_down"] = be.asarray(ld.np(m + "experts.down_proj_bias"))

    def forward(self, be, cfg: ModelConfig, w: dict, x):
        return layers.moe(be, cfg, w, x, topk_softmax)


class ResidualRoutedExperts:
    """Gemma 4's routed experts, beside its dense MLP: ``router.proj`` (E, hidden),
    ``router.scale`` (hidden,) and ``router.per_expert_scale`` (E,) choose from the layer's
    residual (:func:`~hpcmac.llm.model.layers.route_gemma4`); the experts
    (``experts.gate_up_proj`` (E, 2I, hidden), ``experts.down_proj``, directly under the
    layer, GeGLU) read it normalised by ``pre_feedforward_layernorm_2``, and their sum is
    normalised by ``post_feedforward_layernorm_2`` (:class:`SandwichLayer` adds it to the
    MLP's, normalised by ``post_feedforward_layernorm_1``). The router is replicated under
    tensor parallelism, the experts' columns split."""

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, E, I = cfg.hidden, cfg.n_experts, cfg.moe_intermediate
        return [tensor(i, "router.proj.weight", "ffn_gate_inp.weight", (E, D), "matrix"),
                tensor(i, "router.scale", "ffn_gate_inp.scale", (D,), "vector"),
                tensor(i, "router.per_expert_scale", "ffn_down_exps.scale", (E,), "vector"),
                tensor(i, "experts.gate", "ffn_gate_exps.weight", (E, I, D), "matrix",
                       "expert_ffn", 1),
                tensor(i, "experts.up", "ffn_up_exps.weight", (E, I, D), "matrix",
                       "expert_ffn", 1),
                tensor(i, "experts.down", "ffn_down_exps.weight", (E, D, I), "matrix",
                       "expert_ffn", 2),
                *[tensor(i, f"{n}.weight", f"{g}.weight", (D,), "vector") for n, g in (
                    ("pre_feedforward_layernorm_2", "pre_ffw_norm_2"),
                    ("post_feedforward_layernorm_1", "post_ffw_norm_1"),
                    ("post_feedforward_layernorm_2", "post_ffw_norm_2"))]]

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        be, p = ld.be, _p(i)
        w["router"] = ld.w(p + "router.proj.weight")
        w["router_scale"] = be.asarray(ld.np(p + "router.scale")
                                       * np.float32(cfg.hidden ** -0.5))
        w["router_ones"] = be.asarray(np.ones(cfg.hidden, np.float32))
        w["per_expert_scale"] = ld(p + "router.per_expert_scale")
        gate, up = ld.raw(p + "experts.gate"), ld.raw(p + "experts.up")
        w["e_gu"] = be.weight(concat_rows([gate, up], axis=1))  # (E, 2I, D)
        del gate, up
        w["e_down"] = be.weight(ld.raw(p + "experts.down"))
        for k, n in (("ln2_moe", "pre_feedforward_layernorm_2"),
                     ("ln2_post_mlp", "post_feedforward_layernorm_1"),
                     ("ln2_post_moe", "post_feedforward_layernorm_2")):
            w[k] = norm_weight(ld, cfg, p + f"{n}.weight")

    def forward(self, be, cfg: ModelConfig, w: dict, x):
        """The experts' partial output (T, hidden) for the residual ``x`` (this rank's
        columns of each expert; the caller sums and normalises)."""
        idx, wts = layers.route_gemma4(be, cfg, w, x)
        return layers.routed_experts(be, cfg, w, be.rms_norm(x, w["ln2_moe"], cfg.norm_eps),
                                     idx, wts)


# -- the layer ----------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    """A pre-norm decoder layer: ``x += attention(rms_norm(x))``, ``x += ffn(rms_norm(x))``
    (``input_layernorm``, ``post_attention_layernorm``)."""

    attention: object
    ffn: object
    #: the GGUF name of ``post_attention_layernorm`` (llama.cpp's ``ffn_norm``; gpt-oss,
    #: GLM-4.x and Qwen3-Next files: ``post_attention_norm``)
    gguf_post_norm: str = "ffn_norm"

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D = cfg.hidden
        return [tensor(i, "input_layernorm.weight", "attn_norm.weight", (D,), "vector"),
                tensor(i, "post_attention_layernorm.weight", f"{self.gguf_post_norm}.weight",
                       (D,), "vector"),
                *self.attention.tensors(cfg, i), *self.ffn.tensors(cfg, i)]

    def load(self, ld, cfg: ModelConfig, i: int) -> dict:
        p = _p(i)
        w: dict = {"ln1": norm_weight(ld, cfg, p + "input_layernorm.weight"),
                   "ln2": norm_weight(ld, cfg, p + "post_attention_layernorm.weight")}
        self.attention.load(ld, cfg, i, w)
        self.ffn.load(ld, cfg, i, w)
        return w

    def forward(self, be, cfg: ModelConfig, w: dict, x, step, ck, cv, ci=None):
        """``ci``: the layer's third cache array where its attention keeps one (the
        indexer's keys of :class:`IndexedMLA`), else None."""
        caches = (ck, cv) if ci is None else (ck, cv, ci)
        a = self.attention.forward(be, cfg, w, be.rms_norm(x, w["ln1"], cfg.norm_eps), step,
                                   *caches)
        x, y = be.add_rms_norm(x, step.sum(a), w["ln2"], cfg.norm_eps)
        return x + step.sum(self.ffn.forward(be, cfg, w, y))


@dataclass(frozen=True)
class SandwichLayer:
    """Gemma's decoder layer: each block's input and its output normalised,
    ``x += norm(attention(norm x))``, ``x += norm(ffn(norm x))`` (``input_layernorm``,
    ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
    ``post_feedforward_layernorm``); with ``scalar``, the layer's output multiplied by its
    ``layer_scalar`` (Gemma 4); with ``experts`` (:class:`ResidualRoutedExperts`), routed
    experts beside the MLP, ``x += norm(norm1(mlp) + norm2(experts))``. Under tensor
    parallelism the output norms follow the sums."""

    attention: object
    ffn: object
    scalar: bool = False
    experts: object = None

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D = cfg.hidden
        out = [tensor(i, f"{n}.weight", f"{g}.weight", (D,), "vector") for n, g in (
            ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"))]
        out += [*self.attention.tensors(cfg, i), *self.ffn.tensors(cfg, i)]
        if self.experts is not None:
            out += self.experts.tensors(cfg, i)
        if self.scalar:
            out.append(tensor(i, "layer_scalar", "layer_output_scale.weight", (1,), "vector"))
        return out

    def load(self, ld, cfg: ModelConfig, i: int) -> dict:
        p = _p(i)
        w: dict = {k: norm_weight(ld, cfg, p + f"{n}.weight") for k, n in (
            ("ln1", "input_layernorm"), ("ln1_post", "post_attention_layernorm"),
            ("ln2", "pre_feedforward_layernorm"), ("ln2_post", "post_feedforward_layernorm"))}
        self.attention.load(ld, cfg, i, w)
        self.ffn.load(ld, cfg, i, w)
        if self.experts is not None:
            self.experts.load(ld, cfg, i, w)
        if self.scalar:
            w["scalar"] = ld(p + "layer_scalar")
        return w

    def forward(self, be, cfg: ModelConfig, w: dict, x, step, ck, cv, ci=None):
        eps = cfg.norm_eps
        a = self.attention.forward(be, cfg, w, be.rms_norm(x, w["ln1"], eps), step, ck, cv)
        x = x + be.rms_norm(step.sum(a), w["ln1_post"], eps)
        f = step.sum(self.ffn.forward(be, cfg, w, be.rms_norm(x, w["ln2"], eps)))
        if self.experts is not None:
            e = step.sum(self.experts.forward(be, cfg, w, x))
            f = be.rms_norm(f, w["ln2_post_mlp"], eps) + be.rms_norm(e, w["ln2_post_moe"], eps)
        x = x + be.rms_norm(f, w["ln2_post"], eps)
        return x * w["scalar"] if self.scalar else x
