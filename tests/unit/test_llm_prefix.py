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


def test_a_family_with_recurrent_state_keeps_it_in_its_blocks():
    """Qwen3-Next's Gated DeltaNet layers keep a state, not per-token KV: the cache is on,
    a block holding the states costs state_cost blocks more (the states' bytes over a
    block's, rounded up); a block saved with the states and loaded into another slot puts
    them back with the attention layers' KV, and one saved without them cannot end a
    loaded prefix; states asked where the slot is not are refused."""
    from hpcmac.llm.model import arch
    from hpcmac.llm.model.backend import get_backend
    from hpcmac.llm.model.cache import LOAD, SAVE, KVCache

    c = arch.config_from_hf({"model_type": "qwen3_next", **arch.family("qwen3_next", "").tiny})
    p = place(c, Sizes(c), cluster(1), kv_tokens=16)
    n, line = X.capacity(c, p, 0.01)
    cost = X.state_cost(c, p)
    states = p.state_bytes(c, 0)
    assert states > 0 and cost == -(-states // max(X.block_bytes(c, p))), (states, cost)
    assert n > 0 and f"takes {cost} more" in line and "\n" not in line, line
    cache = KVCache(c, 0, c.n_layers, 2, 16, get_backend("numpy"),
                    [arch.layer(c, i) for i in range(c.n_layers)])
    rec = set(cache.recurrent)
    assert rec and len(rec) < c.n_layers
    rng = np.random.default_rng(0)
    for a in cache.k + cache.v:
        a[0] = rng.standard_normal(a.shape[1:])
    cache.lengths[0] = 8
    # a SAVE with states and the slot freed by the same message: saved first
    cache.apply([(SAVE, 0, 0, 4, 3, 0), (SAVE, 0, 4, 4, 4, 1)], frees=[0])
    assert cache.lengths[0] == 0 and not any(cache.k[j][0].any() for j in rec)
    assert cache.blocks[3].state is None and cache.blocks[4].state is not None
    cache.apply([(LOAD, 1, 3, 4)])
    assert cache.lengths[1] == 8
    for j, (k, v) in enumerate(zip(cache.k, cache.v)):
        if j in rec:  # the states after token 7, from block 4
            assert np.array_equal(k[1], cache.blocks[4].state[2 * sorted(rec).index(j)])
            assert k[1].any() and v[1].any()
        else:
            assert np.array_equal(k[1, :, :8], k[0, :, :8])  # the KV outlived the free
    with pytest.raises(RuntimeError, match="without the recurrent states"):
        cache.load(0, [3])
    with pytest.raises(RuntimeError, match="holds 8"):
        cache.save(1, 0, 4, 5, state=True)


def test_a_lookup_needing_states_stops_at_the_last_block_holding_them():
    """Needing the states, a reused prefix ends at a block that holds the states; a block
    with them costs 1 + state_cost of the capacity (evicting for it), an existing block
    without them gets them when offered (its own id, to store again), and a block whose
    states do not fit is still kept without them."""
    ix = X.PrefixIndex(capacity=15, block=2, needs_state=True, state_cost=3)
    a = list(range(12))
    chain = []
    for i in range(5):  # blocks 0..4, the states kept with blocks 1 and 3
        node, bid = ix.add(chain[-1] if chain else X.ROOT, a[2 * i:2 * i + 2], i in (1, 3))
        chain.append(node)
    assert ix.used == 5 + 2 * 3
    assert ix.usable(ix.match(a, 11)) == chain[:4]
    assert ix.usable(ix.match(a[:6] + [99] * 6, 11)) == chain[:2]
    other, _ = ix.add(X.ROOT, [50, 51])
    node, bid = ix.add(chain[3], a[8:10], True)  # block 4 offered its states: 15 of 15
    assert node == chain[4] and bid == ix.bid(node) and ix.used == 15
    assert ix.usable(ix.match(a, 11)) == chain and ix.evictions == 0
    # a new block with states (4) evicts the least recent leaves until it fits
    new, _ = ix.add(X.ROOT, [60, 61], True)
    assert ix.evictions == 2 and not ix.alive(other) and not ix.alive(chain[4])
    assert ix.used == 15 - 1 - 4 + 4 and ix.usable(ix.match(a, 11)) == chain[:4]
    small = X.PrefixIndex(capacity=3, block=2, needs_state=True, state_cost=5)
    got = small.add(X.ROOT, [1, 2], True)
    assert got is not None and not small._nodes[got[0]].state and small.used == 1
    assert small.usable(small.match([1, 2, 3], 2)) == []
    plain = X.PrefixIndex(capacity=4, block=2)
    n0, _ = plain.add(X.ROOT, [1, 2], True)  # no states needed: ignored
    assert plain.used == 1 and plain.usable(plain.match([1, 2, 3], 2)) == [n0]


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


def test_partial_finds_the_longest_start_of_a_cached_next_block():
    ix = X.PrefixIndex(capacity=8, block=4)
    save_all(ix, [1, 2, 3, 4, 5, 6, 7, 8])
    save_all(ix, [1, 2, 3, 4, 5, 6, 9, 9])
    first = ix.match([1, 2, 3, 4], 4)
    assert len(first) == 1
    node, m = ix.partial(first[0], [5, 6, 9])
    assert m == 3 and ix._nodes[node].key[1] == (5, 6, 9, 9)
    assert ix.partial(first[0], [5, 0, 0])[1] == 1
    assert ix.partial(first[0], [0]) is None and ix.partial(first[0], []) is None
    assert ix.partial(X.ROOT, [1, 2])[1] == 2  # the first block too
    # evicted blocks are not offered
    ix2 = X.PrefixIndex(capacity=1, block=2)
    save_all(ix2, [1, 2])
    save_all(ix2, [3, 4])
    assert ix2.partial(X.ROOT, [1]) is None and ix2.partial(X.ROOT, [3])[1] == 1
    # nor with recurrent states: they exist at a block's end only
    ix3 = X.PrefixIndex(capacity=4, block=2, needs_state=True)
    save_all(ix3, [1, 2])
    assert ix3.partial(X.ROOT, [1]) is None
