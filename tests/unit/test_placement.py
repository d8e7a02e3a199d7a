"""The placement is one pure value: computed without MPI, from sizes, hosts and flags."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from hpcmac.errors import UsageError
from hpcmac.llm.model.config import ModelConfig
from hpcmac.llm.parallel.placement import (
    Cluster,
    LayoutFlags,
    ModelSizes,
    Placement,
    fixed,
    place,
)
from hpcmac.llm.parallel.plan import GIB, HostMemory, proportional_counts

MIB = 1 << 20


def cfg(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layers=8, hidden=64, vocab=1000, n_heads=64, n_kv_heads=8,
                head_dim=8, intermediate=300)
    return ModelConfig(**{**base, **kw})


class Sizes:
    """Arithmetic sizes: 100 MiB a layer, 50 MiB embedding, 60 MiB head, cut by heads."""

    def __init__(self, c: ModelConfig):
        self.c = c

    def whole(self):
        return [100 * MIB] * self.c.n_layers, 50 * MIB, 60 * MIB

    def stage(self, start, end, first, last, shard=None):
        frac = 1.0 if shard is None else shard.n_heads / self.c.n_heads
        return int(((end - start) * 100 * MIB + first * 50 * MIB + last * 60 * MIB) * frac)


def cluster(n: int, gib: float = 8.0, hosts=None, hostfile=None) -> Cluster:
    return Cluster(tuple(hosts or ["h0"] * n), (int(gib * GIB * n),) * n,
                   tuple(hostfile) if hostfile else None)


def test_pipeline_by_memory_is_the_proportional_split():
    c = cfg()
    p = place(c, Sizes(c), cluster(2), kv_tokens=0, sequences=4)
    assert (p.tp, p.pp, p.how) == (1, 2, "memory")
    assert p.why.startswith("4 sequences keep 2 stages busy")
    counts = proportional_counts([100 * MIB] * 8, 50 * MIB, 60 * MIB, [8 * GIB, 8 * GIB])
    assert [s.n_layers for s in p.stages] == counts
    assert [(s.start, s.end) for s in p.stages] == [(0, counts[0]), (counts[0], 8)]
    assert p.need == (counts[0] * 100 * MIB + 50 * MIB, counts[1] * 100 * MIB + 60 * MIB)
    assert p.budgets == (8 * GIB, 8 * GIB)
    assert p.describe() == f"pipeline: 2 stages, layers {counts} (split by memory)"
    r1 = p.rank(1)
    assert (r1.stage, r1.tp_rank, r1.host, r1.spec.last, r1.shard.heads) == (1, 0, "h0", True,
                                                                             (0, 64))


def test_tensor_3_uneven_heads_and_json():
    c = cfg()
    p = place(c, Sizes(c), cluster(3), LayoutFlags(tp=3), kv_tokens=16)
    assert (p.tp, p.pp, p.why) == (3, 1, "as asked")
    assert [sh.heads for sh in p.shards[0]] == [(0, 22), (22, 43), (43, 64)]
    assert p.describe() == ("layout: tensor 3 (as asked); layers [8], heads per tensor rank "
                            "22/21/21")
    doc = json.loads(json.dumps(p.json()))  # plain JSON
    assert [r["heads"] for r in doc["ranks"]] == [22, 21, 21]
    assert doc["ranks"][1]["ranges"]["heads"] == [22, 43]
    assert doc["ranks"][2]["ranges"]["vocab"] == [667, 1000]
    assert doc["kv_tokens"] == 16 and doc["split"]["tp_shares"] == [[8.0, 8.0, 8.0]]
    # the bytes of each rank: its share of the weights, and of the KV cache (its KV heads)
    from hpcmac.llm.model.cache import KVCache

    kv = KVCache.token_bytes(dataclasses.replace(c, n_kv_heads=p.shards[0][1].n_kv_heads))
    assert p.need[1] == Sizes(c).stage(0, 8, True, True, p.shards[0][1]) + kv * 16 * 8


def test_pipeline_2_x_tensor_2_ranks():
    c = cfg()
    p = place(c, Sizes(c), cluster(4), LayoutFlags(tp=2, pp=2), kv_tokens=0)
    assert (p.tp, p.pp) == (2, 2)
    assert p.members(1) == [2, 3]
    assert [p.rank(r).stage for r in range(4)] == [0, 0, 1, 1]
    assert [p.rank(r).tp_rank for r in range(4)] == [0, 1, 0, 1]
    assert p.rank(3).spec is p.stages[1]


def test_hostfile_budgets_set_the_shares():
    c = cfg()
    hf = [HostMemory("a", 1, 24.0), HostMemory("b", 1, 8.0)]
    p = place(c, Sizes(c), cluster(2, hosts=["a", "b"], hostfile=hf), LayoutFlags(tp=2),
              kv_tokens=0)
    assert p.how == "hostfile" and p.budgets == (24 * GIB, 8 * GIB)
    assert [sh.n_heads for sh in p.shards[0]] == [48, 16]


def test_tp_split_shares():
    c = cfg()
    p = place(c, Sizes(c), cluster(3), LayoutFlags(tp_split="2,1,1"), kv_tokens=0)
    assert p.layout.shares == (2.0, 1.0, 1.0)
    assert [sh.n_heads for sh in p.shards[0]] == [32, 16, 16]


def test_fast_links_and_default_layout():
    c = cfg()
    one = place(c, Sizes(c), cluster(2), kv_tokens=0)
    assert (one.tp, one.pp) == (2, 1)  # one sequence, one host: tensor parallel
    far = place(c, Sizes(c), cluster(2, hosts=["a", "b"]), kv_tokens=0)
    assert (far.tp, far.pp) == (1, 2) and "TCP" in far.why
    rdma = dataclasses.replace(cluster(2, hosts=["a", "b"]), transport="rdma")
    assert rdma.fast_links
    assert place(c, Sizes(c), cluster(2), kv_tokens=0, predicted=(1, 2, "the plan")).why \
        == "the plan"


@pytest.mark.parametrize("flags, kw, expect", [
    (LayoutFlags(tp=3), {}, "--tp 3: 4 ranks do not split into tensor groups of 3"),
    (LayoutFlags(split="4,4"), {}, "--split '4,4' has 2 stages but the job has 4 ranks"),
    (LayoutFlags(pp=4), {"gib": 0.15}, "stage 0 on h0 (layers [0, 2) + embedding) needs "
                                       "0.24 GiB but its memory budget is 0.15 GiB"),
    (LayoutFlags(tp=4), {"gib": 0.1}, "rank 0 on h0 (stage 0, tensor rank 0: layers [0, 8), "
                                      "16 of 64 heads) needs"),
])
def test_refusals_are_one_line(flags, kw, expect):
    c = cfg()
    with pytest.raises(UsageError, match="^" + re.escape(expect)):
        place(c, Sizes(c), cluster(4, **kw), flags, kv_tokens=0)


def test_a_placement_is_a_frozen_value():
    c = cfg()
    p = place(c, Sizes(c), cluster(2), kv_tokens=0, sequences=2)
    assert isinstance(p, Placement)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.how = "x"
    assert p == place(c, Sizes(c), cluster(2), kv_tokens=0, sequences=2)  # pure
    f = fixed(c, ["h0", "h0"], 2, [8])
    assert (f.tp, f.pp, [sh.n_heads for sh in f.shards[0]]) == (2, 1, [32, 32])


def test_model_sizes_read_the_family_spec(tmp_path):
    """ModelSizes counts what the loader holds (stage_nbytes over the tensor spec)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.weights import stage_nbytes
    from hpcmac.measure.llm import write_random_llama

    path = str(write_random_llama(tmp_path / "m", hidden=32, layers=3, intermediate=64,
                                  vocab=128, heads=4, kv_heads=2))
    c = load_config(path)
    sizes = ModelSizes(path)
    sh = make_shards(c, [1, 1])[1]
    assert sizes.stage(0, 3, True, True, sh) == stage_nbytes(path, 0, 3, True, True, shard=sh)
    layers, embed, head = sizes.whole()
    assert sum(layers) + embed + head == stage_nbytes(path, 0, 3, True, True)
    p = place(c, sizes, cluster(2), LayoutFlags(tp=2), kv_tokens=8)
    assert p.need[1] > stage_nbytes(path, 0, 3, True, True, shard=sh)  # + its KV cache


