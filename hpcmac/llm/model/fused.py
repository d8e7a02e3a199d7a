"""One-token decode's small operations fused into compiled loops (numba), numpy backend.

A decode step of one sequence runs, besides its four matrix products a layer,
some forty numpy calls on vectors of a few thousand floats (the norms, the
rotary embedding, the attention over the cache, the residual adds). Each call
costs 1-3 us of dispatch and allocation whatever its size: measured on
``hpcmac.bench.llm``'s 8-layer model, ~1.1 ms of a 6.6 ms MXFP4 token (CPU time,
one thread). Here each group of them is one call:

* :func:`rms_norm` and :func:`add_rms_norm` (the residual add, then the norm): the
  sum of squares in float64 (never less exact than the float32 sum it replaces);
* :func:`attend_one`: one new token of one sequence through grouped-query attention:
  optional per-head Q/K RMSNorm, rotate-half rope on the first ``rd`` dimensions,
  the key and value written to the cache, the scores, the softmax (optionally with a
  sink logit per head, optionally a sliding window) and the weighted sum of values.

Same arithmetic as the numpy forms in float32, up to the order of float32 sums (a
head's dot products with its keys are vectorised, reassociated and fused into FMAs,
as BLAS's are); nothing is approximated (``expf`` itself, no polynomial of ours).
``tests/unit/test_llm_fused.py`` checks the logits against the numpy operations.
Pure: no communication.
"""

from __future__ import annotations

import numba as nb
import numpy as np

#: a decode step takes :func:`attend_one` while its sequence sees at most this many keys
#: (its exponentials are scalar ``expf`` calls: past a few hundred keys numpy's vectorised
#: softmax over the (heads, keys) scores is the faster)
MAX_KEYS = 512
#: rows of activations up to which the norms go through the compiled loops
MAX_ROWS = 4

_opts = dict(cache=True, nogil=True, boundscheck=False)


@nb.njit(**_opts)
def _norm_into(x, w, eps, out):
    M, D = x.shape
    for m in range(M):
        ss = 0.0
        for i in range(D):
            v = np.float64(x[m, i])
            ss += v * v
        r = np.float32(1.0 / np.sqrt(ss / D + eps))
        for i in range(D):
            out[m, i] = x[m, i] * r * w[i]


@nb.njit(**_opts)
def rms_norm(x, w, eps):
    """RMSNorm of each row of ``x`` (M, D) float32 by the weight ``w`` (D,): a new array."""
    out = np.empty_like(x)
    _norm_into(x, w, eps, out)
    return out


@nb.njit(**_opts)
def add_rms_norm(x, a, w, eps):
    """``(x + a, rms_norm(x + a))`` for (M, D) float32 rows: the residual add and the next
    norm in one pass."""
    s = x + a
    out = np.empty_like(s)
    _norm_into(s, w, eps, out)
    return s, out


@nb.njit(**_opts)
def _head(src, off, d, rd, cos, sin, nw, eps, scale, dst):
    """``dst`` (d,) = rope(norm(src[off:off + d])) * scale (norm when ``nw`` is not empty;
    rotate-half on the first ``rd`` dimensions, the rest passed through)."""
    r = np.float32(1.0)
    if nw.shape[0]:
        ss = 0.0
        for t in range(d):
            v = np.float64(src[off + t])
            ss += v * v
        r = np.float32(1.0 / np.sqrt(ss / d + eps))
    for t in range(d):
        v = src[off + t]
        if nw.shape[0]:
            v = v * r * nw[t]
        dst[t] = v
    half = rd // 2
    for t in range(half):
        x1 = dst[t]
        x2 = dst[half + t]
        dst[t] = x1 * cos[t] - x2 * sin[t]
        dst[half + t] = x2 * cos[t] + x1 * sin[t]
    if scale != 1.0:
        for t in range(d):
            dst[t] = dst[t] * scale


@nb.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def attend_one(qkv, H, KV, d, cos, sin, scale, qn, kn, eps, ck, cv, slot, pos, j0, sinks):
    """One token of one sequence through grouped-query attention, from its fused QKV
    projection ``qkv`` (1, (H + 2 KV) d) float32: returns (1, H d).

    ``cos``, ``sin`` (rd/2,) its rotary angles; ``qn``, ``kn`` (d,) the per-head Q/K norm
    weights (empty: none); ``ck``, ``cv`` (slots, KV, max_len, d) the cache, written at
    ``[slot, :, pos]``; keys ``j0 .. pos`` are seen (``j0 > 0``: a sliding window);
    ``sinks`` (H,) a logit per head joining each softmax's denominator (empty: none).
    """
    g = H // KV
    rd = 2 * cos.shape[0]
    row = qkv[0]
    kbuf = np.empty(d, np.float32)
    for h in range(KV):
        _head(row, (H + h) * d, d, rd, cos, sin, kn, eps, np.float32(1.0), kbuf)
        for t in range(d):
            ck[slot, h, pos, t] = kbuf[t]
            cv[slot, h, pos, t] = row[(H + KV + h) * d + t]
    L = pos + 1 - j0
    out = np.zeros((1, H * d), np.float32)
    q = np.empty(d, np.float32)
    s = np.empty(L, np.float32)
    for hq in range(H):
        h = hq // g
        _head(row, hq * d, d, rd, cos, sin, qn, eps, scale, q)
        mx = np.float32(-np.inf)
        for j in range(L):
            a = np.float32(0.0)
            for t in range(d):
                a += q[t] * ck[slot, h, j0 + j, t]
            s[j] = a
            if a > mx:
                mx = a
        if sinks.shape[0] and sinks[hq] > mx:
            mx = sinks[hq]
        den = np.float32(0.0)
        for j in range(L):
            e = np.exp(s[j] - mx)
            s[j] = e
            den += e
        if sinks.shape[0]:
            den += np.exp(sinks[hq] - mx)
        o = out[0, hq * d:(hq + 1) * d]
        for j in range(L):
            p = s[j] / den
            for t in range(d):
                o[t] += p * cv[slot, h, j0 + j, t]
    return out
