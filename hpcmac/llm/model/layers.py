"""The numerics of a decoder layer's blocks: attention (GQA, optionally windowed and with
sinks, or latent), dense MLP,
routed experts and their routers (the blocks, :mod:`hpcmac.llm.model.arch.blocks`, call them).

Pure functions of (backend, config, weights, packed activations, cache arrays);
nothing here communicates. Activations are packed over a batch of sequences:
``x`` is (T_total, hidden) and ``seqs`` lists (slot, offset, n_new, start_pos)
for each sequence, whose new tokens are rows ``offset:offset+n_new`` of ``x``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from hpcmac.llm.model.backend import fused_kernels
from hpcmac.llm.model.rope import apply_rope

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.fields import ModelConfig

NEG_INF = float("-inf")
_NONE = np.empty(0, np.float32)  # no norm weights, no sinks (fused.attend_one)
_ZERO = np.zeros(1, np.float32)  # the value of a padded query slot (spec.padded_qkv_source)


def _causal_mask(pos: int, n: int, length: int, window: int = 0) -> np.ndarray:
    """(n, length) True where query pos+i may see key j (j <= pos+i; with a sliding
    ``window``, also j > pos+i - window)."""
    q = (pos + np.arange(n))[:, None]
    j = np.arange(length)[None, :]
    if window:
        return (j <= q) & (j > q - window)
    return j <= q


def _softmax(be, s, sinks):
    """Softmax over the last axis of the scores ``s``; with ``sinks`` (broadcastable to
    ``s[..., :1]``: one logit per query head), each row's sink joins the denominator
    and is dropped after (gpt-oss)."""
    if sinks is None:
        return be.softmax(s)
    xp = be.xp
    col = xp.broadcast_to(sinks, s.shape[:-1] + (1,))
    return be.softmax(xp.concatenate([s, col], axis=-1))[..., :-1]


def attention(be, cfg: ModelConfig, w: dict, x, seqs, ck, cv, cos, sin, scale: float,
              window: int = 0, total=None, output_gate: bool = False):
    """Grouped-query attention (Llama, Qwen2, Qwen3, gpt-oss); appends K/V to ``ck``/``cv``.

    ``window``: a query sees only the ``window`` latest keys (itself included); the cache
    keeps every key. ``w["sinks"]`` (H,): per-head logits joining the softmax (gpt-oss).
    ``total``: the tensor group's sum of a partial result (the full-width Q/K norm's
    sums of squares under tensor parallelism; None on one rank). ``output_gate``: each
    head's query is followed by as many gate logits, and its output is multiplied by their
    sigmoid (Qwen3-Next). ``cfg.v_from_k``: ``w["wqkv"]`` holds Q and K only and V is K's
    projection (Gemma 4's full layers); ``cfg.v_norm``: each head of V RMS-normalised
    (``w["v_norm"]``: ones).
    """
    xp = be.xp
    T = x.shape[0]
    H, KV, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = H // KV
    # a tensor-parallel rank holding part of a KV group: its Hq query heads sit in
    # H = KV * g slots (empty slots are zero queries whose outputs are dropped)
    Hq = len(w["o_take"]) if "o_take" in w else H
    qkv = be.linear(x, w["wqkv"])
    if "bqkv" in w:
        qkv = qkv + w["bqkv"]
    full = "q_norm_full" in w
    sinks = w.get("sinks")  # (H,) in the padded head order
    if be.name == "numpy" and T == 1 and not full and not cfg.v_norm and \
            not cfg.v_from_k and fused_kernels().ATTEND:
        # one token of one sequence, any number of keys: one call
        fk = fused_kernels()
        slot, _, _, pos = seqs[0]
        j0 = max(0, pos + 1 - window) if window else 0  # the keys the window sees
        qn, kn = (w["q_norm"], w["k_norm"]) if cfg.qk_norm else (_NONE, _NONE)
        if "q_pad" in w:  # part of a KV group (tensor parallel): queries padded to groups
            qkv = np.concatenate([qkv[0], _ZERO]).take(w["q_src"])[None]
        o = fk.attend_one(qkv, H, KV, d, cos[0, 0], sin[0, 0], np.float32(scale), qn, kn,
                          cfg.norm_eps, ck, cv, slot, pos, j0,
                          _NONE if sinks is None else sinks, output_gate)  # (1, H*d)
        if "o_take" in w:  # the real heads' outputs, in the shard's order
            o = o.reshape(H, d)[w["o_take"]].reshape(1, Hq * d)
        o = be.linear(o, w["wo"])
        return o + w["bo"] if "bo" in w else o
    qd = 2 * d if output_gate else d
    q = qkv[:, :Hq * qd].reshape(T, Hq, qd)
    gate = None
    if output_gate:  # (T, Hq, d) each, per head: its query, then its gate
        q, gate = q[..., :d], q[..., d:].reshape(T, Hq * d)
    k = qkv[:, Hq * qd:Hq * qd + KV * d].reshape(T, KV, d)
    v = k if cfg.v_from_k else qkv[:, Hq * qd + KV * d:].reshape(T, KV, d)
    if cfg.v_norm:
        v = be.rms_norm(v, w["v_norm"], cfg.norm_eps)
    if "q_pad" not in w and not cfg.qk_norm and not full and not output_gate:  # one rotation
        qk = apply_rope(qkv[:, :(Hq + KV) * d].reshape(T, Hq + KV, d), cos, sin, False, xp)
        q, k = qk[:, :Hq] * scale, qk[:, Hq:]  # (T, H, d), (T, KV, d)
    else:
        if full:
            q, k = _full_qk_norm(be, cfg, w, qkv[:, :Hq * d], qkv[:, Hq * d:(Hq + KV) * d],
                                 total)
            q, k = q.reshape(T, Hq, d), k.reshape(T, KV, d)
        if "q_pad" in w:
            q = xp.concatenate([q, be.zeros((T, 1, d))], axis=1)[:, w["q_pad"]]  # (T, H, d)
        if cfg.qk_norm:
            q = be.rms_norm(q, w["q_norm"], cfg.norm_eps)
            k = be.rms_norm(k, w["k_norm"], cfg.norm_eps)
        q = apply_rope(q, cos, sin, False, xp) * scale
        k = apply_rope(k, cos, sin, False, xp)
    if be.name == "numpy" and T == len(seqs):
        o = (_decode_one(be, q, k, v, seqs[0], ck, cv, g, window, sinks) if T == 1 else
             _decode_attention(be, q, k, v, seqs, ck, cv, g, window, sinks))
    else:
        o = _attention_per_sequence(be, xp, q, k, v, seqs, ck, cv, g, window, sinks)
    if "o_take" in w:
        o = o.reshape(T, H, d)[:, w["o_take"]].reshape(T, Hq * d)
    if gate is not None:
        o = o * be.sigmoid(gate)
    o = be.linear(o, w["wo"])
    if "bo" in w:
        o = o + w["bo"]
    return o


def _full_qk_norm(be, cfg: ModelConfig, w: dict, q, k, total):
    """RMSNorm over all of Q's (T, H*d) and all of K's (T, KV*d) projected dimensions
    (MiniMax-M2), not per head. Under tensor parallelism each rank holds some heads: the
    group sums the per-token sums of squares, each KV head counted on one rank only
    (``k_own``, the rank holding its first query head); ``qk_norm_n`` holds the global
    H*d and KV*d."""
    xp = be.xp
    kk = k * w["k_own"] if "k_own" in w else k
    ss = xp.stack([(q * q).sum(axis=-1), (kk * kk).sum(axis=-1)], axis=-1)  # (T, 2)
    if total is not None:
        ss = total(ss)
    nq, nk = w["qk_norm_n"]
    eps = cfg.norm_eps
    q = q * (1.0 / xp.sqrt(ss[:, :1] * (1.0 / nq) + eps)) * w["q_norm_full"]
    k = k * (1.0 / xp.sqrt(ss[:, 1:] * (1.0 / nk) + eps)) * w["k_norm_full"]
    return q, k


def _decode_one(be, q, k, v, seq, ck, cv, g: int, window: int = 0, sinks=None):
    """Decode step of one sequence (one new token): the per-sequence attention's
    arithmetic (the same bits) with its reshapes and copies for a single row left out."""
    slot, _, _, pos = seq
    KV, d = k.shape[1], k.shape[2]
    ck[slot, :, pos] = k[0]  # (KV, d)
    cv[slot, :, pos] = v[0]
    j0 = max(0, pos + 1 - window) if window else 0  # the keys the window sees
    s = q.reshape(KV, g, d) @ ck[slot, :, j0:pos + 1].swapaxes(-1, -2)  # (KV, g, L)
    p = _softmax(be, s, None if sinks is None else sinks.reshape(KV, g, 1))
    return (p @ cv[slot, :, j0:pos + 1]).reshape(1, KV * g * d)  # (1, H*d)


def _decode_attention(be, q, k, v, seqs, ck, cv, g: int, window: int = 0, sinks=None):
    """Decode step of several sequences (one new token each) as one batched attention.

    Keys of a shorter sequence are padded to the longest and masked, so each
    sequence's probabilities are its own; one set of numpy calls serves every
    sequence instead of one set per sequence (numpy backend).
    """
    B, KV, d = len(seqs), k.shape[1], k.shape[2]
    slots = np.fromiter((s[0] for s in seqs), dtype=np.int64, count=B)
    pos = np.fromiter((s[3] for s in seqs), dtype=np.int64, count=B)
    ck[slots, :, pos] = k  # (B, KV, d): row b is sequence b (one token each)
    cv[slots, :, pos] = v
    L = int(pos.max()) + 1
    j0 = max(0, int(pos.min()) + 1 - window) if window else 0  # keys some window sees
    if slots[0] + B - 1 == slots[-1] and np.all(np.diff(slots) == 1):
        K, V = ck[slots[0]:slots[0] + B, :, j0:L], cv[slots[0]:slots[0] + B, :, j0:L]
    else:
        K, V = ck[slots, :, j0:L], cv[slots, :, j0:L]  # (B, KV, L - j0, d)
    s = q.reshape(B, KV, g, d) @ K.swapaxes(-1, -2)  # (B, KV, g, L - j0)
    j = np.arange(j0, L)[None, :]
    hidden = j > pos[:, None]  # (B, L - j0): another sequence's padding
    if window:
        hidden |= j <= pos[:, None] - window  # outside this sequence's window
    if hidden.any():
        s = be.where(hidden[:, None, None, :], NEG_INF, s)
    p = _softmax(be, s, None if sinks is None else sinks.reshape(1, KV, g, 1))
    return (p @ V).reshape(B, KV * g * d)  # (B, H*d)


def _attention_per_sequence(be, xp, q, k, v, seqs, ck, cv, g: int, window: int = 0,
                            sinks=None):
    """Prefill (or a mixed step): each sequence's new tokens against its own cache."""
    T, KV, d = k.shape
    outs = []
    for slot, off, n, pos in seqs:
        L = pos + n
        be.set(ck, (slot, slice(None), slice(pos, L)), k[off:off + n].transpose(1, 0, 2))
        be.set(cv, (slot, slice(None), slice(pos, L)), v[off:off + n].transpose(1, 0, 2))
        j0 = max(0, pos + 1 - window) if window else 0  # keys the first query's window sees
        K = ck[slot, :, j0:L]  # (KV, L - j0, d)
        V = cv[slot, :, j0:L]
        qs = q[off:off + n].reshape(n, KV, g, d).transpose(1, 2, 0, 3).reshape(KV, g * n, d)
        s = qs @ K.swapaxes(-1, -2)  # (KV, g*n, L - j0)
        if n > 1:
            mask = _causal_mask(pos - j0, n, L - j0, window)
            s = be.where(np.tile(mask, (g, 1)), s, NEG_INF)
        sk = None
        if sinks is not None:  # rows are (head in group, token): (KV, g, 1, 1) -> (KV, g*n, 1)
            sk = xp.broadcast_to(sinks.reshape(KV, g, 1, 1), (KV, g, n, 1)).reshape(KV, g * n, 1)
        p = _softmax(be, s, sk)
        o = p @ V  # (KV, g*n, d)
        outs.append(o.reshape(KV, g, n, d).transpose(2, 0, 1, 3).reshape(n, KV * g * d))
    return outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)


