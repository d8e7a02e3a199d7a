"""KV cache of one stage's layers, in slots (one slot per sequence in flight).

Standard attention keeps K and V per layer, ``(slots, kv_heads, max_len, head_dim)``.
Multi-head latent attention (DeepSeek-V3) keeps the compressed latent and the
shared rotary key, ``(slots, max_len, kv_lora_rank)`` and ``(slots, max_len, rope_dim)``:
about 14x smaller than expanded K/V for DeepSeek-V3.

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
                 backend):
        self.start, self.end = start, end
        self.max_slots, self.max_len = int(max_slots), int(max_len)
        self.lengths = np.zeros(self.max_slots, dtype=np.int64)  # tokens held per slot
        n = end - start
        zeros = getattr(backend, "cache_zeros", backend.zeros)
        if cfg.mla:
            self.k = [zeros((max_slots, max_len, cfg.kv_lora_rank)) for _ in range(n)]
            self.v = [zeros((max_slots, max_len, cfg.qk_rope_head_dim)) for _ in range(n)]
        else:
            shape = (max_slots, cfg.n_kv_heads, max_len, cfg.head_dim)
            self.k = [zeros(shape) for _ in range(n)]
            self.v = [zeros(shape) for _ in range(n)]

    @staticmethod
    def token_bytes(cfg: ModelConfig) -> int:
        """Bytes one token takes in one layer of a cache for ``cfg`` (a rank's local
        config under tensor parallelism: its KV heads)."""
        if cfg.mla:  # the latent and the shared rotary key
            return 4 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        return 4 * 2 * cfg.n_kv_heads * cfg.head_dim

    @property
    def nbytes(self) -> int:
        """Bytes held by this cache (all layers, all slots)."""
        return int(sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v))

    def free(self, slot: int) -> None:
        """Forget the sequence in ``slot`` so a new one can use it."""
        self.lengths[slot] = 0
