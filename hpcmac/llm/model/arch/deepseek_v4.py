"""DeepSeek-V4 (``deepseek_v4``): hyper-connected layers over three attention kinds.

The math (transformers 5.25's ``modeling_deepseek_v4``, run here in numpy float32):

* Residual: ``hc_mult`` streams per token, (T, n, D); the embedding repeated n times. Before
  each block a hyper-connection (``hc_attn_*``, ``hc_ffn_*``: ``fn`` ((2+n)n, nD), ``base``,
  ``scale`` (3,)) reads the streams: ``m = fn · rms(flat streams)``, split into pre (n),
  post (n), comb (n x n); ``pre = sigmoid(m s0 + b) + eps``, ``post = 2 sigmoid(m s1 + b)``,
  ``comb = softmax_rows(m s2 + b) + eps`` then Sinkhorn (columns, then ``iters - 1`` times
  rows and columns, each sum ``+ eps``); the block reads ``Σ pre_j X_j``, normalised by its
  RMSNorm (``attn_norm``, ``ffn_norm``), and the streams become
  ``X'_k = post_k · out + Σ_j comb_jk X_j``. After the last layer ``hc_head`` collapses them
  (``pre`` only, one scale) before the final norm.
* Attention (every kind): one shared K = V head (MQA) of ``head_dim``; Q through a LoRA
  (``wq_a``, weighted RMSNorm ``q_norm``, ``wq_b``), each query head RMS-normalised without a
  weight; the key ``norm(wkv x)``; interleaved rope on the *last* ``qk_rope_head_dim`` of
  each head (sliding layers: ``rope_theta``; compressed layers: ``compress_rope_theta`` and
  the compress rope's scaling); a learned sink per head in the softmax; the output's rope
  slice rotated back by its query's angle; the grouped output projection (``wo_a``: each of
  ``o_groups`` head groups to ``o_lora_rank``; ``wo_b`` to the model width).
  Sliding (``sliding_attention``): keys of the last ``sliding_window`` positions.
  HCA (``heavily_compressed_attention``, rate m): plus one entry per closed window of m tokens,
  ``norm(Σ_j softmax_j(wgate x_j + ape_j) ⊙ wkv x_j)`` roped at the window's first position;
  a query at p sees the windows closed by p (``w < (p + 1) // m``).
  CSA (``compressed_sparse_attention``): entries of width-2m overlapping windows (each token
  projects to two halves: the first joins the next window's entry, the second its own), and
  a lightning indexer (its own compressor at ``index_head_dim``; queries
  ``rope(wq_b q_lora)`` of ``index_n_heads``; score ``Σ_h w_h relu(q_h · k) / sqrt(dim)``,
  ``w = weights_proj x / sqrt(heads)``) keeps each query's ``index_topk`` best closed entries.
* Feed-forward: routed experts (``w1`` gate, ``w3`` up, ``w2`` down: SwiGLU with the gate
  clamped above and up clamped both ways at ``swiglu_limit``) plus a shared expert of the same
  form; routing scores ``sqrtsoftplus`` (or ``sigmoid``) of the gate's logits, experts chosen
  by top-k of score + ``gate.bias`` (``moe`` layers) or by the token's row of the fixed
  ``gate.tid2eid`` table (``hash_moe`` layers); weights the chosen scores renormalised, times
  ``routed_scaling_factor``.

The cache (per layer, per token): the roped K = V in the KV cache's K, and no V
(``keeps_v``: none allocated, none counted by the planners); for a compressed layer
the compressors' raw projections (``wkv x``, ``wgate x``, the indexer's too) in its third
array (:meth:`CompressedAttention.index_dim`), from which every step rebuilds the closed
windows' entries: exact across prefill chunks, decode and sequences batched together, with
no state to carry (prefix blocks copy it as they copy keys).

Parallel layouts: tensor parallelism splits the query heads (``wq_b`` rows, the sinks; the
grouped output projection is read per head, so a group may split between ranks: each rank's
partial ``wo_b`` output is summed) and the routed and shared experts' columns; the K = V head,
the compressors, the indexer, the routers and the hyper-connections are replicated (every
rank computes the same streams). Pipeline stages hand on all ``hc_mult`` streams
(:attr:`~hpcmac.llm.model.arch.fields.ModelConfig.residual_width`); a hash-routed layer must
sit on the stage that embeds (it reads the token ids: ``Step.tokens``), refused in one line
otherwise. Numpy backend only (MLX refused in one line); no GGUF or quantized form.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch.base import Family
from hpcmac.llm.model.arch.fields import ModelConfig, hf_fields, json_float, json_int
from hpcmac.llm.model.spec import TensorSpec

_KINDS = {"sliding_attention": 0, "compressed_sparse_attention": 4,
          "heavily_compressed_attention": 128}
_F32 = np.float32


def _fam(cfg: ModelConfig) -> dict:
    return cfg.family


def from_hf(raw: dict, where: str) -> ModelConfig:
    f = hf_fields(raw, where)
    n, H = f["n_layers"], f["n_heads"]
    if f["n_kv_heads"] != 1:
        raise UsageError(f"{where}: field 'num_key_value_heads' = {f['n_kv_heads']}: expected "
                         "1 (DeepSeek-V4's one shared key/value head)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"{where}: field 'hidden_act' = {act!r}: expected 'silu'")
    hd = f["head_dim"]
    prf = json_float(raw, "partial_rotary_factor", where,
                     json_int(raw, "qk_rope_head_dim", where, 64) / hd)
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    given = dict(raw.get("compress_rates") or {})
    for legacy, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                         ("compress_rate_hca", "heavily_compressed_attention")):
        if raw.get(legacy) is not None:  # older configs' top-level rates
            given[kind] = raw[legacy]
    for k, v in given.items():
        if k not in rates:
            raise UsageError(f"{where}: field 'compress_rates' key {k!r}: expected "
                             "compressed_sparse_attention or heavily_compressed_attention")
        rates[k] = json_int({k: v}, k, where)
        if rates[k] < 1:
            raise UsageError(f"{where}: field 'compress_rates.{k}' = {v}: expected >= 1")
    types = raw.get("layer_types")
    ratios = raw.get("compress_ratios")  # the releases' per-layer 0 / 4 / 128
    if types is None and ratios is not None:
        by_ratio = {0: "sliding_attention", 4: "compressed_sparse_attention",
                    128: "heavily_compressed_attention"}
        if not isinstance(ratios, list) or any(r not in by_ratio for r in ratios):
            raise UsageError(f"{where}: field 'compress_ratios' = {ratios!r}: expected a list "
                             "of 0, 4 or 128")
        types = [by_ratio[r] for r in ratios][:n]
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA in turn
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))]
    if not isinstance(types, list) or len(types) != n or any(t not in _KINDS for t in types):
        raise UsageError(f"{where}: field 'layer_types': expected a list of {n} entries, each "
                         f"{', '.join(map(repr, _KINDS))}, found {types!r}")
    mlp = raw.get("mlp_layer_types")
    if mlp is None:  # the first num_hash_layers (3) hash-routed
        k = json_int(raw, "num_hash_layers", where, 3)
        mlp = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
    if not isinstance(mlp, list) or len(mlp) != n or any(t not in ("hash_moe", "moe")
                                                         for t in mlp):
        raise UsageError(f"{where}: field 'mlp_layer_types': expected a list of {n} entries, "
                         f"each 'hash_moe' or 'moe', found {mlp!r}")
    score = raw.get("scoring_func", "sqrtsoftplus")
    if score not in ("sqrtsoftplus", "sigmoid"):
        raise UsageError(f"{where}: field 'scoring_func' = {score!r}: expected "
                         "'sqrtsoftplus' or 'sigmoid'")
    groups = json_int(raw, "o_groups", where, 8)
    if groups < 1 or H % groups:
        raise UsageError(f"{where}: field 'o_groups' = {groups}: expected a divisor of "
                         f"num_attention_heads ({H})")
    ropes = _ropes(raw, where)
    hc = json_int(raw, "hc_mult", where, 4)
    fam = dict(
        hc_iters=json_int(raw, "hc_sinkhorn_iters", where, 20),
        hc_eps=json_float(raw, "hc_eps", where, 1e-6),
        rates=rates, mlp_types=list(mlp), score=score, o_groups=groups,
        o_lora_rank=json_int(raw, "o_lora_rank", where, 1024), ropes=ropes)
    if hc < 1 or fam["hc_iters"] < 1:
        raise UsageError(f"{where}: fields 'hc_mult' and 'hc_sinkhorn_iters': expected >= 1")
    moe_i = json_int(raw, "moe_intermediate_size", where, 2048)
    cfg = ModelConfig(
        **{**f, "intermediate": moe_i, "rope_theta": ropes["main"][0],
           "rope_scaling": {"rope_type": "default"}},
        partial_rotary_factor=prf, layer_types=list(types),
        sliding_window=json_int(raw, "sliding_window", where, 128),
        n_experts=json_int(raw, "n_routed_experts", where, 256),
        n_experts_per_tok=json_int(raw, "num_experts_per_tok", where, 6),
        moe_intermediate=moe_i, n_shared_experts=json_int(raw, "n_shared_experts", where, 1),
        shared_intermediate=moe_i,
        routed_scaling_factor=json_float(raw, "routed_scaling_factor", where, 1.5),
        swiglu_limit=json_float(raw, "swiglu_limit", where, 10.0),
        q_lora_rank=json_int(raw, "q_lora_rank", where, 1024),
        index_n_heads=json_int(raw, "index_n_heads", where, 64),
        index_head_dim=json_int(raw, "index_head_dim", where, 128),
        index_topk=json_int(raw, "index_topk", where, 512), family=fam, residual_streams=hc)
    if cfg.rope_dim > cfg.index_head_dim and "compressed_sparse_attention" in types:
        raise UsageError(f"{where}: field 'index_head_dim' = {cfg.index_head_dim}: expected at "
                         f"least the rotated {cfg.rope_dim}")
    return cfg


def _ropes(raw: dict, where: str) -> dict:
    """label -> (theta, rope params) of the ``main`` (sliding layers) and ``compress``
    (compressed layers, their compressors and indexer) ropes, as transformers reads them: a
    nested ``rope_parameters`` as it is; otherwise the flat one (or ``rope_scaling``) is the
    compress rope's scaling (YaRN in the releases, its attention factor 1 unless given) and
    the main rope is the default one at ``rope_theta``."""
    rp = raw.get("rope_parameters") or {}
    if not isinstance(rp, dict):
        raise UsageError(f"{where}: field 'rope_parameters': expected an object")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, comp = dict(rp["main"]), dict(rp["compress"])
    else:
        flat = {**(raw.get("rope_scaling") or {}), **rp}
        flat = {k: v for k, v in flat.items() if k not in ("main", "compress")}
        if "type" in flat and "rope_type" not in flat:
            flat["rope_type"] = flat.pop("type")
        main = {"rope_type": "default",
                "rope_theta": json_float(raw, "rope_theta", where, 10000.0)}
        comp = {**flat, "rope_theta": json_float(raw, "compress_rope_theta", where, 160000.0)}
        comp.setdefault("rope_type", "default")
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
    out = {}
    for label, p in (("main", main), ("compress", comp)):
        theta = json_float(p, "rope_theta", where, 10000.0 if label == "main" else 160000.0)
        p = {k: v for k, v in p.items() if k not in ("rope_theta", "partial_rotary_factor")}
        p.setdefault("rope_type", "default")
        if p["rope_type"] not in ("default", "yarn") or (label == "main" and
                                                         p["rope_type"] != "default"):
            raise UsageError(f"{where}: field 'rope_parameters.{label}.rope_type' = "
                             f"{p['rope_type']!r}: expected 'default'"
                             + (" or 'yarn'" if label == "compress" else ""))
        out[label] = (theta, p)
    return out


# -- numerics ------------------------------------------------------------------------

def _rms(x, w, eps):
    x = x.astype(_F32)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + _F32(eps))
    return y if w is None else y * w


def _angles(inv_freq, positions):
    a = positions.astype(_F32)[:, None] * inv_freq[None, :]
    return np.cos(a).astype(_F32), np.sin(a).astype(_F32)


def _rope_tail(x, cos, sin):
    """Interleaved rope on the last 2 * len(freq) channels of ``x`` (..., T, [heads,] d);
    ``cos``/``sin`` (T, r/2) broadcast over the head axis when ``x`` has one."""
    r, D = 2 * cos.shape[-1], x.shape[-1]
    if x.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    a, b = x[..., D - r::2], x[..., D - r + 1::2]
    out[..., D - r::2] = a * cos - b * sin
    out[..., D - r + 1::2] = b * cos + a * sin
    return out


def _softmax(z, axis):
    z = z - np.max(z, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=axis, keepdims=True)


def _sigmoid(z):
    return (1.0 / (1.0 + np.exp(-z))).astype(_F32)


def _compress(kv, gate, bias, m, overlap, norm_w, eps, inv_freq):
    """Entries of the closed windows of m tokens: ``kv``/``gate`` (L, c) raw projections
    (c = d, or 2d with ``overlap``), ``bias`` (m, c); (L // m, d) normalised and roped at each
    window's first position."""
    nw = kv.shape[0] // m
    if nw == 0:
        return np.zeros((0, norm_w.shape[0]), _F32)
    kv = kv[:nw * m].reshape(nw, m, -1)
    g = gate[:nw * m].reshape(nw, m, -1) + bias[None]
    if overlap:
        d = kv.shape[-1] // 2
        prev_kv = np.concatenate([np.zeros((1, m, d), _F32), kv[:-1, :, :d]])
        prev_g = np.concatenate([np.full((1, m, d), -np.inf, _F32), g[:-1, :, :d]])
        kv = np.concatenate([prev_kv, kv[:, :, d:]], axis=1)
        g = np.concatenate([prev_g, g[:, :, d:]], axis=1)
    e = np.sum(kv * _softmax(g, 1), axis=1)
    e = _rms(e, norm_w, eps)
    cos, sin = _angles(inv_freq, np.arange(nw) * m)
    return _rope_tail(e, cos, sin)


def _swiglu(x, w_gate, w_up, w_down, limit):
    g = np.minimum(x @ w_gate.T, _F32(limit))
    u = np.clip(x @ w_up.T, -limit, limit)
    return ((g / (1.0 + np.exp(-g))) * u).astype(_F32) @ w_down.T


def _hyper(x, fn, base, scale, n, iters, eps, norm_eps):
    """(pre-collapsed block input (T, D), post (T, n), comb (T, n, n)) of streams (T, n, D)."""
    T = x.shape[0]
    mix = _rms(x.reshape(T, -1), None, norm_eps) @ fn.T
    pre = _sigmoid(mix[:, :n] * scale[0] + base[:n]) + _F32(eps)
    post = 2 * _sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[:, 2 * n:].reshape(T, n, n) * scale[2] + base[2 * n:].reshape(n, n)
    comb = _softmax(comb, -1) + _F32(eps)
    comb = comb / (comb.sum(-2, keepdims=True) + _F32(eps))
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + _F32(eps))
        comb = comb / (comb.sum(-2, keepdims=True) + _F32(eps))
    return np.einsum("tn,tnd->td", pre, x), post, comb


