"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): its numerics over packed batches.

Per layer, each sequence carries two fixed-size states instead of a growing KV cache:

- the causal convolution's last ``K - 1`` inputs, ``conv`` (slots, K - 1, C), C = the q, k
  and v channels (``2 * nk * dk + nv * dv``);
- the recurrent state, ``state`` (slots, nv, dk, dv): one dk x dv matrix per value head.

A token t of value head h (key head ``vk[h]``) with L2-normalised q, k, value v, write
strength ``beta = sigmoid(b)`` and log decay ``g = -exp(A_log) * softplus(a + dt_bias)``:

    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   o = q^T S / sqrt(dk)

then ``o`` is RMS-normalised per head, times ``weight * silu(z)``. A prompt runs in chunks of
64 tokens (the UT-transform form of the same recurrence, as transformers' torch path and
flash-linear-attention do), a decode step as the recurrence itself. A sequence at position
0 starts from zero states, so a freed slot needs no reset to be reused.

numpy: a decode step as one compiled call (:func:`hpcmac.llm.model.fused.delta_step`,
the numpy form below its reference), a prompt in float32 numpy. MLX: the whole layer in
MLX ops, its states MLX arrays in the cache, written in the step's graph (no host sync;
:func:`_mlx_layer`): the same decode step and 64-token chunks, the chunk's triangular
system solved by its inverse made with matmuls (MLX's triangular solve is a CPU-only
op). Nothing here communicates: under tensor parallelism each rank runs its own value
heads and the output projection's partial sum is the caller's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.fields import ModelConfig

#: tokens per chunk of a prompt (transformers' and flash-linear-attention's)
CHUNK = 64
#: a decode step (one new token per sequence) runs as one compiled call,
#: :func:`hpcmac.llm.model.fused.delta_step`; False: the numpy form below (tests compare)
STEP = True


def _silu(x: np.ndarray) -> np.ndarray:
    return x * (0.5 * np.tanh(0.5 * x) + 0.5)


def _l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum x^2 + 1e-6) over the last axis (flash-linear-attention's)."""
    return x * (1.0 / np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] + 1e-6))


def _conv(w: np.ndarray, xs: np.ndarray, n: int) -> np.ndarray:
    """Depthwise causal convolution: (n, C) outputs of (n + K - 1, C) inputs ``xs`` (the
    K - 1 earlier ones first) and weights ``w`` (C, K)."""
    K = w.shape[1]
    out = xs[0:n] * w[:, 0]
    for j in range(1, K):
        out += xs[j:j + n] * w[:, j]
    return out


def _recurrent(S: np.ndarray, q, k, v, beta, g) -> tuple[np.ndarray, np.ndarray]:
    """One token of each of B sequences: S (B, H, dk, dv), q/k (B, H, dk), v (B, H, dv),
    beta/g (B, H). Returns (o (B, H, dv), the new S)."""
    S = S * np.exp(g)[..., None, None]
    mem = np.einsum("bhkv,bhk->bhv", S, k)
    S = S + k[..., :, None] * ((v - mem) * beta[..., None])[..., None, :]
    return np.einsum("bhkv,bhk->bhv", S, q), S


def _chunked(S: np.ndarray, q, k, v, beta, g) -> tuple[np.ndarray, np.ndarray]:
    """n tokens of one sequence in chunks: S (H, dk, dv), q/k (H, n, dk), v (H, n, dv),
    beta/g (H, n). Returns (o (H, n, dv), the new S)."""
    H, n, _ = q.shape
    out = np.empty(v.shape, dtype=np.float32)
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        L = c1 - c0
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        G = np.cumsum(g[:, c0:c1], axis=-1)  # (H, L) log decay from the chunk's start
        lower = np.tril(np.ones((L, L), dtype=bool))
        D = np.exp(np.where(lower, G[:, :, None] - G[:, None, :], -np.inf))  # (H, L, L)
        kb = kc * bc[..., None]
        # the delta rule's L updates as one unit lower-triangular system (UT transform)
        M = np.tril((kb @ kc.swapaxes(-1, -2)) * D, -1) + np.eye(L, dtype=np.float32)
        eG = np.exp(G)
        rhs = np.concatenate([vc * bc[..., None], kb * eG[..., None]], axis=-1)
        sol = np.linalg.solve(M, rhs)
        u, wk = sol[..., :vc.shape[-1]], sol[..., vc.shape[-1]:]
        v_new = u - wk @ S  # (H, L, dv): what the state does not predict yet
        out[:, c0:c1] = (qc * eG[..., None]) @ S + ((qc @ kc.swapaxes(-1, -2)) * D) @ v_new
        tail = np.exp(G[:, -1:] - G)  # (H, L): decay from each token to the chunk's end
        S = S * np.exp(G[:, -1])[:, None, None] + (kc * tail[..., None]).swapaxes(-1, -2) @ v_new
    return out, S