def latent_attention(be, cfg: ModelConfig, w: dict, x, seqs, ck, cpe, cos, sin, scale: float,
                     ci=None):
    """DeepSeek-V3 multi-head latent attention over the compressed cache.

    The cache holds the normalised latent ``c`` (kv_lora_rank) and the shared
    rotary key per token. The key/value up-projection is absorbed into the
    query and the output (``q_nope W_uk`` and ``(p c) W_uv``), so decode never
    expands the cache to per-head keys.

    ``ci``: the lightning indexer's key cache (slots, max_len, index_head_dim), the
    backend's array (DeepSeek-V3.2, weights ``ix_*``): each query then sees only the keys
    :func:`index_keep` selects.
    """
    xp = be.xp
    T = x.shape[0]
    H, nope, rd, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    vd = cfg.v_head_dim
    keep = [None] * len(seqs)
    if "wq" in w:
        q = be.linear(x, w["wq"])
    else:
        q_resid = be.rms_norm(be.linear(x, w["wq_a"]), w["q_a_norm"], cfg.norm_eps)
        if ci is not None:
            keep = index_keep(be, cfg, w, x, q_resid, seqs, ci, cos, sin)
        q = be.linear(q_resid, w["wq_b"])
    q = q.reshape(T, H, nope + rd)
    kv = be.linear(x, w["wkv_a"])  # (T, r + rd)
    c = be.rms_norm(kv[:, :r], w["kv_a_norm"], cfg.norm_eps)
    k_pe = apply_rope(kv[:, r:].reshape(T, 1, rd), cos, sin, cfg.rope_interleave, xp)[:, 0]
    q_pe = apply_rope(q[..., nope:], cos, sin, cfg.rope_interleave, xp).transpose(1, 0, 2)
    q_lat = q[..., :nope].transpose(1, 0, 2) @ w["w_uk"]  # (H, T, r)
    q_lat, q_pe = q_lat * scale, q_pe * scale
    outs = []
    for (slot, off, n, pos), kp in zip(seqs, keep):
        L = pos + n
        be.set(ck, (slot, slice(pos, L)), c[off:off + n])
        be.set(cpe, (slot, slice(pos, L)), k_pe[off:off + n])
        C = ck[slot, :L]  # (L, r)
        P = cpe[slot, :L]  # (L, rd)
        s = q_lat[:, off:off + n] @ C.T + q_pe[:, off:off + n] @ P.T  # (H, n, L)
        if kp is not None:  # the indexer's top-k (causal already)
            s = be.where(kp[None], s, NEG_INF)
        elif n > 1:
            s = be.where(_causal_mask(pos, n, L)[None], s, NEG_INF)
        p = be.softmax(s)
        o = (p @ C) @ w["w_uv_t"]  # (H, n, vd)
        outs.append(o.transpose(1, 0, 2).reshape(n, H * vd))
    o = outs[0] if len(outs) == 1 else xp.concatenate(outs, axis=0)
    return be.linear(o, w["wo"])


