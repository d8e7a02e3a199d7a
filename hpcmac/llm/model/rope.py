"""Rotary position embedding: inverse frequencies for each scaling type, and its application.

Follows transformers' ``modeling_rope_utils`` for the types these families use:
``default``, ``linear``, ``llama3``, ``yarn`` (DeepSeek-V3, Qwen3 long context),
``proportional`` (Gemma 4's full-attention layers: the first ``partial_rotary_factor`` of
each half-head pair rotated at the frequencies of the whole head, the rest at frequency 0).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from hpcmac.errors import UsageError

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.fields import ModelConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention magnitude correction."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq float32 of length rope_dim/2, factor applied to cos and sin)."""
    dim = cfg.rope_dim
    base = cfg.rope_theta
    p = cfg.rope_scaling
    kind = p.get("rope_type", "default")
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    inv = inv.astype(np.float32)
    if kind == "default":
        return inv, 1.0
    if kind == "proportional":  # rotate-half over the whole head; unrotated pairs: angle 0
        d = cfg.head_dim
        n = int(float(p.get("partial_rotary_factor", 1.0)) * d // 2)
        inv = np.zeros(d // 2, np.float32)
        inv[:n] = 1.0 / (base ** (np.arange(0, 2 * n, 2, dtype=np.float32) / np.float32(d)))
        return (inv / np.float32(p.get("factor", 1.0))).astype(np.float32), 1.0
    if kind == "linear":
        return (inv / np.float32(p["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        factor, lo, hi = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old = p["original_max_position_embeddings"]
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = np.where(wl > lo_wl, inv / factor, inv)
        smooth = (old / wl - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wl < hi_wl) & ~(wl > lo_wl)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if kind == "yarn":
        factor = p.get("factor")
        orig = p["original_max_position_embeddings"]
        if factor is None:
            factor = cfg.max_position / orig
        att = p.get("attention_factor")
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        if att is None:
            att = yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all \
                else yarn_mscale(factor)
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1

        def corr_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
        extra = 1.0 - ramp
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
        return inv.astype(np.float32), float(att)
    raise UsageError(f"config.json: rope type {kind!r} is not supported; "
                     f"expected one of {', '.join(ROPE_TYPES)}")


def softmax_scale(cfg: ModelConfig) -> float:
    """Attention logit scale: ``cfg.attention_scale`` where set (Gemma 4: 1), else
    1/sqrt(qk head dim), times the YaRN mscale^2 for MLA."""
    if cfg.attention_scale:
        return float(cfg.attention_scale)
    scale = cfg.head_dim ** -0.5
    p = cfg.rope_scaling
    if cfg.mla and p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        m = yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale *= m * m
    return float(scale)


def cos_sin(inv_freq: np.ndarray, att: float, positions: np.ndarray):
    """cos, sin of shape (T, dim/2) float32 for integer positions (T,)."""
    ang = positions.astype(np.float32)[:, None] * inv_freq[None, :]
    c, s = np.cos(ang), np.sin(ang)
    if att != 1.0:
        c, s = c * att, s * att
    return c, s


def apply_rope(x, cos, sin, interleave: bool, xp):
    """Rotate the last axis of x (T, H, d) by per-token angles cos/sin (T, 1, rd/2).

    ``interleave`` rotates pairs (x0, x1), (x2, x3) ... and returns them
    de-interleaved (the DeepSeek layout, as transformers does); otherwise the
    halves are rotated (rotate_half). Partial rotary (``rd < d``, GLM-4): the
    first ``rd`` dimensions are rotated, the rest pass through.
    """
    rd = 2 * cos.shape[-1]
    if rd < x.shape[-1]:
        return xp.concatenate([apply_rope(x[..., :rd], cos, sin, interleave, xp),
                               x[..., rd:]], axis=-1)
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