def gated_delta_net(be, cfg: ModelConfig, w: dict, x, seqs, conv, state):
    """A Gated DeltaNet layer's token mixer on packed ``x`` (T, hidden); updates each
    sequence's ``conv`` and ``state`` (see the module docstring) in place.

    ``cfg``: this rank's (its ``linear_k_heads`` / ``linear_v_heads``). ``w``: ``w_lin_in``
    (rows ``[q | k | v | z | b | a]``), ``conv_w`` (C, K), ``lin_A`` = -exp(A_log) and
    ``dt_bias`` (nv,), ``lin_vk`` (nv,) the key head of each value head, ``lin_norm`` (dv,),
    ``w_lin_out``. Returns the output projection (this rank's partial sum under tensor
    parallelism).
    """
    if be.name == "mlx":
        return _mlx_layer(be, cfg, w, x, seqs, conv, state)
    T = x.shape[0]
    nk, nv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    C = 2 * nk * dk + nv * dv
    p = np.asarray(be.to_numpy(be.linear(x, w["w_lin_in"])), dtype=np.float32)
    decode = T == len(seqs)  # one new token per sequence
    if decode and STEP:  # the whole mixer in one compiled call (fused.delta_step)
        from hpcmac.llm.model.backend import fused_kernels

        slots = np.fromiter((s[0] for s in seqs), dtype=np.int64, count=T)
        pos = np.fromiter((s[3] for s in seqs), dtype=np.int64, count=T)
        o = fused_kernels().delta_step(np.ascontiguousarray(p), nk, dk, slots, pos, conv,
                                       w["conv_w"], state, w["lin_A"], w["dt_bias"],
                                       w["lin_vk"], w["lin_norm"], np.float32(cfg.norm_eps))
        return be.linear(o, w["w_lin_out"])
    mixed, z = p[:, :C], p[:, C:C + nv * dv]
    b, a = p[:, C + nv * dv:C + nv * dv + nv], p[:, C + nv * dv + nv:]
    cw, K = w["conv_w"], w["conv_w"].shape[1]
    conved = np.empty((T, C), dtype=np.float32)
    if decode:
        slots = np.fromiter((s[0] for s in seqs), dtype=np.int64, count=T)
        fresh = np.fromiter((s[3] == 0 for s in seqs), dtype=bool, count=T)
        prev = conv[slots]  # (B, K-1, C)
        prev[fresh] = 0.0
        xs = np.concatenate([prev, mixed[:, None, :]], axis=1)  # (B, K, C)
        conv[slots] = xs[:, 1:]
        conved = np.einsum("bkc,ck->bc", xs, cw)
    else:
        for slot, off, n, pos in seqs:
            prev = conv[slot] if pos else np.zeros((K - 1, C), dtype=np.float32)
            xs = np.concatenate([prev, mixed[off:off + n]], axis=0)
            conv[slot] = xs[n:]
            conved[off:off + n] = _conv(cw, xs, n)
    conved = _silu(conved)
    vk = w["lin_vk"]
    q = _l2norm(conved[:, :nk * dk].reshape(T, nk, dk))[:, vk] * (dk ** -0.5)  # (T, nv, dk)
    k = _l2norm(conved[:, nk * dk:2 * nk * dk].reshape(T, nk, dk))[:, vk]
    v = conved[:, 2 * nk * dk:].reshape(T, nv, dv)
    beta = 0.5 * np.tanh(0.5 * b) + 0.5
    g = w["lin_A"] * np.logaddexp(0.0, a + w["dt_bias"])  # (T, nv), <= 0
    if decode:
        S0 = state[slots]
        S0[fresh] = 0.0
        o, S = _recurrent(S0, q, k, v, beta, g)
        state[slots] = S
    else:
        o = np.empty((T, nv, dv), dtype=np.float32)
        for slot, off, n, pos in seqs:
            r = slice(off, off + n)
            S0 = state[slot] if pos else np.zeros(state.shape[1:], dtype=np.float32)
            oh, state[slot] = _chunked(S0, *(t[r].swapaxes(0, 1) for t in (q, k, v)),
                                       beta[r].T, g[r].T)
            o[r] = oh.swapaxes(0, 1)
    o = o * (1.0 / np.sqrt((o * o).mean(axis=-1, keepdims=True) + cfg.norm_eps))
    o = o * w["lin_norm"] * _silu(z.reshape(T, nv, dv))
    return be.linear(be.asarray(o.reshape(T, nv * dv)), w["w_lin_out"])