def index_keep(be, cfg: ModelConfig, w: dict, x, q_resid, seqs, ci, cos, sin) -> list:
    """DeepSeek-V3.2's lightning indexer: per sequence, the (n, L) mask of the keys each
    new query attends to (None: every causal key, as when the sequence holds at most
    ``index_topk`` tokens); appends the new tokens' indexer keys to ``ci``.

    Query ``q = wq_b q_resid`` (index heads of ``index_head_dim``), key
    ``k = LayerNorm(wk x)`` (eps 1e-6, weight and bias), both rotated on their first
    ``qk_rope_head_dim`` dimensions by halves (not interleaved, unlike the MLA's rope); a
    key's score is ``sum_h wts_h relu(q_h . k) / sqrt(index_head_dim)`` with
    ``wts = weights_proj x / sqrt(index_n_heads)``; each query keeps the ``index_topk``
    causal keys of highest score (:func:`top_keys`: among equal scores the earlier
    position). In the backend's arrays: on MLX the scores, the choice and the mask stay in
    the step's graph, ``ci`` an MLX array. The release's Hadamard rotation and FP8 scoring
    are dropped, as transformers drops them (the rotation keeps dot products).
    """
    T = x.shape[0]
    Hi, di, topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    xp = be.xp
    q = apply_rope(be.linear(q_resid, w["ix_wq"]).reshape(T, Hi, di), cos, sin, False, xp)
    k = be.linear(x, w["ix_wk"])  # (T, di)
    mu = k.mean(axis=-1, keepdims=True)
    var = ((k - mu) * (k - mu)).mean(axis=-1, keepdims=True)
    k = (k - mu) / xp.sqrt(var + 1e-6) * w["ix_norm_w"] + w["ix_norm_b"]
    k = apply_rope(k.reshape(T, 1, di), cos, sin, False, xp)[:, 0]
    wts = be.linear(x, w["ix_wts"]) * (Hi ** -0.5)  # (T, Hi)
    out = []
    for slot, off, n, pos in seqs:
        L = pos + n
        be.set(ci, (slot, slice(pos, L)), k[off:off + n])
        if L <= topk:
            out.append(None)
            continue
        s = xp.maximum(q[off:off + n] @ ci[slot, :L].T, 0.0) * (di ** -0.5)  # (n, Hi, L)
        score = (wts[off:off + n, None, :] @ s)[:, 0]  # (n, L)
        causal = _causal_mask(pos, n, L)
        score = be.where(causal, score, NEG_INF)
        out.append(top_keys(xp, score, topk) & (causal if xp is np else xp.array(causal)))
    return out


