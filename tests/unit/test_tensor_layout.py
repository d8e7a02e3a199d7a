"""Tensor-parallel shares and the layout choice: pure, no MPI."""

from __future__ import annotations

import pytest

from hpcmac.errors import UsageError
from hpcmac.llm.model.config import ModelConfig
from hpcmac.llm.model.spec import make_shards, padded_heads, split_counts
from hpcmac.llm.parallel.layout import choose_layout


def cfg(**kw) -> ModelConfig:
    base = dict(arch="llama", n_layers=4, hidden=64, vocab=1000, n_heads=64, n_kv_heads=8,
                head_dim=8, intermediate=300)
    return ModelConfig(**{**base, **kw})


def test_split_counts():
    assert split_counts(64, [1, 1, 1]) == [22, 21, 21]
    assert split_counts(64, [2, 1, 1]) == [32, 16, 16]
    assert split_counts(9, [1, 1]) == [5, 4]
    assert split_counts(5, [1, 1, 1, 1]) == [2, 1, 1, 1]
    assert sum(split_counts(151936, [512, 256, 256])) == 151936


def test_64_heads_8_kv_heads_over_3_ranks():
    shards = make_shards(cfg(), [1, 1, 1])
    assert [s.heads for s in shards] == [(0, 22), (22, 43), (43, 64)]
    # each rank holds the KV heads its query heads read: groups of 8 query heads
    assert [s.kv_heads for s in shards] == [(0, 3), (2, 6), (5, 8)]
    assert [s.n_heads for s in shards] == [22, 21, 21]
    # rank 1: heads 22..42 in padded slots of KV heads 2..5 (32 slots)
    n_pad, q_pad, o_take = padded_heads(cfg(), shards[1])
    assert n_pad == 32 and len(o_take) == 21
    assert list(o_take[:3]) == [6, 7, 8]  # head 22 is slot 6 of KV head 2 (heads 16..23)
    assert (q_pad == 21).sum() == 32 - 21  # empty slots point at the zero row
    assert sum(s.ffn[1] - s.ffn[0] for s in shards) == 300
    assert shards[0].vocab == (0, 334) and shards[2].vocab == (667, 1000)


def test_even_groups_need_no_padding():
    shards = make_shards(cfg(), [1, 1])
    assert [s.kv_heads for s in shards] == [(0, 4), (4, 8)]
    assert padded_heads(cfg(), shards[0]) is None


def test_memory_shares():
    shards = make_shards(cfg(), [512, 256, 256])
    assert [s.n_heads for s in shards] == [32, 16, 16]
    assert [s.ffn[1] - s.ffn[0] for s in shards] == [150, 75, 75]


def test_too_few_heads_is_refused():
    with pytest.raises(UsageError, match="the model has 3 attention heads, so rank 3"):
        make_shards(cfg(n_heads=3, n_kv_heads=1), [1, 1, 1, 1])
    with pytest.raises(UsageError, match="--tp 4: the model has 3 attention heads"):
        choose_layout(4, cfg(n_heads=3, n_kv_heads=1), tp=4)


def test_layout_choice():
    c = cfg()
    lay = choose_layout(4, c)
    assert (lay.tp, lay.pp) == (4, 1) and "one sequence over fast links" in lay.why
    lay = choose_layout(4, c, sequences=16)
    assert (lay.tp, lay.pp) == (1, 4) and "16 sequences" in lay.why
    lay = choose_layout(2, c, fast_links=False)
    assert (lay.tp, lay.pp) == (1, 2) and "TCP" in lay.why
    assert (choose_layout(4, c, tp=2).pp, choose_layout(4, c, pp=2).tp) == (2, 2)
    assert choose_layout(3, c, tp_split="2,1,1").shares == (2.0, 1.0, 1.0)
    assert choose_layout(4, c, split="1,1,1,1").tp == 1
    assert choose_layout(4, cfg(n_heads=3, n_kv_heads=1)).tp == 1
    assert choose_layout(4, c, tp=2, pp=2).describe() == "pipeline 2 x tensor 2"


@pytest.mark.parametrize("kw, msg", [
    (dict(tp=3), "--tp 3: 4 ranks do not split into tensor groups of 3 (expected a group "
                 "size of 1, 2, 4)"),
    (dict(pp=3), "--pp 3: 4 ranks do not split into 3 stages"),
    (dict(tp=2, pp=1), "--tp 2 x --pp 1 = 2 ranks but the job has 4"),
    (dict(tp_split="2,1,1"), "--tp-split 2,1,1: 4 ranks do not split into tensor groups of 3"),
    (dict(tp=4, tp_split="2,1"), "--tp-split '2,1' has 2 shares but --tp is 4"),
    (dict(tp_split="2,x"), "--tp-split '2,x': expected comma-separated shares"),
    (dict(tp_split="2,0,1,1"), "every share must be a positive number"),
    (dict(tp=4, split="1,1,1,1"), "--split '1,1,1,1' gives layers per pipeline stage"),
])
def test_bad_layouts(kw, msg):
    with pytest.raises(UsageError) as exc:
        choose_layout(4, cfg(), **kw)
    assert msg in str(exc.value)