# -- blocks --------------------------------------------------------------------------

def _t(i, name, shape, kind="matrix", split=None, axis=0):
    return TensorSpec(f"model.layers.{i}.{name}", tuple(int(s) for s in shape), kind, split,
                      axis)


@dataclass(frozen=True)
class SlidingAttention:
    """The attention every kind shares (module docstring); the sliding window alone."""

    #: its K = V head is cached once, in the KV cache's K: no V array (:mod:`.cache`)
    keeps_v = False

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, H, d, r = cfg.hidden, cfg.n_heads, cfg.head_dim, cfg.q_lora_rank
        g, R = _fam(cfg)["o_groups"], _fam(cfg)["o_lora_rank"]
        a = "attn."
        return [_t(i, a + "wq_a.weight", (r, D)), _t(i, a + "q_norm.weight", (r,), "vector"),
                _t(i, a + "wq_b.weight", (H * d, r), split="q"), _t(i, a + "wkv.weight", (d, D)),
                _t(i, a + "norm.weight", (d,), "vector"),
                _t(i, a + "wo_a.weight", (g * R, H * d // g)),
                _t(i, a + "wo_b.weight", (D, g * R)),
                _t(i, a + "attn_sink", (H,), "vector", "heads")]

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        a = f"model.layers.{i}.attn."
        for k in ("wq_a.weight", "q_norm.weight", "wq_b.weight", "wkv.weight", "norm.weight",
                  "wo_b.weight", "attn_sink"):
            w[k] = ld.np(a + k)
        # the grouped output projection by query head: head h (of group h // (H / g)) owns
        # the (R, d) block of its group's columns; this rank's heads only
        H, d = cfg.n_heads, cfg.head_dim
        g, R = _fam(cfg)["o_groups"], _fam(cfg)["o_lora_rank"]
        h0, h1 = ld.shard.heads if ld.shard.size > 1 else (0, H)
        wa = ld.np(a + "wo_a.weight").reshape(g, R, H // g, d)
        heads = np.arange(h0, h1)
        w["o_blocks"] = np.ascontiguousarray(wa[heads // (H // g), :, heads % (H // g)])
        w["o_group"] = heads // (H // g)
        w["nh"] = h1 - h0
        label = "main" if type(self) is SlidingAttention else "compress"
        theta, params = _fam(cfg)["ropes"][label]
        from hpcmac.llm.model.rope import rope_frequencies

        inv, att = rope_frequencies(replace(cfg, rope_theta=theta, rope_scaling=params))
        if att != 1.0:
            raise UsageError(f"model.layers.{i}: the {label} rope's attention factor is "
                             f"{att}; expected 1 (DeepSeek-V4 sets attention_factor 1.0)")
        w["inv_freq"] = inv

    def compressed(self, cfg, w, x, q_res, ci, slot, L, pos):
        """Extra keys (E, d) and, per query, which are visible (n, E) bool."""
        return np.zeros((0, cfg.head_dim), _F32), np.zeros((x.shape[0], 0), bool)

    def forward(self, be, cfg: ModelConfig, w: dict, x, step, ck, cv, ci):
        H, d, eps = w["nh"], cfg.head_dim, cfg.norm_eps  # this rank's heads
        win = cfg.sliding_window
        T = x.shape[0]
        q_res = _rms(x @ w["wq_a.weight"].T, w["q_norm.weight"], eps)
        q = _rms((q_res @ w["wq_b.weight"].T).reshape(T, H, d), None, eps)
        kv = _rms(x @ w["wkv.weight"].T, w["norm.weight"], eps)
        pos_all = np.concatenate([np.arange(p, p + n) for _, _, n, p in step.seqs])
        cos, sin = _angles(w["inv_freq"], pos_all)
        q, kv = _rope_tail(q, cos, sin), _rope_tail(kv, cos, sin)
        self.store(cfg, w, x, step, ci)
        out = np.empty((T, H, d), _F32)
        scale = _F32(d ** -0.5)
        for slot, off, n, pos in step.seqs:
            rows = slice(off, off + n)
            ck[slot, 0, pos:pos + n] = kv[rows]
            L = pos + n
            lo = max(0, pos - win + 1)
            keys = ck[slot, 0, lo:L]
            p = np.arange(pos, L)
            j = np.arange(lo, L)
            vis = (j[None, :] <= p[:, None]) & (j[None, :] > p[:, None] - win)
            ent, evis = self.compressed(cfg, w, x[rows], q_res[rows], ci, slot, L, pos)
            keys = np.concatenate([keys, ent])
            vis = np.concatenate([vis, evis], axis=1)
            logit = np.einsum("nhd,kd->nhk", q[rows], keys) * scale
            logit = np.where(vis[:, None, :], logit, -np.inf)
            sink = np.broadcast_to(w["attn_sink"][None, :, None], (n, H, 1))
            prob = _softmax(np.concatenate([logit, sink], axis=-1), -1)[..., :-1]
            out[rows] = np.einsum("nhk,kd->nhd", prob, keys)
        out = _rope_tail(out, cos, -sin)
        g, R = _fam(cfg)["o_groups"], _fam(cfg)["o_lora_rank"]
        yh = np.einsum("thd,hrd->thr", out, w["o_blocks"])
        y = np.zeros((T, g, R), _F32)
        for gi in np.unique(w["o_group"]):
            y[:, gi] = yh[:, w["o_group"] == gi].sum(axis=1)
        return y.reshape(T, g * R) @ w["wo_b.weight"].T  # partial: this rank's heads

    def store(self, cfg, w, x, step, ci):
        pass


@dataclass(frozen=True)
class CompressedAttention(SlidingAttention):
    """:class:`SlidingAttention` plus compressed entries: HCA (``sparse`` False: every
    closed window of ``rate``) or CSA (overlapping windows, the indexer's top-k)."""

    kind: str = "heavily_compressed_attention"

    @property
    def sparse(self) -> bool:
        return self.kind == "compressed_sparse_attention"

    def index_dim(self, cfg: ModelConfig) -> int:
        """Floats cached per token: the compressor's raw kv and gate projections (and the
        indexer's, for CSA)."""
        c = 2 if self.sparse else 1
        out = 2 * c * cfg.head_dim
        return out + 4 * cfg.index_head_dim if self.sparse else out

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, d, m = cfg.hidden, cfg.head_dim, _fam(cfg)["rates"][self.kind]
        c = "attn.compressor."
        w = 2 * d if self.sparse else d
        out = super().tensors(cfg, i) + [
            _t(i, c + "wkv.weight", (w, D)), _t(i, c + "wgate.weight", (w, D)),
            _t(i, c + "ape", (m, w), "array"), _t(i, c + "norm.weight", (d,), "vector")]
        if self.sparse:
            di, Hi = cfg.index_head_dim, cfg.index_n_heads
            x = "attn.indexer."
            out += [_t(i, x + "compressor.wkv.weight", (2 * di, D)),
                    _t(i, x + "compressor.wgate.weight", (2 * di, D)),
                    _t(i, x + "compressor.ape", (m, 2 * di), "array"),
                    _t(i, x + "compressor.norm.weight", (di,), "vector"),
                    _t(i, x + "wq_b.weight", (Hi * di, cfg.q_lora_rank)),
                    _t(i, x + "weights_proj.weight", (Hi, D))]
        return out

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        super().load(ld, cfg, i, w)
        p = f"model.layers.{i}."
        for t in self.tensors(cfg, i):
            if ".compressor." in t.name or ".indexer." in t.name:
                w[t.name[len(p):]] = ld.np(t.name)
        w["rate"] = _fam(cfg)["rates"][self.kind]

    def store(self, cfg, w, x, step, ci):
        c = "attn.compressor."
        parts = [x @ w[c + "wkv.weight"].T, x @ w[c + "wgate.weight"].T]
        if self.sparse:
            parts += [x @ w["attn.indexer.compressor.wkv.weight"].T,
                      x @ w["attn.indexer.compressor.wgate.weight"].T]
        row = np.concatenate(parts, axis=1)
        for slot, off, n, pos in step.seqs:
            ci[slot, pos:pos + n] = row[off:off + n]

    def compressed(self, cfg, w, x, q_res, ci, slot, L, pos):
        d, m, eps = cfg.head_dim, w["rate"], cfg.norm_eps
        c = 2 * d if self.sparse else d
        src = ci[slot, :(L // m) * m]
        ent = _compress(src[:, :c], src[:, c:2 * c], w["attn.compressor.ape"], m, self.sparse,
                        w["attn.compressor.norm.weight"], eps, w["inv_freq"])
        p = np.arange(pos, L)
        vis = np.arange(len(ent))[None, :] < ((p + 1) // m)[:, None]
        if not self.sparse or not len(ent):
            return ent, vis
        di, Hi, n = cfg.index_head_dim, cfg.index_n_heads, len(p)
        x0 = 2 * c
        ik = _compress(src[:, x0:x0 + 2 * di], src[:, x0 + 2 * di:x0 + 4 * di],
                       w["attn.indexer.compressor.ape"], m, True,
                       w["attn.indexer.compressor.norm.weight"], eps, w["inv_freq"])
        iq = (q_res @ w["attn.indexer.wq_b.weight"].T).reshape(n, Hi, di)
        cos, sin = _angles(w["inv_freq"], p)
        iq = _rope_tail(iq, cos, sin)
        wts = (x @ w["attn.indexer.weights_proj.weight"].T) * _F32(Hi ** -0.5)
        s = np.maximum(np.einsum("nhd,ed->nhe", iq, ik), 0) * _F32(di ** -0.5)
        score = np.einsum("nhe,nh->ne", s, wts)
        score = np.where(vis, score, -np.inf)
        k = min(cfg.index_topk, len(ent))
        top = np.argsort(-score, axis=1, kind="stable")[:, :k]
        keep = np.zeros_like(vis)
        np.put_along_axis(keep, top, True, axis=1)
        return ent, keep & vis


@dataclass(frozen=True)
class HyperMoE:
    """Routed experts (top-k by score + bias, or ``hash``: the token's ``tid2eid`` row) and
    the shared expert, both clamped SwiGLU (module docstring)."""

    hash: bool = False

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, E, I, k = cfg.hidden, cfg.n_experts, cfg.moe_intermediate, cfg.n_experts_per_tok
        f = "ffn."
        out = [_t(i, f + "gate.weight", (E, D))]
        out.append(_t(i, f + "gate.tid2eid", (cfg.vocab, k), "array") if self.hash else
                   _t(i, f + "gate.bias", (E,), "vector"))
        out += [_t(i, f + "experts.gate", (E, I, D), split="expert_ffn", axis=1),
                _t(i, f + "experts.up", (E, I, D), split="expert_ffn", axis=1),
                _t(i, f + "experts.down", (E, D, I), split="expert_ffn", axis=2)]
        for n, shape, axis in (("w1", (I, D), 0), ("w3", (I, D), 0), ("w2", (D, I), 1)):
            out.append(_t(i, f + f"shared_experts.{n}.weight", shape, split="shared_ffn",
                          axis=axis))
        return out

    def load(self, ld, cfg: ModelConfig, i: int, w: dict) -> None:
        p = f"model.layers.{i}.ffn."
        w["router"] = ld.np(p + "gate.weight")
        if self.hash:
            t = ld.np(p + "gate.tid2eid")
            if t.size and (t.min() < 0 or t.max() >= cfg.n_experts):
                raise UsageError(f"{p}gate.tid2eid: expert ids outside [0, {cfg.n_experts})")
            w["tid2eid"] = t.astype(np.int64)
        else:
            w["router_bias"] = ld.np(p + "gate.bias")
        for k in ("gate", "up", "down"):
            w["e_" + k] = ld.np(p + "experts." + k)
        for k in ("w1", "w3", "w2"):
            w["s_" + k] = ld.np(p + f"shared_experts.{k}.weight")

    def forward(self, be, cfg: ModelConfig, w: dict, x, tokens):
        logits = x @ w["router"].T
        if _fam(cfg)["score"] == "sigmoid":
            score = _sigmoid(logits)
        else:
            score = np.sqrt(np.logaddexp(_F32(0), logits)).astype(_F32)
        if self.hash:
            if tokens is None or len(tokens) != x.shape[0]:
                raise UsageError("deepseek_v4: a hash-routed layer needs the step's token ids "
                                 "(the stage that embeds them runs it)")
            idx = w["tid2eid"][np.asarray(tokens, np.int64)]
        else:
            idx = np.argsort(-(score + w["router_bias"]), axis=1,
                             kind="stable")[:, :cfg.n_experts_per_tok]
        wts = np.take_along_axis(score, idx, axis=1)
        wts = wts / (wts.sum(-1, keepdims=True) + _F32(1e-20)) * _F32(cfg.routed_scaling_factor)
        lim = cfg.swiglu_limit
        out = _swiglu(x, w["s_w1"], w["s_w3"], w["s_w2"], lim)
        for e in np.unique(idx):
            t, j = np.nonzero(idx == e)
            y = _swiglu(x[t], w["e_gate"][e], w["e_up"][e], w["e_down"][e], lim)
            np.add.at(out, t, y * wts[t, j][:, None])
        return out


@dataclass(frozen=True)
class HyperLayer:
    """A layer over ``hc_mult`` residual streams (module docstring): the first layer
    expands the embedding into them, the last collapses them by ``hc_head``."""

    attention: object
    ffn: object

    @property
    def needs_tokens(self) -> bool:
        """Its experts are hash-routed: it runs on the stage that embeds (``load_stage``)."""
        return self.ffn.hash

    def tensors(self, cfg: ModelConfig, i: int) -> list[TensorSpec]:
        D, n = cfg.hidden, cfg.residual_streams
        out = [_t(i, "attn_norm.weight", (D,), "vector"),
               _t(i, "ffn_norm.weight", (D,), "vector")]
        for b in ("attn", "ffn"):
            out += [_t(i, f"hc_{b}_fn", ((2 + n) * n, n * D), "array"),
                    _t(i, f"hc_{b}_base", ((2 + n) * n,), "vector"),
                    _t(i, f"hc_{b}_scale", (3,), "vector")]
        out += self.attention.tensors(cfg, i) + self.ffn.tensors(cfg, i)
        if i == cfg.n_layers - 1:
            out += [TensorSpec("model.hc_head.hc_fn", (n, n * D), "array"),
                    TensorSpec("model.hc_head.hc_base", (n,), "vector"),
                    TensorSpec("model.hc_head.hc_scale", (1,), "vector")]
        return out

    def load(self, ld, cfg: ModelConfig, i: int) -> dict:
        if ld.be.name != "numpy":
            raise UsageError("deepseek_v4 runs on the numpy backend only (--backend numpy)")
        w: dict = {"first": i == 0, "last": i == cfg.n_layers - 1}
        for t in self.tensors(cfg, i):
            if ".attn." not in t.name and ".ffn." not in t.name:
                w[t.name.rsplit(".", 1)[-1] if "hc_head" in t.name else
                  t.name.split(".", 3)[3]] = ld.np(t.name)
        self.attention.load(ld, cfg, i, w)
        self.ffn.load(ld, cfg, i, w)
        return w

    def forward(self, be, cfg: ModelConfig, w: dict, x, step, ck, cv, ci=None):
        f = _fam(cfg)
        n, eps = cfg.residual_streams, cfg.norm_eps
        x = np.asarray(x, _F32)
        if w["first"]:
            x = np.repeat(x[:, None, :], n, axis=1)
        elif x.ndim == 2:  # from the previous pipeline stage, (T, n * D)
            x = x.reshape(x.shape[0], n, cfg.hidden)
        for b, norm in (("attn", "attn_norm.weight"), ("ffn", "ffn_norm.weight")):
            h, post, comb = _hyper(x, w[f"hc_{b}_fn"], w[f"hc_{b}_base"], w[f"hc_{b}_scale"],
                                   n, f["hc_iters"], f["hc_eps"], eps)
            h = _rms(h, w[norm], eps)
            if b == "attn":
                y = step.sum(self.attention.forward(be, cfg, w, h, step, ck, cv, ci))
            else:
                y = step.sum(self.ffn.forward(be, cfg, w, h, step.tokens))
            x = post[:, :, None] * y[:, None, :] + np.einsum("tjk,tjd->tkd", comb, x)
        if w["last"]:
            T = x.shape[0]
            mix = _rms(x.reshape(T, -1), None, eps) @ w["hc_fn"].T
            pre = _sigmoid(mix * w["hc_scale"][0] + w["hc_base"]) + _F32(f["hc_eps"])
            x = np.einsum("tn,tnd->td", pre, x)
        return x.astype(_F32)


def layer(cfg: ModelConfig, i: int) -> HyperLayer:
    kind = cfg.layer_types[i]
    att = SlidingAttention() if kind == "sliding_attention" else CompressedAttention(kind)
    return HyperLayer(att, HyperMoE(hash=_fam(cfg)["mlp_types"][i] == "hash_moe"))


FAMILY = Family(
    summary=("hyper-connected residual streams (Sinkhorn-mixed), one shared K = V head with "
             "sinks and a grouped output projection over sliding, heavily compressed and "
             "compressed sparse (lightning-indexed) attention; clamped SwiGLU experts routed "
             "by sqrt-softplus top-k or a fixed token hash, plus a shared expert (numpy "
             "backend; hash-routed layers on the first pipeline stage)"),
    model_type="deepseek_v4", gguf_arch=None, from_hf=from_hf, from_gguf=None, layer=layer,
    hf_class="DeepseekV4Config", mlx_quant_read=False,
    tiny=dict(vocab_size=97, hidden_size=32, moe_intermediate_size=12, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=20,
              partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=5,
              n_shared_experts=1, hc_mult=3, hc_sinkhorn_iters=5, sliding_window=6,
              o_groups=2, o_lora_rank=10, index_n_heads=16, index_head_dim=12, index_topk=3,
              compress_rates={"compressed_sparse_attention": 2,
                              "heavily_compressed_attention": 4},
              layer_types=["sliding_attention", "compressed_sparse_attention",
                           "heavily_compressed_attention", "compressed_sparse_attention"],
              mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
              max_position_embeddings=512))