def top_keys(xp, score, k: int):
    """(n, L) bool: each row's ``k`` highest scores, a tie at the k-th value going to the
    lower index (the earlier position), the same on numpy and MLX.

    Exact ties do happen in the indexer: a key whose every head's ``relu(q . k)`` is 0
    scores exactly 0. transformers takes ``torch.topk``, which leaves the order of equal
    values unspecified; a stable rule makes both backends choose the same keys. Made
    without a sort: the k-th value ``t`` (a partition, or ``mx.topk``), every score above
    it, then the first of those equal to it, as many as are still missing."""
    if xp is np:
        t = np.partition(score, score.shape[-1] - k, axis=-1)[:, -k:].min(axis=-1, keepdims=True)
    else:
        t = xp.topk(score, k, axis=-1).min(axis=-1, keepdims=True)
    above, tied = score > t, score == t
    need = k - above.astype(xp.int32).sum(axis=-1, keepdims=True)  # >= 1: t is among the k
    return above | (tied & (xp.cumsum(tied.astype(xp.int32), axis=-1) <= need))


def gelu_tanh(xp, x):
    """GELU, tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return 0.5 * x * (1.0 + xp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def mlp(be, w: dict, x, pre: str = "", act: str = "silu"):
    """Gated MLP with fused gate/up weights: down(act(gate x) * up x); ``act`` "silu"
    (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)."""
    gu = be.linear(x, w[pre + "w_gu"])
    if pre + "b_gu" in w:
        gu = gu + w[pre + "b_gu"]
    i = gu.shape[1] // 2
    g = be.silu(gu[:, :i]) if act == "silu" else gelu_tanh(be.xp, gu[:, :i])
    y = be.linear(g * gu[:, i:], w[pre + "w_down"])
    if pre + "b_down" in w:
        y = y + w[pre + "b_down"]
    return y


def top_k(xp, a, k: int):
    """Indices (T, k) of each row's ``k`` largest values, largest first; a tie goes to the
    lower index (numpy's stable sort; MLX's sort is stable on its CPU build, checked by
    test_mlx_moe; on a GPU build exact ties may order otherwise)."""
    if xp is np:
        return np.argsort(-a, axis=-1, kind="stable")[:, :k]
    return xp.argsort(-a, axis=-1)[:, :k]


def route_softmax(xp, logits, k: int, norm: bool):
    """Qwen3-MoE routing: softmax over experts, top-k, optionally renormalised. ``xp``: numpy
    or mlx.core (the logits' own: the routing stays where they are)."""
    e = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    idx = top_k(xp, probs, k)
    wts = xp.take_along_axis(probs, idx, axis=-1)
    if norm:
        wts = wts / wts.sum(axis=-1, keepdims=True)
    return idx, wts.astype(xp.float32)


def route_grouped_sigmoid(xp, logits, bias, cfg: ModelConfig):
    """DeepSeek-V3 routing: sigmoid scores, correction bias for choice only, group-limited
    top-k (``n_group``, ``topk_group``: each group scored by its two best), optionally
    renormalised, times ``routed_scaling_factor``."""
    T, E = logits.shape
    G = cfg.n_group
    scores = 0.5 * xp.tanh(0.5 * logits) + 0.5
    choice = scores + bias
    if G > 1:
        grouped = xp.sort(choice.reshape(T, G, E // G), axis=-1)[..., -2:].sum(axis=-1)  # (T, G)
        keep = top_k(xp, grouped, cfg.topk_group)  # (T, topk_group)
        gmask = (keep[:, :, None] == xp.arange(G)[None, None, :]).any(axis=1)  # (T, G)
        choice = xp.where(xp.repeat(gmask, E // G, axis=-1), choice, NEG_INF)
    idx = top_k(xp, choice, cfg.n_experts_per_tok)
    wts = xp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        wts = wts / (wts.sum(axis=-1, keepdims=True) + 1e-20)
    return idx, (wts * cfg.routed_scaling_factor).astype(xp.float32)


def swiglu(be, gu, limit: float = 0.0, alpha: float = 1.702):
    """``silu(gate) * up`` of a fused (..., 2I) gate/up product (gate first); with ``limit``,
    gpt-oss's clamped form: gate clamped above and up on both sides at ``limit``, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    i = gu.shape[-1] // 2
    if not limit:
        return be.silu(gu[..., :i]) * gu[..., i:]
    xp = be.xp
    gate = xp.minimum(gu[..., :i], limit)
    up = xp.clip(gu[..., i:], -limit, limit)
    return (up + 1.0) * (gate * be.sigmoid(alpha * gate))


def route_topk_softmax(xp, logits, k: int):
    """gpt-oss (and Mixtral) routing: the top-k logits, softmax over those k."""
    idx = top_k(xp, logits, k)
    top = xp.take_along_axis(logits, idx, axis=-1)
    e = xp.exp(top - top[:, :1])
    return idx, (e / e.sum(axis=-1, keepdims=True)).astype(xp.float32)


def glu(be, cfg: ModelConfig, gu):
    """The experts' gated activation of a fused (..., 2I) gate/up product: GeGLU where
    ``cfg.hidden_act`` is ``gelu_tanh`` (Gemma 4), else :func:`swiglu`."""
    if cfg.hidden_act == "gelu_tanh":
        i = gu.shape[-1] // 2
        return gelu_tanh(be.xp, gu[..., :i]) * gu[..., i:]
    return swiglu(be, gu, cfg.swiglu_limit, cfg.swiglu_alpha)


def routed_experts(be, cfg: ModelConfig, w: dict, x, idx, wts):
    """The chosen experts ``idx`` (T, k) of each token of ``x`` (T, hidden), summed with
    the routing weights ``wts`` (T, k)."""
    if be.name == "mlx":
        return gathered_experts(be, cfg, w, x, idx, wts)
    return _experts_per_expert(be, cfg, w, x, idx, wts)


def route_gemma4(be, cfg: ModelConfig, w: dict, x):
    """Gemma 4's router over the residual ``x`` (T, hidden): ``x`` RMS-normalised (no
    weight), times ``w["router_scale"]`` / sqrt(hidden), projected; softmax over the
    experts, top ``n_experts_per_tok``, renormalised, times each chosen expert's
    ``w["per_expert_scale"]``."""
    xp = be.xp
    r = be.rms_norm(x, w["router_ones"], cfg.norm_eps) * w["router_scale"]
    idx, wts = route_softmax(xp, be.linear(r, w["router"]), cfg.n_experts_per_tok, True)
    return idx, wts * w["per_expert_scale"][idx]


def moe(be, cfg: ModelConfig, w: dict, x, route):
    """Routed experts (plus shared experts, ``s_*`` weights) over packed tokens (T, hidden);
    ``route(xp, logits, w, cfg) -> (expert ids (T, k), weights (T, k))`` chooses them, on
    the backend's arrays. Optional per-expert biases ``e_b_gu`` (E, 2I) and ``e_b_down``
    (E, hidden), and the clamped SwiGLU when ``cfg.swiglu_limit`` (gpt-oss).

    numpy: each chosen expert's rows through its own matrices. MLX: the chosen experts in
    one gathered matmul per projection (:func:`gathered_experts`), nothing leaves the
    graph."""
    idx, wts = route(be.xp, be.linear(x, w["router"]), w, cfg)
    out = routed_experts(be, cfg, w, x, idx, wts)
    if "s_w_gu" in w:
        shared = mlp(be, w, x, pre="s_")
        if "s_gate" in w:  # (T, 1) a gate logit per token
            shared = shared * be.sigmoid(be.linear(x, w["s_gate"]))
        out = out + shared
    return out


def _experts_per_expert(be, cfg: ModelConfig, w: dict, x, idx, wts):
    """numpy: each chosen expert once, over the rows that chose it."""
    out = be.zeros(x.shape)
    e_gu, e_down = w["e_gu"], w["e_down"]
    b_gu, b_down = w.get("e_b_gu"), w.get("e_b_down")
    for e in np.unique(idx):
        rows, which = np.nonzero(idx == e)
        ri = be.index(rows)
        xe = x[ri]
        gu = be.linear(xe, e_gu[int(e)])
        if b_gu is not None:
            gu = gu + b_gu[int(e)]
        ye = be.linear(glu(be, cfg, gu), e_down[int(e)])
        if b_down is not None:
            ye = ye + b_down[int(e)]
        ye = ye * be.asarray(wts[rows, which][:, None])
        out = be.index_add(out, ri, ye)
    return out


#: from this many (token, expert) pairs on, the pairs are sorted by expert before the
#: gathered matmuls, so each expert's weights are read once for all its rows (prefill)
SORT_PAIRS = 64


def gathered_experts(be, cfg: ModelConfig, w: dict, x, idx, wts):
    """MLX: the (T, k) chosen experts of each token as one gathered matmul per projection
    (``be.gather_linear``: ``mx.gather_mm`` on floats, ``mx.gather_qmm`` on quantized
    stacks), biases gathered alike, summed with the routing weights; no host round trip."""
    mx = be.xp
    T, D = x.shape
    k = idx.shape[1]
    pairs = T * k >= SORT_PAIRS
    if pairs:  # (T*k, 1, D) one row per (token, expert) pair, grouped by expert
        flat = idx.reshape(-1)
        order = mx.argsort(flat)
        ids, xs = flat[order], x[order // k][:, None, :]
    else:  # (T, 1, 1, D) against (T, k) experts
        ids, xs = idx, x.reshape(T, 1, 1, D)
    gu = be.gather_linear(xs, w["e_gu"], ids, pairs)  # (..., 1, 2I)
    if "e_b_gu" in w:
        gu = gu + w["e_b_gu"][ids][..., None, :]
    y = be.gather_linear(glu(be, cfg, gu), w["e_down"], ids, pairs)  # (..., 1, D)
    if "e_b_down" in w:
        y = y + w["e_b_down"][ids][..., None, :]
    if pairs:
        y = y[mx.argsort(order)]  # back to (token, expert) order
    return (y.reshape(T, k, D) * wts[:, :, None]).sum(axis=1)
