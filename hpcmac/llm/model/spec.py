"""Each architecture's tensors, described once, and each rank's share of them.

:class:`TensorSpec` describes one tensor of a layer (each family's blocks,
:mod:`hpcmac.llm.model.arch.blocks`, list them: ``arch.layer_tensors``):
canonical and GGUF name, shape, class
(``matrix``: a weight that ``backend.linear`` multiplies, quantizable;
``vector``: norms and biases; ``array``: kept in float32, MLA's absorbed
``kv_b``) and how tensor parallelism splits it (the axis and the unit: query
heads, KV heads, MLP columns, ...). The loader reads and
slices by it, the planner counts bytes by it, :func:`make_shards` says which
part each rank holds. Pure: no file is read here.

Tensor parallelism (Megatron's split, as mlx-lm's ``AllToShardedLinear`` /
``ShardedToAllLinear``): Q/K/V rows and the output projection's columns by
heads, the MLP's gate/up rows and down columns by intermediate columns (every
routed and shared expert alike), the embedding and the head by vocabulary
rows. Norms, the router and MLA's latent projections are replicated. A KV
head shared by query heads of two ranks is held by both. Biases added after
a reduction (``o_proj``, ``down_proj``) are held by rank 0 only.

Linear attention (Gated DeltaNet) splits by value heads as attention splits by query
heads: each rank holds its value heads' V/Z rows, gates, decays and output columns, and
the key heads they read (Q/K rows and conv channels; a key head shared by value heads of
two ranks is held by both). Its fused projections take several row ranges per rank
(:func:`parts`), the fused per-key-head layout regrouped as ``[q | k | v | z]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hpcmac.errors import UsageError

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.fields import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a layer (global: the same on every rank)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix", "vector" or "array"
    split: str | None = None  # the unit it splits by (see SPLITS); None: replicated
    axis: int = 0  # the axis that splits
    gguf: str | None = None  # its name in a GGUF file (None: none, or see gguf_form)
    #: a tensor that a GGUF file stores in another layout, as (form, GGUF names...):
    #: ``("t", a)``: ``a`` with the last two axes swapped; ``("pairs_t", a, b, fused)``:
    #: the rows (axis -2) of ``a`` and ``b`` interleaved (a0, b0, a1, ...), then the last
    #: two axes swapped; ``("pairs", a, b, fused)``: the same for vectors, along the last
    #: axis. ``fused``: one tensor holding ``a``'s rows then ``b``'s, which newer
    #: converters write instead (read by :class:`~hpcmac.llm.model.gguf_loader.GGUFCheckpoint`)
    gguf_form: tuple | None = None


#: the units a tensor splits by (see :func:`part`)
SPLITS = ("q", "q_gated", "kv", "heads_in", "heads", "mla_q", "mla_kvb", "mla_o", "ffn",
          "expert_ffn", "expert_ffn_pairs", "shared_ffn", "vocab", "rank0",
          "lin_qkv", "lin_qkvz", "lin_ba", "lin_v", "lin_heads")
#: the linear-attention units whose rows are several ranges (see :func:`parts`)
_LINEAR_ROWS = ("lin_qkv", "lin_qkvz", "lin_ba")


@dataclass(frozen=True)
class Shard:
    """What one rank of a tensor group holds (local; global ranges ``[lo, hi)``)."""

    rank: int
    size: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]  # KV heads its query heads read (shared ones replicated)
    ffn: tuple[int, int]  # dense MLP intermediate columns
    expert_ffn: tuple[int, int]  # each routed expert's intermediate columns
    shared_ffn: tuple[int, int]  # the shared experts' intermediate columns (DeepSeek-V3)
    vocab: tuple[int, int]  # embedding and head rows
    lin_v: tuple[int, int] = (0, 0)  # linear attention's value heads
    lin_k: tuple[int, int] = (0, 0)  # the key heads those read (shared ones replicated)

    @property
    def n_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_lin_v(self) -> int:
        return self.lin_v[1] - self.lin_v[0]

    @property
    def n_lin_k(self) -> int:
        return self.lin_k[1] - self.lin_k[0]

    def layout(self) -> dict:
        """The JSON form: counts per rank."""
        return {"heads": self.n_heads, "kv_heads": self.n_kv_heads,
                "ffn": self.ffn[1] - self.ffn[0], "vocab": self.vocab[1] - self.vocab[0]}


def split_counts(n: int, shares: Sequence[float]) -> list[int]:
    """``n`` units in parts proportional to ``shares`` (largest remainder; ties to lower ranks).

    64 heads over shares 1, 1, 1 give 22, 21, 21; over 2, 1, 1 give 32, 16, 16.
    """
    total = float(sum(shares))
    exact = [n * s / total for s in shares]
    base = [int(np.floor(e)) for e in exact]
    order = sorted(range(len(shares)), key=lambda r: (-(exact[r] - base[r]), r))
    for r in order[: n - sum(base)]:
        base[r] += 1
    return base


def _ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


def make_shards(cfg: ModelConfig, shares: Sequence[float]) -> list[Shard]:
    """Every rank's :class:`Shard` for tensor parallelism over ``len(shares)`` ranks.

    Raises UsageError when some rank would hold no query head or no MLP column.
    """
    t = len(shares)
    if t == 1:
        return [full_shard(cfg)]
    what = [("attention heads", cfg.n_heads), ("vocabulary rows", cfg.vocab)]
    if cfg.intermediate:  # none: every layer routed (Qwen3.5-MoE)
        what.append(("MLP columns", cfg.intermediate))
    if cfg.n_experts:
        what.append(("expert columns", cfg.moe_intermediate))
    if cfg.linear_v_heads:
        what.append(("linear-attention value heads", cfg.linear_v_heads))
    for label, n in what:
        counts = split_counts(n, shares)
        if min(counts) < 1:
            raise UsageError(f"tensor {t} with shares {','.join(f'{s:g}' for s in shares)}: "
                             f"the model has {n} {label}, so rank {counts.index(0)} would "
                             f"hold none (use fewer tensor ranks or more even shares)")
    heads = _ranges(split_counts(cfg.n_heads, shares))
    g = cfg.n_heads // cfg.n_kv_heads if not cfg.mla else 1
    lin = _ranges(split_counts(cfg.linear_v_heads, shares)) if cfg.linear_v_heads else \
        [(0, 0)] * t
    lg = cfg.linear_v_heads // cfg.linear_k_heads if cfg.linear_v_heads else 1
    shards = []
    for r, (h0, h1) in enumerate(heads):
        kv = (0, 0) if cfg.mla else (h0 // g, (h1 - 1) // g + 1)
        v0, v1 = lin[r]
        shards.append(Shard(
            rank=r, size=t, heads=(h0, h1), kv_heads=kv,
            ffn=_ranges(split_counts(cfg.intermediate, shares))[r],
            expert_ffn=_ranges(split_counts(cfg.moe_intermediate, shares))[r],
            shared_ffn=_ranges(split_counts(cfg.shared_width, shares))[r],
            vocab=_ranges(split_counts(cfg.vocab, shares))[r],
            lin_v=(v0, v1), lin_k=(v0 // lg, (v1 - 1) // lg + 1) if v1 else (0, 0)))
    return shards


def full_shard(cfg: ModelConfig) -> Shard:
    """The whole model on one rank."""
    return Shard(0, 1, (0, cfg.n_heads), (0, 0 if cfg.mla else cfg.n_kv_heads),
                 (0, cfg.intermediate), (0, cfg.moe_intermediate),
                 (0, cfg.shared_width), (0, cfg.vocab),
                 (0, cfg.linear_v_heads), (0, cfg.linear_k_heads))


def layer_shard(shard: Shard, lcfg: ModelConfig) -> Shard:
    """``shard`` as a layer whose config is ``lcfg`` (``cfg.at(i)``) sees it: the KV heads
    its query heads read in that layer (Gemma 4's full-attention layers have fewer KV heads
    than the sliding ones; the query heads split the same)."""
    from dataclasses import replace

    if lcfg.mla:
        return shard
    if shard.size == 1:
        kv = (0, lcfg.n_kv_heads)
    else:
        g = lcfg.n_heads // lcfg.n_kv_heads
        kv = (shard.heads[0] // g, (shard.heads[1] - 1) // g + 1)
    return shard if kv == shard.kv_heads else replace(shard, kv_heads=kv)


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config the layers and the cache see on the rank holding ``shard``: its heads,
    KV heads and linear-attention heads (query heads padded to whole KV groups, see
    :func:`padded_heads`); a layer type's own fields (:attr:`ModelConfig.by_layer_type`)
    made local alike, so that ``local.at(i)`` is layer ``i``'s local config."""
    from dataclasses import replace

    if shard.size == 1:
        return cfg
    if cfg.by_layer_type:
        base = local_config(replace(cfg, by_layer_type={}), shard)
        by = {}
        for kind, over in cfg.by_layer_type.items():
            lcfg = replace(cfg, **over, by_layer_type={})
            loc = local_config(lcfg, layer_shard(shard, lcfg))
            by[kind] = {**over, "n_heads": loc.n_heads, "n_kv_heads": loc.n_kv_heads}
        return replace(base, by_layer_type=by)
    if cfg.mla:
        return replace(cfg, n_heads=shard.n_heads)
    pad = padded_heads(cfg, shard)
    return replace(cfg, n_heads=shard.n_heads if pad is None else pad[0],
                   n_kv_heads=shard.n_kv_heads, linear_v_heads=shard.n_lin_v,
                   linear_k_heads=shard.n_lin_k)


