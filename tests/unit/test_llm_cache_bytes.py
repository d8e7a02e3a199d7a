"""Both planners count the cache the decoder allocates: per-token KV (and DeepSeek-V3.2's
indexer keys) and, for the linear-attention families, each slot's fixed conv and recurrent
states, by the cache's own count (:func:`hpcmac.llm.model.cache.layer_bytes`). No
checkpoint: the families' tiny configs."""

from __future__ import annotations

import numpy as np
import pytest

from hpcmac.llm.model import arch
from hpcmac.llm.model.backend import get_backend
from hpcmac.llm.model.cache import LOAD, SAVE, KVCache
from hpcmac.llm.model.spec import local_config
from hpcmac.llm.parallel.placement import Cluster, LayoutFlags, place
from hpcmac.llm.parallel.plan import GIB
from hpcmac.plan import cluster as clmod
from hpcmac.plan import llm
from hpcmac.plan import machines as mc
from hpcmac.plan.shape import from_config

SLOTS, LEN = 3, 16


class NoWeights:
    """Weights of no bytes: a placement's need is then its cache alone."""

    def __init__(self, c):
        self.c = c

    def whole(self):
        return [0] * self.c.n_layers, 0, 0

    def stage(self, *a, **k):
        return 0


def tiny(name: str):
    fields = {**arch.family(name, "").tiny}
    if name.startswith("qwen3_5"):  # the released layout: the text model nested
        return arch.config_from_hf({"model_type": name, "text_config": fields})
    return arch.config_from_hf({"model_type": name, **fields})


def allocated(c, start: int, end: int, shard=None) -> KVCache:
    local = c if shard is None else local_config(c, shard)
    return KVCache(local, start, end, SLOTS, LEN, get_backend("numpy"),
                   [arch.layer(c, i) for i in range(start, end)])


FAMILIES = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "deepseek_v32", "gpt_oss", "deepseek_v4"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("flags, n", [(LayoutFlags(), 1), (LayoutFlags(pp=2), 2),
                                      (LayoutFlags(tp=2), 2), (LayoutFlags(tp=3), 3),
                                      (LayoutFlags(tp=2, pp=2), 4)])
def test_placement_counts_what_each_rank_allocates(name, flags, n):
    c = tiny(name)
    p = place(c, NoWeights(c), Cluster(("h0",) * n, (8 * GIB,) * n), flags,
              kv_tokens=SLOTS * LEN, sequences=1, slots=SLOTS)
    assert p.json()["slots"] == SLOTS
    for r in range(p.size):
        rp = p.rank(r)
        cache = allocated(c, rp.spec.start, rp.spec.end, rp.shard)
        assert p.need[r] == cache.nbytes, (r, rp.spec)
        if c.linear_v_heads and p.tp > 1:  # split by value heads: fewer than all of them
            assert cache.v[cache.recurrent[0]].shape[1] == rp.shard.n_lin_v < c.linear_v_heads


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_moe"])
def test_the_states_are_per_slot_and_do_not_grow(name):
    c = tiny(name)
    cl = Cluster(("h0",), (8 * GIB,))
    one, three = (place(c, NoWeights(c), cl, kv_tokens=SLOTS * LEN, slots=s).need[0]
                  for s in (1, SLOTS))
    longer = place(c, NoWeights(c), cl, kv_tokens=(SLOTS + 1) * LEN, slots=1).need[0]
    cache = allocated(c, 0, c.n_layers)
    state = sum(cache.k[j].nbytes + cache.v[j].nbytes for j in cache.recurrent)
    assert state and three == cache.nbytes and three - one == state * (SLOTS - 1) // SLOTS
    # a longer context grows only the full-attention layers' KV
    full = [j for j in range(c.n_layers) if j not in cache.recurrent]
    assert longer - one == sum(cache.k[j].nbytes + cache.v[j].nbytes for j in full) // SLOTS


