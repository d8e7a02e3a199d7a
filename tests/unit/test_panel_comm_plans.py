"""Pure plans behind the panel broadcast (six topologies) and the row swaps."""

import numpy as np
import pytest

from hpcmac.linalg.broadcast import VARIANTS, plan
from hpcmac.linalg.swap import pivot_moves


def simulate(variant, q, n):
    """Run every rank's phases against each other: all data arrives, nothing is left over."""
    have = {r: set(range(n)) if r == 0 else set() for r in range(q)}
    plans = {r: plan(variant, q, r, n) for r in range(q)}
    pos = dict.fromkeys(range(q), 0)
    posted = dict.fromkeys(range(q), False)
    msgs = []
    progress = True
    while progress:
        progress = False
        for r in range(q):
            if pos[r] >= len(plans[r]):
                continue
            phase = plans[r][pos[r]]
            if not posted[r]:
                for kind, peer, lo, hi in phase:
                    if kind == "send":
                        assert set(range(lo, hi)) <= have[r], f"rank {r} sends data it lacks"
                        msgs.append((r, peer, lo, hi))
                posted[r] = progress = True
            if all(k == "send" or (p, r, lo, hi) in msgs for k, p, lo, hi in phase):
                for kind, peer, lo, hi in phase:
                    if kind == "recv":
                        have[r] |= set(range(lo, hi))
                        msgs.remove((peer, r, lo, hi))
                pos[r] += 1
                posted[r] = False
                progress = True
    return have, pos, plans, msgs


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("q", range(1, 8))
def test_bcast_plan_delivers_everything(variant, q):
    have, pos, plans, msgs = simulate(variant, q, 23)
    assert all(len(have[r]) == 23 for r in range(q)), "some rank misses data (or deadlock)"
    assert all(pos[r] == len(plans[r]) for r in range(q))
    assert not msgs


def test_bcast_topologies_as_netlib():
    # 1ringM: the next panel's owner (rel 1) hears first and forwards nothing
    assert plan("1ringM", 5, 1, 10) == [[("recv", 0, 0, 10)]]
    assert plan("1ringM", 5, 0, 10)[0] == [("send", 1, 0, 10), ("send", 2, 0, 10)]
    # 1ring forwards
    assert plan("1ring", 4, 1, 10) == [[("recv", 0, 0, 10)], [("send", 2, 0, 10)]]
    # long: the root scatters one piece to each of the others
    assert [s[1] for s in plan("long", 4, 0, 9)[0]] == [1, 2, 3]
    with pytest.raises(ValueError, match="bcast"):
        plan("3ring", 4, 0, 9)


@pytest.mark.parametrize("seed", range(6))
def test_pivot_moves_match_sequential_swaps(seed):
    rng = np.random.default_rng(seed)
    n, j, jb = 40, 8, 6
    ipiv = [int(rng.integers(j + k, n)) for k in range(jb)]
    rows = np.arange(n)
    for k in range(jb):
        rows[[j + k, ipiv[k]]] = rows[[ipiv[k], j + k]]
    usrc, outs = pivot_moves(j, jb, ipiv)
    assert usrc == list(rows[j:j + jb])
    moved = {d: s for d, s in outs}
    for d in range(j + jb, n):
        assert rows[d] == moved.get(d, d)
    assert all(j <= s < j + jb for _, s in outs)  # only block rows leave the block
