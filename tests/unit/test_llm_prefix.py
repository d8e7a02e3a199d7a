"""The prefix cache's index and sizing (pure; the pipeline's use of them: tests/mpi).

Oracle for the index: a brute-force model of what must hold after any sequence of
saves: every cached node's whole chain is cached (no chain cut in the middle), at most
``capacity`` blocks, block ids unique, and a lookup finds exactly the longest cached
run of whole blocks.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_placement import Sizes, cluster

from hpcmac.errors import UsageError
from hpcmac.llm.model.config import ModelConfig
from hpcmac.llm.parallel import prefix as X
from hpcmac.llm.parallel.placement import LayoutFlags, place
from hpcmac.llm.parallel.plan import GIB


def save_all(ix: X.PrefixIndex, tokens) -> list[int]:
    """Save every whole block of ``tokens`` as a sequence does; the nodes saved."""
    chain, b = [], ix.block
    for i in range(len(tokens) // b):
        got = ix.add(chain[-1] if chain else X.ROOT, tokens[i * b:(i + 1) * b])
        if got is None:
            break
        chain.append(got[0])
    return chain


def test_lookup_reuses_whole_blocks_and_keeps_the_last_token():
    ix = X.PrefixIndex(capacity=8, block=4)
    a = list(range(10))
    assert save_all(ix, a) and len(ix) == 2  # 10 tokens: two whole blocks
    assert len(ix.match(a + [99], limit=10)) == 2
    assert len(ix.match(a[:8], limit=7)) == 1  # the last prompt token is computed
    assert len(ix.match([0, 1, 2, 3, 4, 5, 6, 0, 9], limit=8)) == 1  # differs in block 2
    assert ix.match([1] + a, limit=10) == []  # the same tokens shifted: another prefix
    # an existing block: no id to store it in, the same node
    node = ix.match(a, 8)[0]
    assert ix.add(X.ROOT, a[:4]) == (node, None)


def test_the_same_block_after_different_prefixes_is_two_blocks():
    ix = X.PrefixIndex(capacity=8, block=2)
    save_all(ix, [1, 2, 5, 6])
    save_all(ix, [3, 4, 5, 6])
    assert len(ix) == 4
    assert len(ix.match([3, 4, 5, 6, 0], 4)) == 2 and len(ix.match([1, 2, 5, 6, 0], 4)) == 2


def test_eviction_takes_the_least_recent_leaf_and_never_cuts_a_chain():
    ix = X.PrefixIndex(capacity=3, block=1)
    a = save_all(ix, [1, 2])  # chain a1 -> a2
    b = save_all(ix, [7])  # b1
    assert len(ix) == 3
    ix.touch(a)
    c = save_all(ix, [9])  # full: the least recent leaf is b1 (a1 has a child)
    assert ix.alive(c[0]) and not ix.alive(b[0]) and all(ix.alive(n) for n in a)
    assert ix.evictions == 1
    # a chain longer than the cache keeps its start: its own parent is never evicted
    ix2 = X.PrefixIndex(capacity=2, block=1)
    assert len(save_all(ix2, [1, 2, 3, 4])) == 2 and ix2.evictions == 0
    assert len(ix2.match([1, 2, 3, 4], 4)) == 2


def test_random_saves_keep_every_invariant():
    rng = np.random.default_rng(0)
    ix = X.PrefixIndex(capacity=12, block=2)
    for _ in range(300):
        toks = [int(t) for t in rng.integers(0, 3, int(rng.integers(2, 14)))]
        if rng.random() < 0.5:
            ix.touch(ix.match(toks, len(toks)))
        else:
            save_all(ix, toks)
        nodes = ix._nodes
        assert len(nodes) <= 12
        assert len({n.bid for n in nodes.values()}) == len(nodes)  # each id held once
        assert all(0 <= n.bid < 12 for n in nodes.values())
        for node, nd in nodes.items():  # every chain whole; children counted right
            assert ix.alive(nd.key[0])
            assert nd.children == sum(m.key[0] == node for m in nodes.values())
        # a lookup finds exactly the cached run (brute force over the keys)
        probe = [int(t) for t in rng.integers(0, 3, 9)]
        parent, want = X.ROOT, 0
        while (want + 1) * 2 <= 8:
            hit = [n for n, nd in nodes.items()
                   if nd.key == (parent, tuple(probe[want * 2:want * 2 + 2]))]
            if not hit:
                break
            parent, want = hit[0], want + 1
        assert len(ix.match(probe, 8)) == want


def llama(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layers=8, hidden=64, vocab=1000, n_heads=8, n_kv_heads=4,
                head_dim=8, intermediate=300)
    return ModelConfig(**{**base, **kw})


def test_capacity_by_the_largest_rank_and_the_refusal():
    c = llama()
    p = place(c, Sizes(c), cluster(2, gib=2.0), LayoutFlags(pp=2), kv_tokens=1024)
    per = X.block_bytes(c, p)
    # one token: 2 (K, V) x 4 KV heads x 8 dims x 4 bytes a layer; a block of X.BLOCK
    # tokens, times each stage's layers
    assert per == [X.BLOCK * 256 * s.n_layers for s in p.stages]
    n, line = X.capacity(c, p, 0.001)
    assert n == int(0.001 * GIB // max(per)) and line.startswith("prefix cache: ")
    assert X.capacity(c, p, 0) == (0, "prefix cache: off (--prefix-cache-gb 0)")
    n, _ = X.capacity(c, p, None)  # the default: 1 GiB at most half of what is left
    left = min(b - need for b, need in zip(p.budgets, p.need))
    assert n == int(min(GIB, left / 2) // max(per))
    with pytest.raises(UsageError) as e:
        X.capacity(c, p, 64)
    msg = str(e.value)
    assert "\n" not in msg and re.match(r"--prefix-cache-gb 64: rank \d on h0 has \d+\.\d\d "
                                        r"GiB left after the weights", msg), msg
    fits = float(msg.rsplit(" ", 1)[1])
    assert X.capacity(c, p, fits)[0] > 0  # what it says fits does fit


def test_a_family_with_recurrent_state_gets_no_prefix_cache():
    """Qwen3-Next's Gated DeltaNet layers keep a state, not per-token KV: refused in one
    line (and a block save on such a cache raises, should anything get that far)."""
    from hpcmac.llm.model import arch
    from hpcmac.llm.model.backend import get_backend
    from hpcmac.llm.model.cache import KVCache

    c = arch.config_from_hf({"model_type": "qwen3_next", **arch.family("qwen3_next", "").tiny})
    p = place(c, Sizes(c), cluster(1), kv_tokens=16)
    n, line = X.capacity(c, p, 1.0)
    assert n == 0 and "recurrent state" in line and "\n" not in line, line
    cache = KVCache(c, 0, c.n_layers, 1, 8, get_backend("numpy"),
                    [arch.layer(c, i) for i in range(c.n_layers)])
    assert cache.recurrent
    with pytest.raises(RuntimeError, match="recurrent states"):
        cache.save(0, 0, 4, 0)


def test_indexer_keys_are_counted_and_travel_with_prefix_blocks():
    """DeepSeek-V3.2's indexer key cache: counted per token (the planners' token_bytes is
    the cache's bytes per slot, token and layer), and a prefix block saved from one slot
    and loaded into another carries its indexer keys with the latent."""
    from hpcmac.llm.model import arch
    from hpcmac.llm.model.backend import get_backend
    from hpcmac.llm.model.cache import KVCache

    c = arch.config_from_hf({"model_type": "deepseek_v32",
                             **arch.family("deepseek_v32", "").tiny})
    cache = KVCache(c, 0, c.n_layers, 2, 8, get_backend("numpy"),
                    [arch.layer(c, i) for i in range(c.n_layers)])
    assert all(a is not None and a.shape == (2, 8, c.index_head_dim) for a in cache.index)
    assert cache.nbytes == 2 * 8 * c.n_layers * KVCache.token_bytes(c)
    rng = np.random.default_rng(0)
    for a in cache.k + cache.v + cache.index:
        a[0] = rng.standard_normal(a.shape[1:])
    cache.save(0, 0, 4, 7)
    cache.load(1, [7])
    assert cache.lengths[1] == 4
    for a in cache.k + cache.v + cache.index:
        assert np.array_equal(a[1, :4], a[0, :4]) and not a[1, 4:].any()
