"""Generation on one rank: prefill, then decode with the KV cache, one or many sequences.

:class:`Generator` drives a whole-model :class:`~hpcmac.llm.model.Stage`. The
pieces part 2 reuses are :func:`check_prompt` and :class:`StopChecker`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.sampling import Sampler, SamplingParams
from hpcmac.llm.model.stage import Batch, Stage


def check_prompt(n_prompt: int, context: int) -> None:
    """A prompt must leave room for at least one generated token."""
    if n_prompt == 0:
        raise UsageError("the prompt is empty")
    if n_prompt >= context:
        raise UsageError(f"the prompt has {n_prompt} tokens; the context holds {context} "
                         "(expected fewer; raise --max-context if the model allows)")


class StopChecker:
    """Decides when a sequence ends: an EOS id, a stop string in the text, or a length."""

    def __init__(self, eos_ids=(), stop_strings=(), tokenizer=None):
        self.eos = {int(e) for e in eos_ids}
        self.stops = [s for s in stop_strings if s]
        if self.stops and tokenizer is None:
            raise UsageError("--stop needs a tokenizer (the model has none)")
        self.tok = tokenizer

    def hit(self, generated: list[int]) -> tuple[bool, str | None]:
        """(stop now, reason) after the latest token of ``generated``."""
        if generated and generated[-1] in self.eos:
            return True, "eos"
        if self.stops:
            text = self.tok.decode(generated)
            if any(s in text for s in self.stops):
                return True, "stop"
        return False, None

    def trim(self, text: str) -> str:
        """Text cut at the first stop string."""
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        return text if cut < 0 else text[:cut]


@dataclass
class Result:
    """One generated sequence with its timings."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first token comes from prefill's logits; decode steps make the rest
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0


class Generator:
    """Whole model on one rank: ``generate`` (one prompt) and ``generate_batch`` (several)."""

    def __init__(self, stage: Stage, max_len: int | None = None, max_slots: int = 1):
        if not (stage.first and stage.last):
            raise ValueError("Generator needs a stage with the embedding and the head")
        self.stage = stage
        self.max_len = int(max_len or stage.config.max_position)
        self.max_slots = max_slots
        self.cache = stage.new_cache(max_slots, self.max_len)

    def _step(self, tokens: list[int], batch: Batch) -> np.ndarray:
        st = self.stage
        h = st.forward(st.embed(tokens), batch, self.cache)
        ends = np.cumsum(batch.lengths) - 1
        return st.logits(h[ends])

    def generate(self, prompt: list[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stop: StopChecker | None = None,
                 on_token: Callable[[int], None] | None = None) -> Result:
        """Prefill ``prompt``, then decode up to ``max_tokens`` tokens (greedy by default)."""
        return self.generate_batch([prompt], max_tokens, sampling, stop,
                                   None if on_token is None else lambda i, t: on_token(t))[0]

    def generate_batch(self, prompts: list[list[int]], max_tokens: int,
                       sampling: SamplingParams | None = None, stop: StopChecker | None = None,
                       on_token: Callable[[int, int], None] | None = None) -> list[Result]:
        """Generate for several prompts at once: one packed prefill, then batched decode.

        Each sequence gets its own cache slot and sampler (same parameters); a
        sequence that stops leaves the batch while the others go on.
        """
        if len(prompts) > self.cache.max_slots:
            self.cache = self.stage.new_cache(len(prompts), self.max_len)
        for p in prompts:
            check_prompt(len(p), self.max_len)
        stop = stop or StopChecker(self.stage.config.eos_token_ids)
        sampling = sampling or SamplingParams()
        samplers = [Sampler(SamplingParams(**{**sampling.__dict__,
                                              "seed": None if sampling.seed is None
                                              else sampling.seed + i}))
                    for i in range(len(prompts))]
        results = [Result(list(p)) for p in prompts]
        slots = list(range(len(prompts)))
        for s in slots:
            self.cache.free(s)
        t0 = time.perf_counter()
        logits = self._step([t for p in prompts for t in p],
                            Batch(slots, [len(p) for p in prompts], [0] * len(prompts)))
        t1 = time.perf_counter()
        for r in results:
            r.prefill_s = t1 - t0
        active = []
        for i, r in enumerate(results):
            if self._accept(i, r, logits[i], samplers[i], stop, max_tokens, on_token):
                active.append(i)
        while active:
            t0 = time.perf_counter()
            pos = [len(results[i].prompt_tokens) + len(results[i].tokens) - 1 for i in active]
            logits = self._step([results[i].tokens[-1] for i in active],
                                Batch(active, [1] * len(active), pos))
            dt = time.perf_counter() - t0
            still = []
            for row, i in enumerate(active):
                results[i].decode_s += dt
                if self._accept(i, results[i], logits[row], samplers[i], stop, max_tokens,
                                on_token):
                    still.append(i)
            active = still
        return results

    def _accept(self, i, r: Result, logits, sampler, stop, max_tokens, on_token) -> bool:
        """Sample a token for sequence i; True if it goes on."""
        if max_tokens <= 0:
            r.finish_reason = "length"
            return False
        tok = sampler(logits, r.prompt_tokens + r.tokens)
        r.tokens.append(tok)
        if on_token is not None:
            on_token(i, tok)
        done, why = stop.hit(r.tokens)
        if done:
            r.finish_reason = why
            return False
        if len(r.tokens) >= max_tokens or len(r.prompt_tokens) + len(r.tokens) >= self.max_len:
            r.finish_reason = "length"
            return False
        return True
