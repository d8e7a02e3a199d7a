"""One-token decode's small operations fused into compiled loops (numba), numpy backend.

A decode step of one sequence runs, besides its four matrix products a layer,
some forty numpy calls on vectors of a few thousand floats (the norms, the
rotary embedding, the attention over the cache, the residual adds). Each call
costs 1-3 us of dispatch and allocation whatever its size: measured on
``hpcmac.bench.llm``'s 8-layer model, ~1.1 ms of a 6.6 ms MXFP4 token (CPU time,
one thread). Here each group of them is one call:

* :func:`rms_norm` and :func:`add_rms_norm` (the residual add, then the norm): the
  sum of squares in float64 (never less exact than the float32 sum it replaces);
* :func:`attend_one`: one new token of one sequence through grouped-query attention,
  at any number of keys: optional per-head Q/K RMSNorm, rotate-half rope on the first
  ``rd`` dimensions, the key and value written to the cache, the scores, the softmax
  (optionally with a sink logit per head, optionally a sliding window), the weighted
  sum of values and optionally the output gate (Qwen3-Next, Qwen3.5); each KV head's
  keys and values read once for all its query heads (the scores, softmax and weighted
  sum as the explicit-SIMD kernels of :mod:`~hpcmac.llm.model.avec`);
* :func:`delta_step`: one token of each sequence through a Gated DeltaNet layer's
  mixer (the convolution and its state, the L2 norms, the delta rule on the recurrent
  state in place, the gated output norm).

Same arithmetic as the numpy forms in float32, up to the order of float32 sums (a
head's dot products with its keys are vectorised, reassociated and fused into FMAs,
as BLAS's are) and one function: the exponential is :func:`exp32` (the softmax's, the
same steps in :func:`hpcmac.llm.model.avec.exp`), a range reduction
and a polynomial that LLVM vectorises (as numpy's own float32 ``exp`` is; within 1 ulp,
numpy's within 2.3: ``expf`` called one value at a time cost ~0.15 us a key at 4096 keys
and 8 heads, more than reading the key). ``tests/unit/test_llm_fused.py`` checks the
logits against the numpy operations and the attention alone at 4096 keys.
Pure: no communication.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic

from hpcmac.llm.model import avec

# exp32's constants (range reduction and polynomial) live with avec's IR, which builds the
# same steps
from hpcmac.llm.model.avec import (
    _C2,
    _C3,
    _C4,
    _C5,
    _C6,
    _C7,
    _EXP_HI,
    _EXP_LO,
    _HALF,
    _LN2_HI,
    _LN2_LO,
    _LOG2E,
    _ONE,
)

#: one token of one sequence takes :func:`attend_one` (at any number of keys: 2.4x faster
#: than the numpy path at 4096, 3.7x at 64); False: the numpy path (tests compare the two)
ATTEND = True
#: rows of activations up to which the norms go through the compiled loops
MAX_ROWS = 4

_opts = dict(cache=True, nogil=True, boundscheck=False)




@intrinsic
def _f32_bits(typingctx, i):
    """The float32 whose bits are the low 32 bits of the integer ``i``."""
    if not isinstance(i, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if i.bitwidth != 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(i), codegen


@nb.njit(cache=True, nogil=True, fastmath={"contract"})
def exp32(x):
    """e^x of a float32, in arithmetic a loop vectorises (numba calls ``expf`` one value at
    a time: ~10 ns each; numpy's own float32 ``exp`` is a polynomial of this kind too).
    Within 2 ulp of the exact value for normal results; 0 below e^-87.33. No ``reassoc``:
    the two-part reduction must run in its written order."""
    x = min(max(x, _EXP_LO), _EXP_HI)
    n = np.floor(x * _LOG2E + _HALF)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = ((((((_C7 * r + _C6) * r + _C5) * r + _C4) * r + _C3) * r + _C2) * r + _ONE) * r + _ONE
    e = p * _f32_bits((np.int32(n) + 127) << 23)
    return e if x > _EXP_LO else np.float32(0.0)


@nb.njit(cache=True, nogil=True, fastmath={"contract"})
def sigmoid32(x):
    """1 / (1 + e^-x) of a float32 by :func:`exp32` (numpy's form, 0.5 tanh(x / 2) + 0.5,
    would call ``tanhf`` one value at a time)."""
    return _ONE / (_ONE + exp32(-x))


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
def attend_one(qkv, H, KV, d, cos, sin, scale, qn, kn, eps, ck, cv, slot, pos, j0, sinks,
               gated):
    """One token of one sequence through grouped-query attention, from its fused QKV
    projection ``qkv`` (1, (H + 2 KV) d) float32 (``gated``: (1, (2 H + 2 KV) d), each
    query head's d values followed by its d gate logits): returns (1, H d).

    ``cos``, ``sin`` (rd/2,) its rotary angles; ``qn``, ``kn`` (d,) the per-head Q/K norm
    weights (empty: none); ``ck``, ``cv`` (slots, KV, max_len, d) the cache, written at
    ``[slot, :, pos]``; keys ``j0 .. pos`` are seen (``j0 > 0``: a sliding window);
    ``sinks`` (H,) a logit per head joining each softmax's denominator (empty: none);
    ``gated``: each head's output times the sigmoid of its gate (Qwen3-Next, Qwen3.5).

    Each KV head's keys and values are read once for its ``H / KV`` query heads: the
    scores of all of them against one key row, then the softmax
    (:func:`~hpcmac.llm.model.avec.softmax`), then one pass over the value rows adding each
    into the query heads' outputs; the two passes as :mod:`~hpcmac.llm.model.avec`'s
    explicit-SIMD kernels where ``d`` is a multiple of 64, else as loops.
    """
    g = H // KV
    qd = 2 * d if gated else d
    rd = 2 * cos.shape[0]
    row = qkv[0]
    kbuf = np.empty(d, np.float32)
    for h in range(KV):
        _head(row, H * qd + h * d, d, rd, cos, sin, kn, eps, np.float32(1.0), kbuf)
        for t in range(d):
            ck[slot, h, pos, t] = kbuf[t]
            cv[slot, h, pos, t] = row[H * qd + (KV + h) * d + t]
    L = pos + 1 - j0
    out = np.zeros((1, H * d), np.float32)
    q = np.empty((g, d), np.float32)
    s = np.empty((g, L), np.float32)
    o = np.empty((g, d), np.float32)
    sk = np.empty(g, np.float32)  # each query head's sink logit (-inf: none)
    simd = avec.fits(d)  # avec's kernels, else the loops
    for h in range(KV):
        for i in range(g):
            _head(row, (h * g + i) * qd, d, rd, cos, sin, qn, eps, scale, q[i])
            sk[i] = sinks[h * g + i] if sinks.shape[0] else np.float32(-np.inf)
        o[:] = 0.0
        if simd:
            avec.scores(q, ck, slot, h, j0, L, s)
            avec.softmax(s, sk)
            avec.weighted_sum(s, cv, slot, h, j0, L, o)
        else:  # the loops (a padded shard's small heads: the loops' softmax, its rounding)
            K, V = ck[slot, h, j0:pos + 1], cv[slot, h, j0:pos + 1]  # (L, d) each
            for j in range(L):
                for i in range(g):
                    a = np.float32(0.0)
                    for t in range(d):
                        a += q[i, t] * K[j, t]
                    s[i, j] = a
            for i in range(g):
                _softmax_row(s[i], sk[i])
            for j in range(L):
                for i in range(g):
                    p = s[i, j]
                    for t in range(d):
                        o[i, t] += p * V[j, t]
        for i in range(g):
            hq = h * g + i
            if gated:
                _gate_into(o[i], row, hq * qd + d, out[0, hq * d:(hq + 1) * d])
            else:
                out[0, hq * d:(hq + 1) * d] = o[i]
    return out


@nb.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _softmax_row(s, sink):
    """``s`` (L,) scores -> their softmax in place; ``sink`` (-inf: none) joins the
    denominator. numpy's order: the maximum, ``exp(s - max)``, the sum, one division
    each."""
    mx = sink
    for j in range(s.shape[0]):
        mx = max(mx, s[j])
    den = np.float32(0.0)
    for j in range(s.shape[0]):
        e = exp32(s[j] - mx)
        s[j] = e
        den += e
    if sink > -np.inf:
        den += exp32(sink - mx)
    for j in range(s.shape[0]):
        s[j] = s[j] / den


@nb.njit(cache=True, nogil=True, boundscheck=False, fastmath={"contract"})
def _gate_into(o, row, off, dst):
    """``dst = o * sigmoid(row[off:off + len(o)])``: a head's output through its gate."""
    for t in range(o.shape[0]):
        dst[t] = o[t] * sigmoid32(row[off + t])


@nb.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def delta_step(p, nk, dk, slots, pos, conv, cw, state, A, dt_bias, vk, nw, eps):
    """One token of each of B sequences through a Gated DeltaNet layer's mixer, up to its
    output projection (:func:`hpcmac.llm.model.linear_attention.gated_delta_net`'s decode,
    whose numpy form is the reference): returns (B, nv dv).

    ``p`` (B, C + nv dv + 2 nv) the input projection's rows ``[q | k | v | z | b | a]``;
    sequence ``b`` is at position ``pos[b]`` (0: it starts from zero states) in cache slot
    ``slots[b]`` of ``conv`` (slots, K - 1, C) and ``state`` (slots, nv, dk, dv), both
    updated in place; ``cw`` (C, K) the convolution, ``A`` = -exp(A_log), ``dt_bias``
    (nv,), ``vk`` (nv,) each value head's key head, ``nw`` (dv,) the output norm's weight.

    Each head's state is read and written twice (the decay with ``k^T S``, then the rank-1
    write with ``q^T S``): two passes over its dk x dv floats, the second from cache,
    where the numpy form makes six full-size temporaries.
    """
    B = p.shape[0]
    C, K = cw.shape
    nv, dv = state.shape[1], state.shape[3]
    out = np.empty((B, nv * dv), np.float32)
    x = np.empty(C, np.float32)
    qn = np.empty((nk, dk), np.float32)
    kk = np.empty((nk, dk), np.float32)
    mem = np.empty(dv, np.float32)
    o = np.empty(dv, np.float32)
    qs = np.float32(dk ** -0.5)
    for b in range(B):
        sl = slots[b]
        cs = conv[sl]  # (K - 1, C)
        S_all = state[sl]  # (nv, dk, dv)
        if pos[b] == 0:
            cs[:] = 0.0
            S_all[:] = 0.0
        for c in range(C):  # the causal convolution: this input and the K - 1 kept ones
            x[c] = p[b, c] * cw[c, K - 1]
        for j in range(K - 1):
            for c in range(C):
                x[c] += cs[j, c] * cw[c, j]
        for c in range(C):
            x[c] = x[c] * sigmoid32(x[c])  # silu
        if K > 1:
            for j in range(K - 2):
                cs[j] = cs[j + 1]
            cs[K - 2] = p[b, :C]
        for h in range(nk):  # L2-normalised q (and scaled by dk^-0.5) and k per key head
            _l2_into(x, h * dk, dk, qn[h], qs)
            _l2_into(x, (nk + h) * dk, dk, kk[h], np.float32(1.0))
        zo = C
        bo = C + nv * dv
        for h in range(nv):
            S = S_all[h]  # (dk, dv)
            q, k = qn[vk[h]], kk[vk[h]]
            beta = sigmoid32(p[b, bo + h])
            y = p[b, bo + nv + h] + dt_bias[h]
            sp = max(y, np.float32(0.0)) + np.log1p(np.exp(-abs(y)))  # softplus
            eg = np.exp(A[h] * sp)
            mem[:] = 0.0
            for i in range(dk):
                ki = k[i]
                for t in range(dv):
                    st = S[i, t] * eg
                    S[i, t] = st
                    mem[t] += ki * st
            v0 = 2 * nk * dk + h * dv
            for t in range(dv):
                mem[t] = (x[v0 + t] - mem[t]) * beta  # the write: beta (v - k^T S)
            o[:] = 0.0
            for i in range(dk):
                ki, qi = k[i], q[i]
                for t in range(dv):
                    st = S[i, t] + ki * mem[t]
                    S[i, t] = st
                    o[t] += qi * st
            ss = np.float32(0.0)
            for t in range(dv):
                ss += o[t] * o[t]
            r = np.float32(1.0) / np.sqrt(ss / np.float32(dv) + eps)
            for t in range(dv):
                zt = p[b, zo + h * dv + t]
                out[b, h * dv + t] = o[t] * r * nw[t] * (zt * sigmoid32(zt))
    return out


@nb.njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _l2_into(x, off, n, dst, scale):
    """``dst = x[off:off + n] / sqrt(sum x^2 + 1e-6) * scale`` (flash-linear-attention's
    L2 norm)."""
    ss = np.float32(0.0)
    for t in range(n):
        ss += x[off + t] * x[off + t]
    r = np.float32(1.0) / np.sqrt(ss + np.float32(1e-6))
    for t in range(n):
        dst[t] = x[off + t] * r * scale
