"""KV cache of one stage's layers, in slots (one slot per sequence in flight).

Standard attention keeps K and V per layer, ``(slots, kv_heads, max_len, head_dim)``.
Multi-head latent attention (DeepSeek-V3) keeps the compressed latent and the
shared rotary key, ``(slots, max_len, kv_lora_rank)`` and ``(slots, max_len, rope_dim)``:
about 14x smaller than expanded K/V for DeepSeek-V3.

A linear-attention layer (Gated DeltaNet: Qwen3-Next, Qwen3.5) keeps per slot a fixed-size
state instead, whatever the length: its ``k`` is the conv state (slots, K - 1, channels)
and its ``v`` the recurrent state (slots, value heads, dk, dv), float32 arrays of the
backend (MLX arrays on MLX, written in the step's graph:
:mod:`hpcmac.llm.model.linear_attention`). A sequence at position 0 starts from
zero states; :meth:`KVCache.snapshot` / :meth:`KVCache.restore` copy one slot's states out
and back (a prefix cache needs them at its block boundaries).

A latent-attention layer with DeepSeek-V3.2's lightning indexer also keeps the indexer's key
per token, :attr:`KVCache.index` (slots, max_len, index_head_dim), the backend's float32
array, saved and loaded with the prefix blocks.

A layer whose attention says ``keeps_v = False`` (DeepSeek-V4: its one K = V head) keeps
no V: its entry in :attr:`KVCache.v` is None, and :func:`layer_bytes` counts its K alone.

All values are local to a rank: each pipeline stage holds only its own layers.

Prefix blocks (:mod:`hpcmac.llm.parallel.prefix`): a rank also keeps copies of runs of
a slot's tokens, :class:`KVBlock`, by a block id that rank 0 chose; :meth:`KVCache.apply`
runs rank 0's ordered save/load instructions, the same on every rank, each on its own
share of the KV (its layers, its KV heads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.fields import ModelConfig

#: prefix-block instructions (rank 0 -> every rank, in order): ``(SAVE, slot, start, n,
#: block id[, state])`` copies tokens ``[start, start + n)`` of ``slot`` into the block,
#: with ``state`` 1 also the slot's recurrent states (the slot must then hold exactly
#: ``start + n`` tokens); ``(LOAD, slot, id, id, ...)`` writes the blocks one after
#: another from position 0, and the last one's recurrent states; ``(TRUNC, slot, n)`` keeps
#: the slot's first ``n`` tokens (a prompt that reuses part of a block)
SAVE, LOAD, TRUNC = 0, 1, 2


@dataclass
class KVBlock:
    """A copy of ``n`` consecutive tokens of one slot, every layer of this rank (local).

    ``k``, ``v``: per layer, the cache's arrays for those tokens (numpy; ``v`` None for a
    layer that keeps no V, both None for a linear-attention layer).
    ``state``: for a model with linear-attention layers, their conv and recurrent states
    after the block's last token, in layer order (conv, recurrent, conv, ...), put back
    when the block ends a loaded prefix; None when the block was saved without them
    (their values at its end were gone: the scheduler then never ends a reuse there).
    """

    n: int
    k: list
    v: list
    state: list | None = None
    #: per layer, the indexer keys of those tokens (None for a layer without an indexer)
    index: list | None = None

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.k)
                   + sum(a.nbytes for a in self.v if a is not None)
                   + sum(getattr(a, "nbytes", 0) for a in self.state or ())
                   + sum(getattr(a, "nbytes", 0) for a in self.index or ()))


def _has_state(layer) -> bool:
    """Whether a layer's blocks keep a recurrent state (their attention has
    ``state_shapes``: linear attention), as :class:`KVCache` lays it out."""
    return hasattr(getattr(layer, "attention", None), "state_shapes")


def _keeps_v(layer) -> bool:
    """Whether a layer's cache has a V array: its attention's ``keeps_v`` (True unless
    it says otherwise; DeepSeek-V4's K = V head says False)."""
    return bool(getattr(getattr(layer, "attention", None), "keeps_v", True))


def recurrent_layers(cfg: ModelConfig) -> list[int]:
    """Global layers that keep a recurrent state instead of per-token KV: a prefix block
    that ends a reused prefix must then hold that state at its end (:attr:`KVBlock.state`)."""
    from hpcmac.llm.model import arch

    return [i for i in range(cfg.n_layers) if _has_state(arch.layer(cfg, i))]


def layer_bytes(cfg: ModelConfig, layer) -> tuple[int, int]:
    """(bytes each token adds, fixed bytes per sequence) of one layer's cache, as
    :class:`KVCache` allocates it for ``cfg`` (a rank's local config under tensor
    parallelism): per-token K and V (K alone where the attention says ``keeps_v =
    False``; or MLA's latent and rotary key) plus the indexer's
    key where the attention has one (``index_dim``), or, for a layer whose attention keeps
    ``state_shapes`` (linear attention), its conv and recurrent states, which do not grow.
    ``layer``: the layer's blocks (:func:`hpcmac.llm.model.arch.layer`). Every array is
    float32."""
    att = getattr(layer, "attention", None)
    if _has_state(layer):
        return 0, 4 * sum(math.prod(s) for s in att.state_shapes(cfg))
    per = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.mla else \
        (2 if _keeps_v(layer) else 1) * cfg.n_kv_heads * cfg.head_dim
    dim = getattr(att, "index_dim", None)
    return 4 * (per + (dim(cfg) if dim is not None else 0)), 0


def stage_cache_bytes(cfg: ModelConfig, start: int, end: int, slots: int,
                      tokens: int) -> int:
    """Bytes of the cache of global layers ``[start, end)`` for ``cfg`` (a rank's local
    config) holding ``tokens`` tokens over ``slots`` sequences (slots x length), as
    :class:`KVCache` allocates them (its ``nbytes``)."""
    from hpcmac.llm.model import arch

    total = 0
    for i in range(start, end):
        per_token, fixed = layer_bytes(cfg.at(i), arch.layer(cfg, i))
        total += per_token * tokens + fixed * slots
    return total


class KVCache:
    """Per-layer key/value storage for ``max_slots`` sequences of up to ``max_len`` tokens."""

    def __init__(self, cfg: ModelConfig, start: int, end: int, max_slots: int, max_len: int,
                 backend, blocks=None):
        """``blocks``: each layer's blocks (:class:`~hpcmac.llm.model.arch.blocks.Layer`);
        a layer whose attention has ``state_shapes`` keeps those states, one whose
        attention says ``keeps_v = False`` no V (None: all K and V)."""
        self.start, self.end = start, end
        self.max_slots, self.max_len = int(max_slots), int(max_len)
        self.lengths = np.zeros(self.max_slots, dtype=np.int64)  # tokens held per slot
        n = end - start
        self.backend, self.mla = backend, bool(cfg.mla)
        #: prefix blocks held by this rank, by the id rank 0 gave them
        self.blocks: dict[int, KVBlock] = {}
        zeros = getattr(backend, "cache_zeros", backend.zeros)
        if cfg.mla:
            kv = ((max_slots, max_len, cfg.kv_lora_rank),
                  (max_slots, max_len, cfg.qk_rope_head_dim))
        #: the local indices of the layers with recurrent states
        self.recurrent: list[int] = []
        self.k, self.v = [], []
        #: per layer, the lightning indexer's key cache (None: the layer has no indexer)
        self.index: list = [None] * n
        for j in range(n):
            dim = getattr(getattr(blocks[j], "attention", None), "index_dim", None) \
                if blocks else None
            if dim is not None:
                self.index[j] = zeros((max_slots, max_len, dim(cfg)))
            if blocks and _has_state(blocks[j]):
                conv, state = blocks[j].attention.state_shapes(cfg)
                self.recurrent.append(j)
                self.k.append(backend.zeros((max_slots, *conv)))
                self.v.append(backend.zeros((max_slots, *state)))
            else:
                lc = cfg.at(start + j)  # its layer type's KV heads and head size
                if not cfg.mla:
                    kv = ((max_slots, lc.n_kv_heads, max_len, lc.head_dim),) * 2
                self.k.append(zeros(kv[0]))
                self.v.append(zeros(kv[1]) if not blocks or _keeps_v(blocks[j]) else None)

    @staticmethod
    def token_bytes(cfg: ModelConfig) -> int:
        """Bytes one token takes in one layer of a cache for ``cfg`` (a rank's local
        config under tensor parallelism: its KV heads), on average over the model's
        layers, in whole float32 elements rounded up (:func:`layer_bytes`; a
        linear-attention layer's state does not grow and is not in it)."""
        from hpcmac.llm.model import arch

        total = sum(layer_bytes(cfg.at(i), arch.layer(cfg, i))[0] for i in range(cfg.n_layers))
        return 4 * -(-total // (4 * cfg.n_layers))

    @property
    def nbytes(self) -> int:
        """Bytes held by this cache (all layers, all slots)."""
        return int(sum(a.nbytes for a in self.k)
                   + sum(a.nbytes for a in (*self.v, *self.index) if a is not None))

    def free(self, slot: int) -> None:
        """Forget the sequence in ``slot`` so a new one can use it (its recurrent states
        zeroed too)."""
        self.lengths[slot] = 0
        for j in self.recurrent:
            self.k[j][slot] = 0.0
            self.v[j][slot] = 0.0

    def snapshot(self, slot: int) -> dict:
        """A copy of ``slot``'s recurrent states and length (:meth:`restore` puts it back,
        in this slot or another): what a prefix cache keeps at a block boundary of a
        linear-attention model, whose states cannot be rebuilt from a prefix of the KV."""
        host = lambda a: np.array(self.backend.to_numpy(a[slot]))  # noqa: E731 (a copy)
        return {"length": int(self.lengths[slot]),
                "states": [(host(self.k[j]), host(self.v[j])) for j in self.recurrent]}

    def restore(self, slot: int, snap: dict) -> None:
        """Put a :meth:`snapshot` back into ``slot``: its recurrent states and length (the
        KV of its attention layers up to that length must be there already)."""
        be = self.backend
        for j, (conv, state) in zip(self.recurrent, snap["states"]):
            self.k[j][slot] = be.asarray(conv)
            self.v[j][slot] = be.asarray(state)
        self.lengths[slot] = snap["length"]

    def hold(self, slots: list[int]):
        """The recurrent states of ``slots`` as they are now, for :meth:`put_back` (a
        decode step built ahead and then dropped must not leave them moved; its KV and
        indexer writes need nothing: the next step at that position overwrites them). On
        MLX these are graph nodes (a gather of the current arrays), computed only if put
        back; None without recurrent layers."""
        if not self.recurrent:
            return None
        idx = self.backend.index(slots)
        return (list(slots), self.lengths[slots].copy(),
                idx, [(self.k[j][idx], self.v[j][idx]) for j in self.recurrent])

    def put_back(self, held) -> None:
        """Write :meth:`hold`'s states (and lengths) back into their slots."""
        if held is None:
            return
        slots, lengths, idx, states = held
        self.lengths[slots] = np.minimum(self.lengths[slots], lengths)  # a freed slot: 0
        for j, (conv, state) in zip(self.recurrent, states):
            self.k[j][idx] = conv
            self.v[j][idx] = state

    # -- prefix blocks -------------------------------------------------------------------

    def _tokens(self, a, slot: int, lo: int, hi: int):
        """The view of tokens ``[lo, hi)`` of ``slot`` in one layer's array."""
        return a[slot, lo:hi] if self.mla else a[slot, :, lo:hi]

    def save(self, slot: int, start: int, n: int, bid: int, state: bool = False) -> None:
        """Copy tokens ``[start, start + n)`` of ``slot`` into block ``bid`` (replacing it);
        with ``state`` also the slot's recurrent states, which must be those after token
        ``start + n - 1`` (the slot holds exactly ``start + n`` tokens).

        The slot may be freed by the same control message (its sequence ended after
        feeding them): :meth:`apply` saves before it frees."""
        if not 0 <= start < start + n <= self.max_len:
            raise RuntimeError(f"prefix block {bid}: tokens [{start}, {start + n}) are "
                               f"outside the context of {self.max_len}")
        be = self.backend
        rec = set(self.recurrent)
        take = lambda j, a: None if a is None or j in rec else np.array(  # noqa: E731
            be.to_numpy(self._tokens(a, slot, start, start + n)))
        index = None
        if any(a is not None for a in self.index):
            index = [None if a is None else np.array(be.to_numpy(a[slot, start:start + n]))
                     for a in self.index]
        states = None
        if state and self.recurrent:
            if int(self.lengths[slot]) != start + n:
                raise RuntimeError(f"prefix block {bid}: its states are asked after token "
                                   f"{start + n} of slot {slot}, which holds "
                                   f"{int(self.lengths[slot])}")
            states = [a for pair in self.snapshot(slot)["states"] for a in pair]
        self.blocks[bid] = KVBlock(n, [take(j, a) for j, a in enumerate(self.k)],
                                   [take(j, a) for j, a in enumerate(self.v)], state=states,
                                   index=index)

    def load(self, slot: int, bids) -> None:
        """Write blocks ``bids`` one after another into ``slot`` from position 0; the
        slot then holds their tokens, and the last block's recurrent states."""
        be = self.backend
        blks = [self.blocks[bid] for bid in bids]
        pos = sum(blk.n for blk in blks)
        if pos > self.max_len:
            raise RuntimeError(f"prefix blocks overflow the context of {self.max_len}")
        if not blks:
            self.lengths[slot] = 0
            return
        if self.recurrent:
            if blks[-1].state is None:
                raise RuntimeError(f"prefix block {bids[-1]} ends a loaded prefix without "
                                   "the recurrent states after it")
            it = iter(blks[-1].state)
            self.restore(slot, {"length": pos, "states": list(zip(it, it))})

        def joined(parts, axis):  # one write a layer, not one a block (small blocks)
            return be.asarray(parts[0] if len(parts) == 1 else np.concatenate(parts, axis))

        rec = set(self.recurrent)
        for li, a in enumerate(self.k):
            if li not in rec:
                self._put(a, slot, pos, joined([blk.k[li] for blk in blks],
                                               0 if self.mla else 1))
        for li, a in enumerate(self.v):
            if a is not None and li not in rec:  # not a layer that keeps no V
                self._put(a, slot, pos, joined([blk.v[li] for blk in blks],
                                               0 if self.mla else 1))
        for li, a in enumerate(self.index):
            if a is not None and blks[0].index is not None:
                a[slot, :pos] = joined([blk.index[li] for blk in blks], 0)
        self.lengths[slot] = pos

    def _put(self, a, slot: int, n: int, data) -> None:
        """Write ``data`` as tokens ``[0, n)`` of ``slot`` in one layer's array."""
        if self.mla:
            a[slot, :n] = data
        else:
            a[slot, :, :n] = data

    def apply(self, ops, frees=()) -> None:
        """Rank 0's prefix-block instructions (:data:`SAVE`, :data:`LOAD`, :data:`TRUNC`),
        in order, with
        the slots its control message frees: each is freed just before the first LOAD
        into it, else after the instructions, so that a block saved from a sequence that
        just ended still finds its slot's recurrent states (its KV outlives a free)."""
        pending = {int(slot) for slot in frees}
        for op in ops:
            if op[0] == SAVE:
                self.save(int(op[1]), int(op[2]), int(op[3]), int(op[4]),
                          len(op) > 5 and bool(op[5]))
            elif op[0] == LOAD:
                if int(op[1]) in pending:
                    pending.discard(int(op[1]))
                    self.free(int(op[1]))
                self.load(int(op[1]), [int(b) for b in op[2:]])
            elif op[0] == TRUNC:
                self.truncate(int(op[1]), int(op[2]))
            else:
                raise RuntimeError(f"unknown prefix-block instruction {op[0]!r}")
        for slot in sorted(pending):
            self.free(slot)

    @property
    def block_nbytes(self) -> int:
        """Bytes held by this rank's prefix blocks."""
        return sum(b.nbytes for b in self.blocks.values())
    def truncate(self, slot: int, n: int) -> None:
        """Keep the first ``n`` tokens of ``slot`` (speculative decoding's rejected
        drafts, written by the step that verified them, are dropped, as are the tokens of
        a loaded block past what a prompt shares with it; their keys and values are
        overwritten by the next tokens)."""
        self.lengths[slot] = min(int(self.lengths[slot]), int(n))
