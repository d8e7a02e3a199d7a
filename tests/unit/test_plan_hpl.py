"""hpcmac.plan's HPL model: the published anchors, monotonic properties, suggestions."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcmac.plan import cluster as clmod
from hpcmac.plan import hpl
from hpcmac.plan import machines as mc


def top500_n(ram_gb: float, nodes: int) -> int:
    """N as geerlingguy/top500-benchmark writes it into HPL.dat (its example.config.yml):
    0.9 * sqrt(ram_in_gb * 2^30 * nodes / 8), ram_in_gb = 0.75 of the node's memory."""
    return int(math.sqrt(int(0.75 * ram_gb) * 2 ** 30 * nodes / 8) * 0.9)


def _m3_ultra(memory: list[float], slots: int, link: str = "2.5gbe") -> clmod.Cluster:
    return clmod.build(machine="m3-ultra", nodes=len(memory), link=link, memory_gb=memory,
                       slots=slots, blas_threads=1)


# ------------------------------------------------------------------ the seeds' table

def test_published_hpl_one_m3_ultra():
    """1,278.6 Gflops on one 512 GB M3 Ultra (top500-benchmark: one rank per core, 1 x 32)."""
    cl = _m3_ultra([512], slots=32)
    r = hpl.predict(cl, hpl.HplCase(top500_n(512, 1), 256, 1, 32))
    assert r.gflops == pytest.approx(1278.6, rel=0.25)


def test_published_hpl_four_m3_ultra_over_2_5gbe():
    """3,731.1 Gflops on 2 x 512 + 2 x 256 GB over 2.5 GbE; 128 ranks, 8 x 16 (Q > P),
    N from the smaller nodes' memory (HPL spreads the matrix evenly)."""
    cl = _m3_ultra([512, 512, 256, 256], slots=32)
    r = hpl.predict(cl, hpl.HplCase(top500_n(256, 4), 256, 8, 16))
    assert r.gflops == pytest.approx(3731.1, rel=0.25)
    # the links, not the nodes, cost the difference from 4x one node
    assert r.swap_s > 0.2 * r.time_s


def test_four_nodes_over_thunderbolt_beat_ethernet():
    eth = _m3_ultra([256] * 4, slots=32)
    tb = _m3_ultra([256] * 4, slots=32, link="tb5-rdma")
    case = hpl.HplCase(top500_n(256, 4), 256, 8, 16)
    assert hpl.predict(tb, case).gflops > 1.3 * hpl.predict(eth, case).gflops


# ------------------------------------------------------------- monotonic properties

def _cluster(beta: float, alpha: float, gflops: float, bw: float, nodes: int,
             slots: int) -> clmod.Cluster:
    rates = mc.Rates("x", cores=4, memory_gb=64, dgemm={1: gflops / 4, 4: gflops},
                     mem_bw={1: bw / 2, 4: bw})
    link = mc.Link("x", alpha, beta, "test", switched=True)
    return clmod.Cluster(tuple(clmod.Node(f"n{i}", rates, slots) for i in range(nodes)), link)


cases = st.tuples(
    st.sampled_from([1000, 4000, 10000]), st.sampled_from([64, 128, 256]),
    st.sampled_from([(1, 1), (1, 2), (2, 2), (1, 4), (2, 4)]), st.sampled_from([0, 1]),
    st.sampled_from(hpl.BCASTS), st.sampled_from(hpl.SWAPS))
machines_ = st.tuples(st.floats(1e8, 1e10), st.floats(1e-6, 1e-3), st.floats(10, 1000),
                      st.floats(5, 500), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]))


def _time(m, c) -> float:
    beta, alpha, gf, bw, nodes, slots = m
    n, nb, (p, q), depth, bcast, swap = c
    cl = _cluster(beta, alpha, gf, bw, nodes, slots)
    if p * q > cl.ranks:
        cl = _cluster(beta, alpha, gf, bw, p * q, 1)
    return hpl.predict(cl, hpl.HplCase(n, nb, p, q, depth, bcast, swap)).time_s


@settings(max_examples=60, deadline=None, derandomize=True)
@given(machines_, cases, st.floats(1.01, 10))
def test_more_of_anything_never_predicts_slower(m, c, factor):
    beta, alpha, gf, bw, nodes, slots = m
    base = _time(m, c)
    assert _time((beta * factor, alpha, gf, bw, nodes, slots), c) <= base * (1 + 1e-12)
    assert _time((beta, alpha / factor, gf, bw, nodes, slots), c) <= base * (1 + 1e-12)
    assert _time((beta, alpha, gf * factor, bw, nodes, slots), c) <= base * (1 + 1e-12)
    assert _time((beta, alpha, gf, bw * factor, nodes, slots), c) <= base * (1 + 1e-12)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(machines_, cases)
def test_bigger_problems_take_longer_and_never_beat_the_dgemm_peak(m, c):
    n, nb, grid, depth, bcast, swap = c
    t = _time(m, c)
    assert _time(m, (n * 2, nb, grid, depth, bcast, swap)) > t
    beta, alpha, gf, bw, nodes, slots = m
    p, q = grid
    # no more than every rank's DGEMM at full speed
    ranks = p * q
    cl = _cluster(beta, alpha, gf, bw, max(nodes, ranks), 1)
    r = hpl.predict(cl, hpl.HplCase(n, nb, p, q, depth, bcast, swap))
    assert r.gflops <= ranks * r.rank_gflops
    # look-ahead never hurts
    if depth == 0:
        assert _time(m, (n, nb, grid, 1, bcast, swap)) <= t * (1 + 1e-12)


# --------------------------------------------------------------------- suggestions

def test_suggestion_fills_the_smallest_node_and_prefers_square_grids_on_slow_links():
    cl = _m3_ultra([512, 512, 256, 256], slots=1)
    best = hpl.suggest(cl, fill=0.8)
    top = best[0]
    assert top.p * top.q == 4 and top.p <= top.q
    assert top.memory_fraction == pytest.approx(0.8, rel=0.02)
    # sorted fastest first
    assert [r.gflops for r in best] == sorted((r.gflops for r in best), reverse=True)
    assert all(r.n % r.nb == 0 for r in best)


def test_grids_and_placement():
    assert hpl.grids(4) == [(1, 4), (2, 2)]
    assert hpl.grids(6) == [(1, 6), (2, 3)]
    cl = replace(_m3_ultra([512, 256], slots=2))
    assert cl.placement(4) == [0, 0, 1, 1]
    with pytest.raises(Exception, match="5 ranks asked for but the cluster has 4 slots"):
        cl.placement(5)