def part(spec: TensorSpec, cfg: ModelConfig, shard: Shard) -> tuple[int, int] | None:
    """The element range ``[lo, hi)`` along ``spec.axis`` this shard holds; None: all of it.

    ``(0, 0)``: nothing (a bias held by rank 0 only, on another rank). The linear-attention
    units of several ranges (``lin_qkv``, ``lin_qkvz``, ``lin_ba``) are :func:`parts`' alone.
    """
    if spec.split is None or shard.size == 1:
        return None
    d = cfg.head_dim
    if spec.split in _LINEAR_ROWS:
        raise ValueError(f"part: {spec.name} splits in several ranges; use parts()")
    unit, (lo, hi) = {
        "q": (d, shard.heads), "q_gated": (2 * d, shard.heads),  # each head's q, then gate
        "kv": (d, shard.kv_heads), "heads_in": (d, shard.heads),
        "heads": (1, shard.heads),  # one value per query head (attention sinks)
        "mla_q": (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, shard.heads),
        "mla_kvb": (cfg.qk_nope_head_dim + cfg.v_head_dim, shard.heads),
        "mla_o": (cfg.v_head_dim, shard.heads),
        "ffn": (1, shard.ffn), "expert_ffn": (1, shard.expert_ffn),
        # gate and up interleaved, column 2j and 2j+1 of intermediate column j (gpt-oss)
        "expert_ffn_pairs": (2, shard.expert_ffn),
        "shared_ffn": (1, shard.shared_ffn), "vocab": (1, shard.vocab),
        "rank0": (1, (0, 0) if shard.rank else (0, spec.shape[spec.axis])),
        "lin_v": (cfg.linear_v_dim, shard.lin_v), "lin_heads": (1, shard.lin_v),
    }[spec.split]
    return unit * lo, unit * hi


