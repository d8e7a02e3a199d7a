"""The routers on MLX arrays choose what they choose on numpy arrays, ties included.

Each router (``layers.route_*``) is one function over ``xp``; on the MLX backend it runs
as MLX ops (no host round trip). Logits with many exact ties (small integers), -inf
rows of masked groups and a saturated sigmoid must give the same expert ids in the same
order (a tie to the lower index, numpy's stable sort; MLX's CPU sort is stable) and
weights within float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcmac.llm.model import layers
from hpcmac.llm.model.arch.fields import ModelConfig

mx = pytest.importorskip("mlx.core")


def _logits(seed: int, T: int, E: int) -> np.ndarray:
    """(T, E) float32 with exact ties: small integers over 4, and saturated rows."""
    rng = np.random.default_rng(seed)
    a = (rng.integers(-3, 4, (T, E)) / 4).astype(np.float32)
    a[0] = 0.0  # every expert tied
    a[1, ::2] = 40.0  # sigmoid(40) == 1.0 in float32: tied scores
    return a


def _same(got, want):
    idx, wts = got
    np.testing.assert_array_equal(np.array(idx), want[0])
    np.testing.assert_allclose(np.array(wts), want[1], rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("k, norm", [(1, False), (2, True), (5, True)])
def test_softmax_topk(k, norm):
    x = _logits(1, 24, 12)
    want = layers.route_softmax(np, x, k, norm)
    _same(layers.route_softmax(mx, mx.array(x), k, norm), want)


@pytest.mark.parametrize("k", [1, 4])
def test_topk_softmax(k):
    x = _logits(2, 24, 8)
    _same(layers.route_topk_softmax(mx, mx.array(x), k), layers.route_topk_softmax(np, x, k))


@pytest.mark.parametrize("groups, topk_group, k, norm", [
    (4, 2, 3, True),  # DeepSeek-V3's shape, smaller
    (8, 3, 6, False),  # groups of two: each group scored by both of its experts
    (1, 1, 2, True),  # ungrouped (MiniMax-M2, GLM-4 with n_group 1)
])
def test_sigmoid_grouped(groups, topk_group, k, norm):
    E = 16
    cfg = ModelConfig("deepseek_v3", 1, 8, 8, 1, 1, 8, 8, n_experts=E, n_group=groups,
                      topk_group=topk_group, n_experts_per_tok=k, norm_topk_prob=norm,
                      routed_scaling_factor=2.5)
    x = _logits(3, 32, E)
    bias = (np.random.default_rng(4).integers(-2, 3, E) / 8).astype(np.float32)
    want = layers.route_grouped_sigmoid(np, x, bias, cfg)
    # each token's experts lie in at most topk_group groups
    assert max(len(set(row // (E // groups))) for row in want[0]) <= topk_group
    _same(layers.route_grouped_sigmoid(mx, mx.array(x), mx.array(bias), cfg), want)
