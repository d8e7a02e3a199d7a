"""Sampling against transformers' logits processors, and its statistics."""

from __future__ import annotations

import numpy as np
import pytest

from hpcmac.errors import UsageError
from hpcmac.llm.model.sampling import (
    Sampler,
    SamplingParams,
    apply_repetition_penalty,
    filter_top_k_top_p,
)

torch = pytest.importorskip("torch")
gen_utils = pytest.importorskip("transformers.generation.logits_process")


def logits(seed=0, n=50):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3


def test_greedy_is_argmax_and_top_k_1():
    x = logits()
    assert Sampler()(x) == int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=2.0, top_k=1, seed=1))(x) == int(np.argmax(x))


def test_repetition_penalty_matches_transformers():
    x, seen = logits(1), [3, 7, 7, 20, 41]
    ref = gen_utils.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]),
                                                          torch.tensor(x)[None])[0].numpy()
    np.testing.assert_allclose(apply_repetition_penalty(x, seen, 1.3), ref, rtol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (10, 0.5), (0, 0.05)])
def test_top_k_top_p_mask_matches_transformers(top_k, top_p):
    x = logits(2)
    t = torch.tensor(x, dtype=torch.float64)[None]
    if top_k:
        t = gen_utils.TopKLogitsWarper(top_k)(None, t)
    if top_p < 1:
        t = gen_utils.TopPLogitsWarper(top_p)(None, t)
    kept_ref = np.isfinite(t[0].numpy())
    kept = np.isfinite(filter_top_k_top_p(x, top_k, top_p))
    np.testing.assert_array_equal(kept, kept_ref)


def test_frequencies_follow_softmax():
    x = logits(3, 8)
    s = Sampler(SamplingParams(temperature=0.7, seed=11))
    n = 20000
    counts = np.bincount([s(x) for _ in range(n)], minlength=8)
    p = np.exp(x / 0.7 - (x / 0.7).max())
    p /= p.sum()
    sigma = np.sqrt(n * p * (1 - p)) + 1
    assert np.all(np.abs(counts - n * p) < 5 * sigma)


def test_seed_reproducible_and_validation():
    x = logits(4)
    a = Sampler(SamplingParams(temperature=1.0, seed=5))
    b = Sampler(SamplingParams(temperature=1.0, seed=5))
    assert [a(x) for _ in range(20)] == [b(x) for _ in range(20)]
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2),
                dict(repetition_penalty=0)):
        with pytest.raises(UsageError):
            Sampler(SamplingParams(**bad))