def parts(spec: TensorSpec, cfg: ModelConfig, shard: Shard) -> list[tuple[int, int]] | None:
    """The element ranges along ``spec.axis`` this shard holds, in the order it holds them
    (concatenated); None: all of it, as stored.

    Gated DeltaNet's fused projections (value heads ``[v0, v1)``, the key heads
    ``[k0, k1)`` they read, ``g`` value heads a key head):

    - ``lin_qkv``: rows (or conv channels) ``[q | k | v]``, every head's q, then k, then v
      (Qwen3.5's ``in_proj_qkv``, both families' ``conv1d``): the shard's q, k and v.
    - ``lin_qkvz``: Qwen3-Next's ``in_proj_qkvz``, per key head ``[q, k, v (g heads),
      z (g heads)]``: regrouped as the shard's ``[q | k | v | z]`` (on one rank too).
    - ``lin_ba``: Qwen3-Next's ``in_proj_ba``, per key head ``[b (g), a (g)]``: regrouped as
      ``[b | a]``.
    """
    if spec.split not in _LINEAR_ROWS:
        rng = part(spec, cfg, shard)
        return None if rng is None else [rng]
    if spec.split == "lin_qkv" and shard.size == 1:
        return None
    dk, dv, nk = cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_k_heads
    g = cfg.linear_v_heads // nk
    (v0, v1), (k0, k1) = shard.lin_v, shard.lin_k
    if spec.split == "lin_qkv":
        return [(k0 * dk, k1 * dk), (nk * dk + k0 * dk, nk * dk + k1 * dk),
                (2 * nk * dk + v0 * dv, 2 * nk * dk + v1 * dv)]
    # per key head: the value heads of its group this shard holds, as offsets in the group
    own = [(max(v0, h * g) - h * g, min(v1, (h + 1) * g) - h * g) for h in range(k0, k1)]
    if spec.split == "lin_ba":
        return [(h * 2 * g + off + a, h * 2 * g + off + b)
                for off in (0, g) for h, (a, b) in zip(range(k0, k1), own)]
    W = 2 * dk + 2 * g * dv  # one key head's rows
    return ([(h * W, h * W + dk) for h in range(k0, k1)]
            + [(h * W + dk, h * W + 2 * dk) for h in range(k0, k1)]
            + [(h * W + 2 * dk + off + a * dv, h * W + 2 * dk + off + b * dv)
               for off in (0, g * dv) for h, (a, b) in zip(range(k0, k1), own)])


