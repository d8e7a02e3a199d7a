"""Stage splits: pure index and byte arithmetic (no MPI, no weights)."""

from __future__ import annotations

import itertools
import json

import pytest

from hpcmac.errors import UsageError
from hpcmac.llm.parallel import plan as S


def brute_force(layer_bytes, embed, head, budgets):
    """Oracle: over every composition of the layers whose stages fit their budgets,
    the smallest max load fraction (layers + head); if none fits, the smallest
    max fill fraction (embedding too)."""
    n, p = len(layer_bytes), len(budgets)
    best_fit, best_any = None, None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        counts = [bounds[i + 1] - bounds[i] for i in range(p)]
        need = S.stage_bytes(counts, layer_bytes, embed, head)
        fill = max(b / c for b, c in zip(need, budgets))
        load = S.stage_bytes(counts, layer_bytes, 0, head)
        worst = max(b / c for b, c in zip(load, budgets))
        if all(b <= c for b, c in zip(need, budgets)):
            best_fit = worst if best_fit is None else min(best_fit, worst)
        best_any = fill if best_any is None else min(best_any, fill)
    return ("load", best_fit) if best_fit is not None else ("fill", best_any)


def test_stages_from_counts_cover_layers_once():
    st = S.stages_from_counts([3, 4, 2])
    assert [(s.start, s.end) for s in st] == [(0, 3), (3, 7), (7, 9)]
    assert [s.first for s in st] == [True, False, False]
    assert [s.last for s in st] == [False, False, True]
    one = S.stages_from_counts([5])[0]
    assert one.first and one.last and one.n_layers == 5
    assert str(st[0]) == "rank 0: layers [0, 3) +embed"


def test_even_counts():
    assert S.even_counts(30, 4) == [8, 8, 7, 7]
    assert S.even_counts(4, 4) == [1, 1, 1, 1]
    assert S.even_counts(7, 1) == [7]


def test_more_ranks_than_layers_is_one_clear_error():
    with pytest.raises(UsageError, match="5 ranks but the model has only 4 layers"):
        S.even_counts(4, 5)
    with pytest.raises(UsageError, match="at most 4 ranks"):
        S.proportional_counts([1] * 4, 0, 0, [1.0] * 5)


@pytest.mark.parametrize(
    "text, msg",
    [
        ("10,10,6", "has 3 stages but the job has 4 ranks"),
        ("10,10,6,5", "sums to 31 layers but the model has 30"),
        ("10,x,6,4", "comma-separated layer counts"),
        ("10,10,10,0", "at least one layer"),
    ],
)
def test_bad_split_is_rejected(text, msg):
    with pytest.raises(UsageError, match=msg):
        S.parse_split(text, 30, 4)


def test_explicit_split():
    assert S.parse_split("10, 10,6,4", 30, 4) == [10, 10, 6, 4]


def test_stage_bytes_counts_embedding_and_head():
    assert S.stage_bytes([2, 1], [10, 20, 30], 5, 7) == [5 + 30, 30 + 7]
    assert S.stage_bytes([3], [10, 20, 30], 5, 7) == [5 + 60 + 7]


def test_equal_budgets_no_extras_is_even():
    c = S.proportional_counts([10] * 30, 0, 0, [1e9] * 4)
    assert sorted(c) == [7, 7, 8, 8]
    assert S.proportional_counts([10] * 12, 0, 0, [1.0] * 3) == [4, 4, 4]


def test_budgets_512_256_split_memory_proportionally():
    # two 512 GB and two 256 GB Macs: twice the layers on the big ones
    c = S.proportional_counts([10] * 30, 0, 0, [512, 256, 256, 512])
    assert c == [10, 5, 5, 10]


def test_head_takes_layers_away_and_embedding_only_when_memory_is_tight():
    # plenty of memory: the head (worth 3 layers of reads per token) takes layers
    # from the last stage; the embedding costs memory, no time, so rank 0 keeps its share
    c = S.proportional_counts([10] * 24, 30, 30, [1000.0] * 3)
    assert c == [9, 9, 6]
    # 100 bytes each: rank 0 can hold only 7 layers beside the embedding
    c = S.proportional_counts([10] * 24, 30, 30, [100.0] * 3)
    assert c == [7, 10, 7]
    need = S.stage_bytes(c, [10] * 24, 30, 30)
    assert max(need) == 100
    # nothing fits: the least overfull split (the fit check then refuses)
    c = S.proportional_counts([10] * 24, 30, 30, [50.0] * 3)
    assert c == [7, 10, 7]