def test_a_draft_model_takes_its_bytes_from_rank_0():
    """Speculative decoding's draft model lives on rank 0: its bytes come off that rank's
    budget before the layers are split, are counted in its need, and refuse in one line."""
    c = cfg()
    plain = place(c, Sizes(c), cluster(2, gib=1.0), LayoutFlags(pp=2), kv_tokens=0)
    res = 300 * MIB
    p = place(c, Sizes(c), cluster(2, gib=1.0), LayoutFlags(pp=2), kv_tokens=0, reserve=res)
    left = proportional_counts([100 * MIB] * 8, 50 * MIB, 60 * MIB, [GIB - res, GIB])
    assert [s.n_layers for s in p.stages] == left != [s.n_layers for s in plain.stages]
    assert p.need[0] == left[0] * 100 * MIB + 50 * MIB + res and p.reserve == res
    assert p.json()["reserve_bytes"] == res and "draft model on rank 0: 0.29 GiB" in p.describe()
    hf = [HostMemory("a", 1, 8.0), HostMemory("b", 1, 8.0)]
    t = place(c, Sizes(c), cluster(2, hosts=["a", "b"], hostfile=hf), LayoutFlags(tp=2),
              kv_tokens=0, reserve=4 * GIB)
    assert [sh.n_heads for sh in t.shards[0]] == [21, 43]  # rank 0's share: 4 of 12 GiB
    with pytest.raises(UsageError, match=r"^rank 0 on h0 needs [\d.]+ GiB, 0.98 of them the "
                                         r"draft model and its KV cache, but its memory "
                                         r"budget is 1.00 GiB"):
        place(c, Sizes(c), cluster(2, gib=1.0), LayoutFlags(split="4,4"), kv_tokens=0,
              reserve=1000 * MIB)


def test_draft_bytes_are_what_the_drafter_holds(tmp_path):
    """runtime.draft_bytes counts the draft's weights as stored and its KV cache of the
    target's slots x length: what _drafter loads and ModelDrafter.start allocates."""
    from hpcmac.llm.model.speculative import ModelDrafter
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import stage_nbytes
    from hpcmac.llm.parallel.runtime import draft_bytes
    from hpcmac.measure.llm import write_random_llama

    path = str(write_random_llama(tmp_path / "d", hidden=32, layers=2, intermediate=64,
                                  vocab=128, heads=4, kv_heads=2))
    assert draft_bytes(None, 64, 1) == draft_bytes("ngram", 64, 1) == 0
    d = ModelDrafter(load_stage(path, 0, 2))
    d.start(3, 40)
    assert draft_bytes(path, 3 * 40, 3) == stage_nbytes(path, 0, 2, True, True) + d.cache.nbytes