def take(a, spec: TensorSpec, cfg: ModelConfig, shard: Shard):
    """This shard's slice of tensor ``a`` (the whole ``spec`` tensor: float32, or a
    :class:`~hpcmac.llm.model.quant.QuantTensor` kept quantized).

    A quantized weight cut along its input axis stays quantized when the cut
    falls on its groups, else it is dequantized first.
    """
    from hpcmac.llm.model.quant import BF16, QuantTensor, as_float

    rngs = parts(spec, cfg, shard)
    if rngs is None:
        return a
    if isinstance(a, BF16):  # the bits cut as they are
        key = (slice(None),) * spec.axis
        return BF16(np.concatenate([a.bits[key + (slice(lo, hi),)] for lo, hi in rngs],
                                   axis=spec.axis))
    if len(rngs) > 1:  # several row ranges (linear attention), concatenated
        if isinstance(a, QuantTensor) and spec.axis == 0:  # whole rows: stays as stored
            return a.map(lambda v: np.ascontiguousarray(
                np.concatenate([v[lo:hi] for lo, hi in rngs])))
        a = as_float(a)
        key = (slice(None),) * spec.axis
        return np.ascontiguousarray(np.concatenate([a[key + (slice(lo, hi),)]
                                                    for lo, hi in rngs], axis=spec.axis))
    lo, hi = rngs[0]
    if isinstance(a, QuantTensor):
        if spec.axis == a.ndim - 1:
            if lo % a.group == 0 and hi % a.group == 0:
                return a.cols(lo, hi)
            a = a.dequantize()
        else:
            key = (slice(None),) * spec.axis + (slice(lo, hi),)
            return a.map(lambda v: np.ascontiguousarray(v[key]))
    key = [slice(None)] * a.ndim
    key[spec.axis] = slice(lo, hi)
    return np.ascontiguousarray(a[tuple(key)])


def cut_on_groups(spec: TensorSpec, cfg: ModelConfig, shard: Shard, group: int,
                  axis: int) -> bool:
    """Whether this shard's slice of a tensor quantized in groups of ``group`` along
    ``axis`` stays quantized: not cut along that axis, or cut on group boundaries
    (else :func:`take` dequantizes it). Several row ranges (linear attention) keep it:
    whole rows."""
    rngs = parts(spec, cfg, shard)
    if rngs is None:
        return True
    if len(rngs) > 1:
        return spec.axis == 0 != axis
    lo, hi = rngs[0]
    return spec.axis != axis or (lo % group == 0 and hi % group == 0)