def _mlx_step(mx, S, q, k, v, beta, g):
    """:func:`_recurrent` in MLX ops: S (..., H, dk, dv), q/k (..., H, dk), v (..., H, dv),
    beta/g (..., H). Returns (o (..., H, dv), the new S)."""
    S = S * mx.exp(g)[..., None, None]
    mem = (k[..., None, :] @ S)[..., 0, :]  # (..., H, dv)
    S = S + k[..., :, None] * ((v - mem) * beta[..., None])[..., None, :]
    return (q[..., None, :] @ S)[..., 0, :], S


_LEVELS: dict = {}


def _level_masks(mx, P: int) -> list:
    """For a unit lower-triangular (P, P) matrix, P a power of 2: per doubling level of
    block size b, the (P, P) float mask of the lower-left b x b blocks inside each 2b x 2b
    diagonal block (what :func:`_mlx_unit_lower_inverse` eliminates at that level)."""
    if P not in _LEVELS:
        r, c = np.arange(P)[:, None], np.arange(P)[None, :]
        out, b = [], 1
        while b < P:
            m = (r // (2 * b) == c // (2 * b)) & ((r // b) % 2 == 1) & ((c // b) % 2 == 0)
            out.append(mx.array(m.astype(np.float32)))
            b *= 2
        _LEVELS[P] = out
    return _LEVELS[P]


def _mlx_unit_lower_inverse(mx, M):
    """The inverse of unit lower-triangular ``M`` (..., P, P), P a power of 2, in MLX
    matmuls: block inversion by doubling, ``inv([[A, 0], [C, B]]) = [[A^-1, 0],
    [-B^-1 C A^-1, B^-1]]``, all diagonal blocks of a level at once (X <- X - X N X, N
    the level's lower-left blocks of M): 2 log2(P) products, no substitution loop (MLX's
    triangular solve is a CPU-only op)."""
    P = M.shape[-1]
    X = mx.broadcast_to(mx.eye(P, dtype=mx.float32), M.shape)
    for mask in _level_masks(mx, P):
        X = X - X @ (M * mask) @ X
    return X


def _mlx_chunked(mx, S, q, k, v, beta, g):
    """:func:`_chunked` in MLX ops: n tokens of one sequence, S (H, dk, dv), q/k (H, n, dk),
    v (H, n, dv), beta/g (H, n); the UT transform's unit lower-triangular system solved by
    its inverse (:func:`_mlx_unit_lower_inverse`; a chunk padded to a power of 2 with
    identity rows, which change nothing). Returns (o (H, n, dv), the new S)."""
    H, n, _ = q.shape
    outs = []
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        L = c1 - c0
        P = 1 << (L - 1).bit_length()
        qc, kc, vc, bc = q[:, c0:c1], k[:, c0:c1], v[:, c0:c1], beta[:, c0:c1]
        G = mx.cumsum(g[:, c0:c1], axis=-1)  # (H, L) log decay from the chunk's start
        lower = mx.array(np.tril(np.ones((L, L), dtype=bool)))
        D = mx.where(lower, mx.exp(G[:, :, None] - G[:, None, :]), 0.0)  # (H, L, L)
        kb = kc * bc[..., None]
        A = mx.tril((kb @ kc.swapaxes(-1, -2)) * D, -1)  # (H, L, L) strictly lower
        if P > L:
            A = mx.pad(A, [(0, 0), (0, P - L), (0, P - L)])
        Minv = _mlx_unit_lower_inverse(mx, A + mx.eye(P, dtype=mx.float32))[:, :L, :L]
        eG = mx.exp(G)
        u = Minv @ (vc * bc[..., None])  # (H, L, dv)
        wk = Minv @ (kb * eG[..., None])  # (H, L, dk)
        v_new = u - wk @ S  # what the state does not predict yet
        outs.append((qc * eG[..., None]) @ S + ((qc @ kc.swapaxes(-1, -2)) * D) @ v_new)
        tail = mx.exp(G[:, -1:] - G)  # (H, L): decay from each token to the chunk's end
        S = S * mx.exp(G[:, -1])[:, None, None] + (kc * tail[..., None]).swapaxes(-1, -2) @ v_new
    return (outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)), S


