"""A pipeline stage of the decoder: layers ``[start, end)`` of a checkpoint on one rank.

The whole model on one rank is the stage ``load_stage(path, 0, n_layers, first=True,
last=True)``. A stage loads only its own tensors (plus the embedding on the first
stage and the final norm and head on the last; a tied head loads the embedding
on the last stage). Nothing here communicates: part 2 moves the activations.

Packed batches: ``h`` is (T_total, hidden) for all new tokens of all sequences in
a step, sequence after sequence; :class:`Batch` says for each sequence its cache
slot, how many new tokens it has and the position of the first one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.backend import QWeight, get_backend, release_freed_memory
from hpcmac.llm.model.cache import KVCache
from hpcmac.llm.model.config import ModelConfig
from hpcmac.llm.model.layers import attention, latent_attention, mlp, moe
from hpcmac.llm.model.qkernels import NQWeight
from hpcmac.llm.model.quant import QuantTensor, as_float, concat_rows
from hpcmac.llm.model.rope import cos_sin, rope_frequencies, softmax_scale
from hpcmac.llm.model.weights import open_checkpoint


@dataclass
class Batch:
    """One step over several sequences (local to the stage, same on every stage).

    slots : cache slot of each sequence
    lengths : number of new tokens of each sequence in this step (prefill: the
        prompt or a chunk of it; decode: 1)
    positions : position of each sequence's first new token (tokens already cached)
    """

    slots: list[int]
    lengths: list[int]
    positions: list[int]
    _seqs: list = field(default=None, repr=False)

    def __post_init__(self):
        if not (len(self.slots) == len(self.lengths) == len(self.positions)):
            raise ValueError("Batch: slots, lengths and positions must have the same length")

    @property
    def total(self) -> int:
        """T_total: rows of the packed activations."""
        return int(sum(self.lengths))

    def seqs(self) -> list[tuple[int, int, int, int]]:
        """(slot, row offset, n_new, start position) per sequence."""
        if self._seqs is None:
            offs = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(int)
            self._seqs = [(int(s), int(o), int(n), int(p)) for s, o, n, p in
                          zip(self.slots, offs, self.lengths, self.positions)]
        return self._seqs

    def token_positions(self) -> np.ndarray:
        """(T_total,) position of every packed token."""
        return np.concatenate([np.arange(p, p + n) for p, n in
                               zip(self.positions, self.lengths)]).astype(np.int64)


class Stage:
    """Layers ``[start, end)`` of a model, ready to run (see module docstring)."""

    def __init__(self, config: ModelConfig, start: int, end: int, first: bool, last: bool,
                 backend, layers: list[dict], extra: dict, nbytes: int):
        self.config, self.start, self.end = config, start, end
        self.first, self.last = first, last
        self.backend = backend
        self.layers = layers
        self.extra = extra
        self.nbytes = nbytes
        self._inv_freq, self._att = rope_frequencies(config)
        self._scale = softmax_scale(config)

    def new_cache(self, max_slots: int, max_len: int) -> KVCache:
        """An empty KV cache of this stage's layers."""
        return KVCache(self.config, self.start, self.end, max_slots, max_len, self.backend)

    def embed(self, tokens) -> np.ndarray:
        """(T_total,) int token ids -> (T_total, hidden) float32 [first stage]."""
        if "embed" not in self.extra:
            raise RuntimeError("embed() called on a stage without the embedding")
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.size and (tok.min() < 0 or tok.max() >= self.config.vocab):
            raise UsageError(f"token id {int(tok.max() if tok.max() >= 0 else tok.min())} "
                             f"is outside the vocabulary [0, {self.config.vocab})")
        if "embed_q" in self.extra:  # kept quantized: dequantize the rows looked up
            return self.backend.rows(self.extra["embed_q"], tok)
        return np.ascontiguousarray(self.extra["embed_np"][tok])

    def forward(self, h, batch: Batch, cache: KVCache) -> np.ndarray:
        """Run this stage's layers on packed ``h`` (T_total, hidden); appends to ``cache``."""
        be = self.backend
        if h.shape[0] != batch.total:
            raise ValueError(f"forward: h has {h.shape[0]} rows, the batch {batch.total} tokens")
        for slot, _, n, pos in batch.seqs():
            if pos + n > cache.max_len:
                raise UsageError(f"sequence needs {pos + n} positions; the context "
                                 f"(cache) holds {cache.max_len}")
            if pos > cache.lengths[slot]:
                raise ValueError(f"slot {slot}: position {pos} skips past the "
                                 f"{cache.lengths[slot]} cached tokens")
        cos, sin = cos_sin(self._inv_freq, self._att, batch.token_positions())
        cos, sin = be.asarray(cos[:, None, :]), be.asarray(sin[:, None, :])
        x = be.asarray(h)
        seqs = batch.seqs()
        cfg = self.config
        attn = latent_attention if cfg.mla else attention
        for j, w in enumerate(self.layers):
            a = attn(be, cfg, w, be.rms_norm(x, w["ln1"], cfg.norm_eps), seqs,
                     cache.k[j], cache.v[j], cos, sin, self._scale)
            x = x + a
            y = be.rms_norm(x, w["ln2"], cfg.norm_eps)
            x = x + (moe(be, cfg, w, y) if "router" in w else mlp(be, w, y))
        be.eval(x, *cache.k, *cache.v)
        for slot, _, n, pos in seqs:
            cache.lengths[slot] = pos + n
        return be.to_numpy(x)

    def logits(self, h) -> np.ndarray:
        """(n, hidden) -> (n, vocab) float32: final norm and head [last stage]."""
        if "norm" not in self.extra:
            raise RuntimeError("logits() called on a stage without the head")
        be = self.backend
        x = be.rms_norm(be.asarray(h), self.extra["norm"], self.config.norm_eps)
        out = be.linear(x, self.extra["head"])
        be.eval(out)
        return be.to_numpy(out)