def test_a_layer_that_keeps_no_v_allocates_none():
    """DeepSeek-V4's K = V head: its K and third array alone, as both planners count, and
    prefix blocks save and load without a V; a family that keeps V still allocates it."""
    c = tiny("deepseek_v4")
    cache = allocated(c, 0, c.n_layers)
    assert cache.v == [None] * c.n_layers
    assert cache.nbytes == sum(a.nbytes for a in cache.k) + sum(
        a.nbytes for a in cache.index if a is not None)
    assert cache.k[0].shape == (SLOTS, 1, LEN, c.head_dim)
    rng = np.random.default_rng(0)
    for a in (*cache.k, *(a for a in cache.index if a is not None)):
        a[...] = rng.standard_normal(a.shape, dtype=np.float32)
    cache.apply([(SAVE, 0, 0, 5, 7), (SAVE, 0, 5, 4, 8), (LOAD, 2, 7, 8)])
    assert cache.lengths[2] == 9 and cache.blocks[7].v == [None] * c.n_layers
    for a in cache.k:
        assert np.array_equal(a[2, :, :9], a[0, :, :9])
    for a in cache.index:
        assert a is None or np.array_equal(a[2, :9], a[0, :9])
    assert cache.block_nbytes == sum(
        a.nbytes for b in cache.blocks.values() for a in (*b.k, *(b.index or ())) if a is not None)
    other = allocated(tiny("gpt_oss"), 0, 2)
    assert all(v is not None and v.shape == k.shape for k, v in zip(other.k, other.v))


@pytest.mark.parametrize("name", FAMILIES)
def test_hpcmac_plan_counts_the_same_bytes(name):
    """hpcmac.plan's shape: its cache elements (kv_bytes 4, as hpcmac holds them) are the
    allocated cache's bytes, and a prediction's memory grows by them with the batch."""
    c = tiny(name)
    shape = from_config(c, name, 32.0, "float32")
    cache = allocated(c, 0, c.n_layers)
    assert shape.cache_elements(0, c.n_layers, SLOTS, LEN) * 4 == cache.nbytes
    rates = mc.Rates("x", cores=8, memory_gb=512, dgemm={1: 50.0, 8: 400.0},
                     mem_bw={1: 400.0, 8: 400.0}, flops_fp32=20000.0)
    cl = clmod.Cluster((clmod.Node("n0", rates),), mc.LINKS["tb5-rdma"])
    mem = [llm.predict(cl, shape, llm.LlmCase(batch=b, context=LEN, kv_bytes=4)).memory_gb
           for b in (1, SLOTS)]
    assert (mem[1] - mem[0]) * 1e9 == pytest.approx(cache.nbytes * (SLOTS - 1) / SLOTS)


def test_hpcmac_plan_hops_carry_the_residual_streams():
    """A pipeline hop carries what the runtime sends (``cfg.residual_width``): DeepSeek-V4's
    ``hc_mult`` residual streams, the hidden size elsewhere; on a slow link the hops of
    the wider message cost the prediction the extra bytes' time."""
    from dataclasses import replace

    c, plain = tiny("deepseek_v4"), tiny("llama")
    shape = from_config(c, "deepseek_v4", 32.0, "float32")
    assert shape.link_width == c.residual_width == 3 * c.hidden
    assert from_config(plain, "llama", 32.0, "float32").link_width == plain.hidden
    rates = mc.Rates("x", cores=8, memory_gb=512, dgemm={1: 50.0, 8: 400.0},
                     mem_bw={1: 400.0, 8: 400.0}, flops_fp32=20000.0)
    nodes = tuple(clmod.Node(f"n{i}", rates) for i in range(2))
    cl = clmod.Cluster(nodes, mc.LINKS["10gbe"])
    case = llm.LlmCase(pp=2, batch=64, context=LEN, act_bytes=4, kv_bytes=4)
    wide = llm.predict(cl, shape, case).decode_tok_s
    narrow = llm.predict(cl, replace(shape, residual=c.hidden), case).decode_tok_s
    assert wide < narrow