def _mlx_layer(be, cfg: ModelConfig, w: dict, x, seqs, conv, state):
    """:func:`gated_delta_net` on the MLX backend: the same arithmetic in MLX ops, left in
    the step's graph. ``conv``, ``state``: the cache's MLX arrays, updated in place (their
    new values are graph nodes the step's evaluation computes). A prompt (or chunk) runs
    in 64-token chunks as on numpy (:func:`_mlx_chunked`)."""
    mx = be.mx
    T = x.shape[0]
    nk, nv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    C = 2 * nk * dk + nv * dv
    p = be.linear(x, w["w_lin_in"])  # (T, C + nv*dv + 2nv)
    mixed, z = p[:, :C], p[:, C:C + nv * dv]
    b, a = p[:, C + nv * dv:C + nv * dv + nv], p[:, C + nv * dv + nv:]
    cw = w["conv_w"]  # (C, K)
    decode = T == len(seqs)
    if decode:
        slots = be.index([s[0] for s in seqs])
        live = be.asarray([[[float(s[3] != 0)]] for s in seqs])  # (B, 1, 1): 0 starts fresh
        xs = mx.concatenate([conv[slots] * live, mixed[:, None, :]], axis=1)  # (B, K, C)
        conv[slots] = xs[:, 1:]
        conved = (xs * cw.T).sum(axis=1)
    else:
        parts = []
        for slot, off, n, pos in seqs:
            K = cw.shape[1]
            prev = conv[slot] if pos else be.zeros((K - 1, C))
            xs = mx.concatenate([prev, mixed[off:off + n]], axis=0)  # (n + K - 1, C)
            conv[slot] = xs[n:]
            parts.append(_conv(cw, xs, n))
        conved = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    conved = be.silu(conved)
    vk = w["lin_vk"]

    def l2(t):
        return t * mx.rsqrt((t * t).sum(axis=-1, keepdims=True) + 1e-6)

    q = l2(conved[:, :nk * dk].reshape(T, nk, dk))[:, vk] * (dk ** -0.5)  # (T, nv, dk)
    k = l2(conved[:, nk * dk:2 * nk * dk].reshape(T, nk, dk))[:, vk]
    v = conved[:, 2 * nk * dk:].reshape(T, nv, dv)
    beta = mx.sigmoid(b)
    g = w["lin_A"] * mx.logaddexp(a + w["dt_bias"], 0.0)  # (T, nv), <= 0
    if decode:
        o, S = _mlx_step(mx, state[slots] * live[..., None], q, k, v, beta, g)
        state[slots] = S
    else:
        outs = []
        for slot, off, n, pos in seqs:
            S = state[slot] if pos else be.zeros(state.shape[1:])
            r = slice(off, off + n)
            oh, S = _mlx_chunked(mx, S, *(t[r].swapaxes(0, 1) for t in (q, k, v)),
                                 beta[r].T, g[r].T)
            state[slot] = S
            outs.append(oh.swapaxes(0, 1))
        o = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)  # (T, nv, dv)
    o = o * mx.rsqrt((o * o).mean(axis=-1, keepdims=True) + cfg.norm_eps)
    o = o * w["lin_norm"] * be.silu(z.reshape(T, nv, dv))
    return be.linear(o.reshape(T, nv * dv), w["w_lin_out"])
