"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty.

Semantics follow transformers' logits processors: the repetition penalty
divides positive logits (multiplies negative ones) of tokens already seen,
then temperature, then top-k, then top-p (the smallest set of most likely
tokens whose probability reaches ``top_p``). ``temperature == 0`` is greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcmac.errors import UsageError


@dataclass
class SamplingParams:
    """How to pick tokens (global: every rank that samples must agree)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None
    grammar: str | None = None  # constrained decoding: llguidance's grammar (hpcmac.llm.grammar)
    logprobs: int = -1  # -1: off; k >= 0: the chosen token's logprob and the k most likely
    draws: int = 0  # tokens generated before (a resumed stream: its draws are skipped)

    def validate(self) -> None:
        if self.temperature < 0:
            raise UsageError(f"--temperature {self.temperature}: expected >= 0")
        if self.top_k < 0:
            raise UsageError(f"--top-k {self.top_k}: expected >= 0")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"--top-p {self.top_p}: expected in (0, 1]")
        if not -1 <= self.logprobs <= 20:
            raise UsageError(f"logprobs {self.logprobs}: expected -1 (off) to 20")
        if self.repetition_penalty <= 0:
            raise UsageError(f"--repetition-penalty {self.repetition_penalty}: expected > 0")
        if self.draws < 0:
            raise UsageError(f"draws {self.draws}: expected >= 0")


def apply_repetition_penalty(logits: np.ndarray, seen, penalty: float) -> np.ndarray:
    """transformers' rule: seen tokens' logits divided by penalty if > 0, else multiplied."""
    if penalty == 1.0 or len(seen) == 0:
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(seen, dtype=np.int64))
    v = out[ids]
    out[ids] = np.where(v > 0, v / penalty, v * penalty)
    return out


def filter_top_k_top_p(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Logits with everything outside top-k / top-p set to -inf (1-D, float64)."""
    out = logits.astype(np.float64)
    if 0 < top_k < out.size:
        kth = np.partition(out, -top_k)[-top_k]
        out[out < kth] = -np.inf
    if top_p < 1.0:
        order = np.argsort(-out, kind="stable")
        p = np.exp(out[order] - out[order[0]])
        p /= p.sum()
        cum = np.cumsum(p)
        drop = cum - p >= top_p  # tokens whose predecessors already reach top_p
        drop[0] = False
        out[order[drop]] = -np.inf
    return out


class Sampler:
    """Stateful sampler: each non-greedy token takes exactly one uniform draw from its
    generator, so a stream resumed after ``n`` tokens (``draws=n``, the same seed) draws
    what the uninterrupted stream would have (:mod:`hpcmac.llm.survive`)."""

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.params.validate()
        self.rng = np.random.default_rng(self.params.seed)
        if self.params.draws and self.params.temperature != 0.0:
            self.rng.random(self.params.draws)  # the draws the earlier tokens took

    def __call__(self, logits: np.ndarray, seen=(), mask: np.ndarray | None = None) -> int:
        """Next token from one row of logits (vocab,); ``seen``: prompt + generated ids;
        ``mask``: the packed allowed set of a grammar (hpcmac.llm.grammar), or None."""
        if mask is not None:
            from hpcmac.llm.grammar import apply_mask

            logits = apply_mask(np.array(logits), mask)
        probs = self.probs(logits, seen)
        if probs is None:
            return self.greedy(logits, seen)
        return self.draw(probs)

    def draw(self, probs: np.ndarray) -> int:
        """A token from ``probs`` by the inverse CDF of one uniform draw (what
        ``Generator.choice(p=...)`` does)."""
        cdf = np.cumsum(probs)
        return int(min(np.searchsorted(cdf / cdf[-1], self.rng.random(), side="right"),
                       cdf.size - 1))

    def greedy(self, logits: np.ndarray, seen=()) -> int:
        """The most likely token (after the repetition penalty): temperature 0's choice."""
        return int(np.argmax(apply_repetition_penalty(np.asarray(logits), seen,
                                                      self.params.repetition_penalty)))

    def probs(self, logits: np.ndarray, seen=()) -> np.ndarray | None:
        """The distribution :meth:`__call__` draws from (float64, sums to 1), or None
        at temperature 0 (greedy: :meth:`greedy`)."""
        p = self.params
        if p.temperature == 0.0:
            return None
        x = apply_repetition_penalty(np.asarray(logits), seen, p.repetition_penalty)
        x = filter_top_k_top_p(x.astype(np.float64) / p.temperature, p.top_k, p.top_p)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        return probs