# -- loading ------------------------------------------------------------------

class _Loader:
    """Reads canonical tensors from a checkpoint and checks their shapes."""

    def __init__(self, ckpt, backend, keep_quantized: bool = True):
        self.ckpt, self.be = ckpt, backend
        self.keep = keep_quantized and hasattr(ckpt, "get_weight")
        self.nbytes = 0
        #: what was kept quantized: source ("gguf Q4_1", "mlx q4 g64") -> tensors
        self.formats: dict[str, int] = {}

    def _check(self, name: str, shape: tuple) -> None:
        found = tuple(self.ckpt.shape(name))
        if found != tuple(shape):
            raise UsageError(f"{self.ckpt.path}: tensor {name} has shape {list(found)}; "
                             f"expected {list(shape)}")

    def np(self, name: str, shape: tuple) -> np.ndarray:
        """A tensor as float32 (dequantized if stored quantized)."""
        self._check(name, shape)
        w = self.ckpt.get(name)
        self.nbytes += w.nbytes
        return w

    def raw(self, name: str, shape: tuple):
        """A matrix as stored: a QuantTensor kept quantized, else float32."""
        self._check(name, shape)
        w = self.ckpt.get_weight(name) if self.keep else self.ckpt.get(name)
        self._count(w)
        return w

    def _count(self, w) -> None:
        self.nbytes += w.nbytes
        if isinstance(w, QuantTensor):
            self.formats[w.source] = self.formats.get(w.source, 0) + 1

    def __call__(self, name: str, shape: tuple):
        """A vector or a norm weight, as a backend array."""
        return self.be.asarray(self.np(name, shape))

    def w(self, name: str, shape: tuple):
        """A matrix used by ``backend.linear`` (stored the backend's way)."""
        return self.be.weight(self.raw(name, shape))

    def experts(self, layer: int, which: str, shape: tuple):
        w = self.ckpt.experts(layer, which, keep_quant=self.keep)
        if tuple(w.shape) != tuple(shape):
            raise UsageError(f"{self.ckpt.path}: experts '{which}' of layer {layer} have shape "
                             f"{list(w.shape)}; expected {list(shape)}")
        self._count(w)
        return w