def local_shape(spec: TensorSpec, cfg: ModelConfig, shard: Shard) -> tuple[int, ...]:
    """The shape of this shard's slice of ``spec``."""
    rngs = parts(spec, cfg, shard)
    if rngs is None:
        return spec.shape
    shape = list(spec.shape)
    shape[spec.axis] = sum(hi - lo for lo, hi in rngs)
    return tuple(shape)


def padded_heads(cfg: ModelConfig, shard: Shard) -> tuple[int, np.ndarray, np.ndarray] | None:
    """Query heads laid out as whole KV groups, when this shard holds part of a group.

    Returns (padded head count, ``q_pad`` (padded,) indices into the local heads
    with ``n_heads`` for an empty slot, ``o_take`` (n_heads,) slots of the real
    heads); None when the local heads are whole groups already.
    """
    if cfg.mla or shard.size == 1:
        return None
    g = cfg.n_heads // cfg.n_kv_heads
    (h0, h1), (k0, _) = shard.heads, shard.kv_heads
    n_pad = shard.n_kv_heads * g
    if n_pad == h1 - h0:
        return None
    heads = k0 * g + np.arange(n_pad)
    real = (heads >= h0) & (heads < h1)
    q_pad = np.where(real, heads - h0, h1 - h0).astype(np.int64)
    o_take = np.nonzero(real)[0].astype(np.int64)
    return n_pad, q_pad, o_take


def padded_qkv_source(q_pad: np.ndarray, hq: int, qd: int, tail: int) -> np.ndarray:
    """Where each value of a padded one-token QKV row comes from, for ``take``.

    ``q_pad`` as :func:`padded_heads` returns it (``hq``, the local query head count,
    marks an empty slot); ``qd`` values per query head; ``tail`` the K and V values after
    the queries. The source row is the shard's QKV row ``(hq qd + tail,)`` with one zero
    appended, the value every empty slot takes. Returns (len(q_pad) qd + tail,) int64.
    """
    zero = hq * qd + tail  # the appended zero
    q = np.where((q_pad < hq)[:, None], q_pad[:, None] * qd + np.arange(qd), zero)
    return np.concatenate([q.reshape(-1), hq * qd + np.arange(tail)]).astype(np.int64)


def is_expert_stack(spec: TensorSpec) -> bool:
    """A routed-expert stack (read with ``ckpt.experts``, not ``ckpt.get``): the canonical
    ``mlp.experts.gate`` / ``up`` / ``down``. A family whose checkpoints hold the experts as
    (E, ...) tensors under their own names (gpt-oss) reads those with ``ckpt.get``."""
    return ".experts." in spec.name and spec.name.rsplit(".", 1)[1] in ("gate", "up", "down")


def is_routed(spec: TensorSpec) -> bool:
    """A tensor of the routed experts, one row of its first axis per expert (a stack or a
    family's own (E, ...) tensor): a token reads ``n_experts_per_tok`` of its rows."""
    return ".experts." in spec.name  # under mlp, or block_sparse_moe (MiniMax); not shared_


#: the matrices a checkpoint storing them in bfloat16 has held in their 2 bytes (as
#: :class:`~hpcmac.llm.model.quant.BF16`; the FP8, MXFP4 and INT4 releases store them so),
#: unless the MLX backend quantizes them (``--quantize``)
BF16_KEPT = ("model.embed_tokens.weight", "lm_head.weight")


def embed_spec(cfg: ModelConfig) -> TensorSpec:
    return TensorSpec("model.embed_tokens.weight", (cfg.vocab, cfg.hidden), "matrix", "vocab",
                      gguf="token_embd.weight")


def head_tensors(cfg: ModelConfig) -> list[TensorSpec]:
    """The final norm and (unless tied to the embedding) the head."""
    out = [TensorSpec("model.norm.weight", (cfg.hidden,), "vector", gguf="output_norm.weight")]
    if not cfg.tie_embeddings:
        out.append(TensorSpec("lm_head.weight", (cfg.vocab, cfg.hidden), "matrix", "vocab",
                              gguf="output.weight"))
    return out