@pytest.mark.parametrize("seed", range(30))
def test_proportional_is_optimal_against_brute_force(seed):
    import random

    rnd = random.Random(seed)
    n = rnd.randint(2, 11)
    p = rnd.randint(1, min(n, 4))
    layer_bytes = [rnd.randint(1, 50) for _ in range(n)]
    embed, head = rnd.randint(0, 80), rnd.randint(0, 80)
    budgets = [rnd.choice([100.0, 200.0, 300.0]) for _ in range(p)]
    c = S.proportional_counts(layer_bytes, embed, head, budgets)
    assert len(c) == p and sum(c) == n and min(c) >= 1
    need = S.stage_bytes(c, layer_bytes, embed, head)
    kind, want = brute_force(layer_bytes, embed, head, budgets)
    if kind == "load":
        assert all(b <= q for b, q in zip(need, budgets))
        load = S.stage_bytes(c, layer_bytes, 0, head)
        got = max(b / q for b, q in zip(load, budgets))
    else:
        got = max(b / q for b, q in zip(need, budgets))
    assert got == pytest.approx(want, rel=1e-9)


def test_check_fit_refuses_naming_stage_and_host():
    st = S.stages_from_counts([2, 2])
    S.check_fit(st, [100, 200], [100, 300])
    with pytest.raises(UsageError, match=r"stage 1 on mac2 \(layers \[2, 4\) \+ head\) needs"):
        S.check_fit(st, [100, 2 * S.GIB], [100, S.GIB], ["mac1", "mac2"])


def test_budgets_from_measured_memory_are_shared_per_host():
    b = S.rank_budgets(["a", "a", "b"], [8, 8, 6])
    assert b == [4, 4, 6]


def test_budgets_from_hostfile_by_name_and_by_slot_order(tmp_path):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({
        "hosts": [
            {"name": "big.local", "slots": 2, "memory_gb": 512, "ips": ["10.0.0.1"]},
            {"name": "small", "slots": 1, "memory_gb": 256, "ssh": "small"},
        ],
        "links": [],
    }))
    hosts = S.read_hostfile(str(hf))
    by_name = S.rank_budgets(["small", "big", "big"], [1, 1, 1], hosts)
    assert by_name == [256 * S.GIB, 256 * S.GIB, 256 * S.GIB]
    # host names not in the file (e.g. ssh aliases): hosts in order
    by_order = S.rank_budgets(["n1", "n1", "n2"], [1, 1, 1], hosts)
    assert by_order == [256 * S.GIB, 256 * S.GIB, 256 * S.GIB]
    by_order = S.rank_budgets(["x", "y", "y"], [1, 1, 1], hosts)
    assert by_order == [512 * S.GIB, 128 * S.GIB, 128 * S.GIB]
    # more hosts than the file lists: the extra one uses its measured memory
    by_order = S.rank_budgets(["x", "y", "z"], [1, 1, 9], hosts)
    assert by_order == [512 * S.GIB, 256 * S.GIB, 9]


def test_hostfile_without_memory_falls_back_to_measured(tmp_path):
    hf = tmp_path / "mlx.json"
    hf.write_text(json.dumps([{"ssh": "m1", "ips": ["10.0.0.1"]}, {"ssh": "m2", "ips": []}]))
    hosts = S.read_hostfile(str(hf))
    assert [h.name for h in hosts] == ["m1", "m2"]
    assert S.rank_budgets(["m1", "m2"], [10, 20], hosts) == [10, 20]


@pytest.mark.parametrize(
    "text, msg",
    [
        ("{", "not JSON"),
        ('{"hosts": []}', "'hosts' is empty"),
        ('{"hosts": [{"slots": 1}]}', r"hosts\[0\]: "),
        ('{"hosts": [{"name": "a", "memory_gb": -1}]}', "'memory_gb' must be positive"),
        ('{"hosts": [{"name": "a", "slots": 0}]}', "'slots' must be a positive integer"),
    ],
)
def test_bad_hostfile(tmp_path, text, msg):
    hf = tmp_path / "h.json"
    hf.write_text(text)
    with pytest.raises(UsageError, match=msg):
        S.read_hostfile(str(hf))


def test_available_memory_is_positive():
    assert S.available_memory() > 0