def _load_layer(ld: _Loader, cfg: ModelConfig, i: int) -> dict:
    """Weights of global layer ``i`` in the backend's arrays, projections fused."""
    be = ld.be
    D = cfg.hidden
    p = f"model.layers.{i}."
    a = p + "self_attn."
    w: dict = {"ln1": ld(p + "input_layernorm.weight", (D,)),
               "ln2": ld(p + "post_attention_layernorm.weight", (D,))}
    H = cfg.n_heads
    if cfg.mla:
        nope, rd, r, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, \
            cfg.v_head_dim
        if cfg.q_lora_rank:
            w["wq_a"] = ld.w(a + "q_a_proj.weight", (cfg.q_lora_rank, D))
            w["q_a_norm"] = ld(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
            w["wq_b"] = ld.w(a + "q_b_proj.weight", (H * (nope + rd), cfg.q_lora_rank))
        else:
            w["wq"] = ld.w(a + "q_proj.weight", (H * (nope + rd), D))
        w["wkv_a"] = ld.w(a + "kv_a_proj_with_mqa.weight", (r + rd, D))
        w["kv_a_norm"] = ld(a + "kv_a_layernorm.weight", (r,))
        kvb = ld.np(a + "kv_b_proj.weight", (H * (nope + vd), r)).reshape(H, nope + vd, r)
        w["w_uk"] = be.asarray(kvb[:, :nope, :])  # (H, nope, r)
        w["w_uv_t"] = be.asarray(kvb[:, nope:, :].transpose(0, 2, 1))  # (H, r, vd)
        w["wo"] = ld.w(a + "o_proj.weight", (D, H * vd))
    else:
        KV, d = cfg.n_kv_heads, cfg.head_dim
        qkv = [ld.raw(a + "q_proj.weight", (H * d, D)),
               ld.raw(a + "k_proj.weight", (KV * d, D)), ld.raw(a + "v_proj.weight", (KV * d, D))]
        w["wqkv"] = be.weight(concat_rows(qkv))
        if cfg.attention_bias:
            w["bqkv"] = be.asarray(np.concatenate(
                [ld.np(a + "q_proj.bias", (H * d,)), ld.np(a + "k_proj.bias", (KV * d,)),
                 ld.np(a + "v_proj.bias", (KV * d,))]))
        w["wo"] = ld.w(a + "o_proj.weight", (D, H * d))
        if cfg.o_bias:
            w["bo"] = ld(a + "o_proj.bias", (D,))
        if cfg.qk_norm:
            w["q_norm"] = ld(a + "q_norm.weight", (d,))
            w["k_norm"] = ld(a + "k_norm.weight", (d,))
    m = p + "mlp."
    if cfg.is_moe_layer(i):
        E, I = cfg.n_experts, cfg.moe_intermediate
        w["router"] = ld.w(m + "gate.weight", (E, D))
        if cfg.arch == "deepseek_v3":
            w["router_bias"] = ld.np(m + "gate.e_score_correction_bias", (E,))
        gate = ld.experts(i, "gate", (E, I, D))
        up = ld.experts(i, "up", (E, I, D))
        w["e_gu"] = be.weight(concat_rows([gate, up], axis=1))  # (E, 2I, D)
        del gate, up
        w["e_down"] = be.weight(ld.experts(i, "down", (E, D, I)))
        if cfg.n_shared_experts:
            S = I * cfg.n_shared_experts
            s = m + "shared_experts."
            w["s_w_gu"] = be.weight(concat_rows(
                [ld.raw(s + "gate_proj.weight", (S, D)), ld.raw(s + "up_proj.weight", (S, D))]))
            w["s_w_down"] = ld.w(s + "down_proj.weight", (D, S))
    else:
        I = cfg.intermediate
        w["w_gu"] = be.weight(concat_rows(
            [ld.raw(m + "gate_proj.weight", (I, D)), ld.raw(m + "up_proj.weight", (I, D))]))
        w["w_down"] = ld.w(m + "down_proj.weight", (D, I))
        if cfg.mlp_bias:
            w["b_gu"] = be.asarray(np.concatenate(
                [ld.np(m + "gate_proj.bias", (I,)), ld.np(m + "up_proj.bias", (I,))]))
            w["b_down"] = ld(m + "down_proj.bias", (D,))
    return w


def load_stage(path_or_name: str | os.PathLike, start: int, end: int, first: bool = True,
               last: bool = True, backend: str = "numpy", quantize: int | None = None,
               group_size: int = 64, keep_quantized: bool = True) -> Stage:
    """Load layers ``[start, end)`` (global indices) of a model folder or GGUF file.

    Parameters
    ----------
    path_or_name : model folder (config.json + safetensors), GGUF file, or a
        short name such as ``smollm2`` (global).
    start, end : half-open global layer range of this stage.
    first : also load the token embedding (this stage embeds).
    last : also load the final norm and the head (this stage makes logits).
    backend : ``numpy`` or ``mlx``.
    quantize, group_size : keep the matrices quantized to ``quantize`` bits
        per weight, one scale and bias per ``group_size`` inputs (MLX only).
    keep_quantized : keep weights the checkpoint stores quantized (MLX affine
        safetensors, the exact GGUF types) as they are (default); False
        dequantizes every weight to float32 (the reference the tests compare with).
    """
    be = get_backend(backend, quantize, group_size)
    ckpt = open_checkpoint(path_or_name)
    cfg = ckpt.config()
    if not (0 <= start <= end <= cfg.n_layers):
        raise UsageError(f"layer range [{start}, {end}) is outside the model's "
                         f"{cfg.n_layers} layers")
    ld = _Loader(ckpt, be, keep_quantized)
    extra: dict = {}
    if first or (last and cfg.tie_embeddings):
        emb = ld.raw("model.embed_tokens.weight", (cfg.vocab, cfg.hidden))
        packed = be.weight(emb) if quantize or isinstance(emb, QuantTensor) else None
        if first:
            extra["embed"] = True
            if isinstance(packed, (QWeight, NQWeight)):  # one quantized copy: lookup, tied head
                extra["embed_q"] = packed
            else:
                emb = as_float(emb)
                extra["embed_np"] = emb
        if last and cfg.tie_embeddings:
            extra["head"] = packed if packed is not None else be.weight(emb)
    layers = [_load_layer(ld, cfg, i) for i in range(start, end)]
    if last:
        extra["norm"] = ld("model.norm.weight", (cfg.hidden,))
        if not cfg.tie_embeddings:
            extra["head"] = ld.w("lm_head.weight", (cfg.vocab, cfg.hidden))
    stage = Stage(cfg, start, end, first, last, be, layers, extra, ld.nbytes)
    stage.formats = dict(ld.formats)
    release_freed_memory()
    return stage
