"""KV cache of one stage's layers, in slots (one slot per sequence in flight).

Standard attention keeps K and V per layer, ``(slots, kv_heads, max_len, head_dim)``.
Multi-head latent attention (DeepSeek-V3) keeps the compressed latent and the
shared rotary key, ``(slots, max_len, kv_lora_rank)`` and ``(slots, max_len, rope_dim)``:
about 14x smaller than expanded K/V for DeepSeek-V3.

A linear-attention layer (Gated DeltaNet: Qwen3-Next, Qwen3.5) keeps per slot a fixed-size
state instead, whatever the length: its ``k`` is the conv state (slots, K - 1, channels)
and its ``v`` the recurrent state (slots, value heads, dk, dv), numpy float32 on either
backend (:mod:`hpcmac.llm.model.linear_attention`). A sequence at position 0 starts from
zero states; :meth:`KVCache.snapshot` / :meth:`KVCache.restore` copy one slot's states out
and back (a prefix cache needs them at its block boundaries).

All values are local to a rank: each pipeline stage holds only its own layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.fields import ModelConfig



class KVCache:
    """Per-layer key/value storage for ``max_slots`` sequences of up to ``max_len`` tokens."""

    def __init__(self, cfg: ModelConfig, start: int, end: int, max_slots: int, max_len: int,
                 backend, blocks=None):
        """``blocks``: each layer's blocks (:class:`~hpcmac.llm.model.arch.blocks.Layer`);
        a layer whose attention has ``state_shapes`` keeps those states (None: all KV)."""
        self.start, self.end = start, end
        self.max_slots, self.max_len = int(max_slots), int(max_len)
        self.lengths = np.zeros(self.max_slots, dtype=np.int64)  # tokens held per slot
        n = end - start
        zeros = getattr(backend, "cache_zeros", backend.zeros)
        if cfg.mla:
            kv = ((max_slots, max_len, cfg.kv_lora_rank),
                  (max_slots, max_len, cfg.qk_rope_head_dim))
        else:
            kv = ((max_slots, cfg.n_kv_heads, max_len, cfg.head_dim),) * 2
        #: the local indices of the layers with recurrent states
        self.recurrent: list[int] = []
        self.k, self.v = [], []
        for j in range(n):
            att = getattr(blocks[j], "attention", None) if blocks else None
            if hasattr(att, "state_shapes"):
                conv, state = att.state_shapes(cfg)
                self.recurrent.append(j)
                self.k.append(np.zeros((max_slots, *conv), dtype=np.float32))
                self.v.append(np.zeros((max_slots, *state), dtype=np.float32))
            else:
                self.k.append(zeros(kv[0]))
                self.v.append(zeros(kv[1]))

    @staticmethod
    def token_bytes(cfg: ModelConfig) -> int:
        """Bytes one token takes in one layer of a cache for ``cfg`` (a rank's local
        config under tensor parallelism: its KV heads), on average over the model's
        layers: a linear-attention layer's state does not grow (:meth:`state_bytes`)."""
        if cfg.mla:  # the latent and the shared rotary key
            return 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        full = 4 * 2 * cfg.n_kv_heads * cfg.head_dim
        n_linear = sum(cfg.is_linear(i) for i in range(cfg.n_layers))
        if not n_linear:
            return full
        kept = full * (cfg.n_layers - n_linear)  # whole elements, rounded up
        return 4 * -(-kept // (4 * cfg.n_layers))

    @staticmethod
    def state_bytes(cfg: ModelConfig) -> int:
        """Bytes of one sequence's linear-attention states in one such layer (fixed)."""
        C = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
        return 4 * ((cfg.linear_conv_kernel - 1) * C
                    + cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim)

    @property
    def nbytes(self) -> int:
        """Bytes held by this cache (all layers, all slots)."""
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))

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
        return {"length": int(self.lengths[slot]),
                "states": [(self.k[j][slot].copy(), self.v[j][slot].copy())
                           for j in self.recurrent]}

    def restore(self, slot: int, snap: dict) -> None:
        """Put a :meth:`snapshot` back into ``slot``: its recurrent states and length (the
        KV of its attention layers up to that length must be there already)."""
        for j, (conv, state) in zip(self.recurrent, snap["states"]):
            self.k[j][slot] = conv
            self.v[j][slot] = state
        self.lengths[slot] = snap["length"]
