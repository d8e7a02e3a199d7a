"""Speculative decoding's model-side parts: drafts, and the rule that verifies them.

A *draft* proposes ``k`` tokens after a sequence's last one; the target runs the
last token and the ``k`` drafts in one forward (``k + 1`` rows of logits) and
:func:`verify` keeps the longest prefix it agrees with, plus one token of its own,
so each step emits 1 to ``k + 1`` tokens for one pass over the target's weights.

* :func:`ngram_draft` (``--draft ngram``, prompt lookup): the tokens that followed
  the latest earlier occurrence of the sequence's last n-gram, no model at all.
* :class:`ModelDrafter` (``--draft-model``): a smaller model with the same
  vocabulary, decoding ``k`` tokens ahead in its own KV cache.

The rule (Leviathan et al. 2023, Chen et al. 2023): draft token ``x`` at row ``j``,
drawn from the draft's distribution ``q_j``, is accepted with probability
``min(1, p_j(x) / q_j(x))``, where ``p_j`` is the target's sampling distribution
there (the sampler's own: repetition penalty, temperature, top-k, top-p); at the
first rejection the emitted token is drawn from ``norm(max(0, p_j - q_j))``, and
when all ``k`` are accepted one more is drawn from ``p_k``. Every emitted token
then has the target's distribution. A deterministic draft (n-grams, or a greedy
draft model) has ``q_j`` one-hot at ``x``. At temperature 0 ``p_j`` is one-hot at
the target's argmax, so the emitted tokens are exactly plain greedy decoding's.

Seeds: the target sequence's :class:`~.sampling.Sampler` makes every draw of
:func:`verify` (one uniform per draft token scored, one choice for the emitted
token), so a seeded run is reproducible; its stream is not plain decoding's (a step
without drafts is one plain draw, a step with drafts uses more), so a seed gives
other tokens than without speculation, from the same distribution. A draft model
samples with its own generator, seeded from the request's seed.

Nothing here communicates: :mod:`hpcmac.llm.parallel.pipeline` moves the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.sampling import Sampler, SamplingParams

#: the longest and shortest n-gram :func:`ngram_draft` looks up
NGRAM_MAX, NGRAM_MIN = 3, 1


def ngram_draft(tokens: Sequence[int], k: int, n_max: int = NGRAM_MAX,
                n_min: int = NGRAM_MIN) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of
    the last ``n`` tokens of ``tokens`` (the longest ``n`` from ``n_max`` down to
    ``n_min`` that occurs); [] when none does."""
    if k <= 0 or len(tokens) < 2:
        return []
    a = np.asarray(tokens, dtype=np.int64)
    L = a.size
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # starts i < L - n of earlier windows equal to the last n tokens
        hit = a[: L - n] == a[L - n]
        for j in range(1, n):
            hit &= a[j : L - n + j] == a[L - n + j]
        found = np.flatnonzero(hit)
        if found.size:
            i = int(found[-1]) + n  # the latest match's continuation
            return [int(t) for t in a[i : i + k]]
    return []


def _norm(q: np.ndarray) -> np.ndarray:
    """A stored (float32) draft distribution as the float64 one both sides draw from."""
    q = np.asarray(q, dtype=np.float64)
    return q / q.sum()


def verify(sampler: Sampler, logits: np.ndarray, draft: Sequence[int],
           q: np.ndarray | None, seen: Sequence[int]) -> list[int]:
    """The tokens one speculative step emits (1 to ``len(draft) + 1``): the accepted
    drafts, then the target's own token (see the module docstring).

    ``logits``: (k + 1, vocab) target logits, row j scoring the token after
    ``seen + draft[:j]``; ``q``: (k, vocab) the draft's distributions (None: one-hot,
    a deterministic draft); ``seen``: the prompt and generated ids before the step.
    """
    k = len(draft)
    out: list[int] = []
    seen = list(seen)
    rng = sampler.rng
    for j in range(k + 1):
        p = sampler.probs(logits[j], seen)
        if p is None:  # greedy: the target's argmax, kept while the draft agrees
            tok = sampler.greedy(logits[j], seen)
            out.append(tok)
            if j == k or tok != draft[j]:
                break
        elif j == k:  # every draft accepted: one more from the target
            out.append(sampler.draw(p))
            break
        else:
            x = int(draft[j])
            qj = None if q is None else _norm(q[j])
            qx = 1.0 if qj is None else float(qj[x])
            if rng.random() * qx < p[x]:  # accept with probability min(1, p(x) / q(x))
                out.append(x)
            else:
                if qj is None:
                    r = p.copy()
                    r[x] = 0.0
                else:
                    r = np.maximum(p - qj, 0.0)
                s = r.sum()
                r = r / s if s > 0 else p
                out.append(sampler.draw(r))
                break
        seen.append(out[-1])
    return out


def verify_greedy(ids: np.ndarray, draft: Sequence[int]) -> list[int]:
    """:func:`verify` at temperature 0 without a repetition penalty, from the target's
    argmax ids of the ``k + 1`` rows (a tensor group's max-loc head)."""
    out = []
    for j, tok in enumerate(int(t) for t in ids):
        out.append(tok)
        if j == len(draft) or tok != draft[j]:
            break
    return out


class ModelDrafter:
    """A draft model (a whole-model stage) and its own KV cache, on the rank that drafts.

    Each cache slot mirrors the target's slot of the same sequence; the tokens it
    holds are remembered, so after a step only the tokens it has not seen (the
    accepted ones past its last draft, and the target's own) are fed again.
    """

    def __init__(self, stage):
        if not (stage.first and stage.last):
            raise ValueError("ModelDrafter needs a whole-model stage")
        self.stage = stage
        self.cache = None
        self.known: dict[int, list[int]] = {}  # slot -> the tokens its cache holds
        self.samplers: dict[int, Sampler] = {}

    def start(self, max_slots: int, max_len: int) -> None:
        self.cache = self.stage.new_cache(max_slots, max_len)
        self.known.clear()
        self.samplers.clear()

    def free(self, slot: int) -> None:
        """The sequence in ``slot`` left: the next one starts from nothing."""
        self.known.pop(slot, None)
        self.samplers.pop(slot, None)

    def _sampler(self, slot: int, params: SamplingParams) -> Sampler:
        s = self.samplers.get(slot)
        if s is None:
            s = self.samplers[slot] = Sampler(params)
            if params.seed is not None:  # its own stream, not the target's
                s.rng = np.random.default_rng([params.seed, 1])
        return s

    def propose(self, seqs: Sequence[tuple[int, list[int], int, SamplingParams]]
                ) -> list[tuple[list[int], np.ndarray | None]]:
        """Drafts for several sequences at once: ``(slot, tokens, k, sampling)`` each ->
        (``k`` draft ids, their (k, vocab) float32 distributions or None when greedy)."""
        from hpcmac.llm.model.stage import Batch

        st = self.stage
        feed, pos, drafts, qs = [], [], [], []
        for slot, toks, _k, _p in seqs:
            known = self.known.get(slot, [])
            m = min(len(known), len(toks) - 1)  # always feed the last token: its logits
            a, b = np.asarray(known[:m]), np.asarray(toks[:m])
            diff = np.flatnonzero(a != b)
            n = int(diff[0]) if diff.size else m
            feed.append(list(toks[n:]))
            pos.append(n)
            drafts.append([])
            qs.append([])
        live = [i for i, s in enumerate(seqs) if s[2] > 0]
        while live:
            batch = Batch([seqs[i][0] for i in live], [len(feed[i]) for i in live],
                          [pos[i] for i in live])
            h = st.forward(st.embed([t for i in live for t in feed[i]]), batch, self.cache)
            logits = np.asarray(st.logits(h[np.cumsum(batch.lengths) - 1]), dtype=np.float32)
            nxt = []
            for row, i in enumerate(live):
                slot, toks, k, params = seqs[i]
                self.known[slot] = self.known.get(slot, [])[: pos[i]] + feed[i]
                seen = list(toks) + drafts[i]
                smp = self._sampler(slot, params)
                p = smp.probs(logits[row], seen)
                if p is None:
                    x = smp.greedy(logits[row], seen)
                else:  # drawn from the float32 copy the verifier will see
                    q32 = p.astype(np.float32)
                    qn = _norm(q32)
                    x = smp.draw(qn)
                    qs[i].append(q32)
                drafts[i].append(x)
                pos[i] += len(feed[i])
                feed[i] = [x]
                if len(drafts[i]) < k:
                    nxt.append(i)
            live = nxt
        return [(d, np.stack(q) if q else None) for d, q in zip(drafts, qs)]


def check_rewinds(path: str, cfg, flag: str) -> None:
    """UsageError unless the model's cache can drop rejected drafts: a linear-attention
    layer's recurrent state cannot go back to an earlier position."""
    from hpcmac.llm.model.cache import recurrent_layers

    n = len(recurrent_layers(cfg))
    if n:
        raise UsageError(f"{flag} {path}: {n} of its {cfg.n_layers} layers are linear "
                         "attention, whose state cannot rewind past rejected draft tokens: "
                         "speculative decoding needs a model of attention layers only")


def check_draft_model(draft: str, target: str, target_cfg):
    """UsageError (one line) unless ``draft``'s vocabulary is ``target``'s: the same size
    and, where the checkpoints carry tokenizers, the same token for every id. Reads
    configs and tokenizers only (before any weights load); returns the draft's config."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.tokenizer import load_tokenizer

    try:
        cfg = load_config(draft)
    except UsageError as exc:
        raise UsageError(f"--draft-model: {exc}") from None
    why = "a draft must share the target's tokenizer"
    if cfg.vocab != target_cfg.vocab:
        raise UsageError(f"--draft-model {draft}: its vocabulary has {cfg.vocab} tokens, "
                         f"--model {target}'s {target_cfg.vocab} ({why})")
    td, tt = load_tokenizer(draft), load_tokenizer(target)
    if (td is None) != (tt is None):
        has, lacks = (draft, target) if tt is None else (target, draft)
        raise UsageError(f"--draft-model: {has} has a tokenizer and {lacks} none: their "
                         f"token ids cannot be checked to agree ({why})")
    if td is not None:
        vd, vt = td.tk.get_vocab(with_added_tokens=True), tt.tk.get_vocab(with_added_tokens=True)
        if vd != vt:
            id_d = {i: t for t, i in vd.items()}
            id_t = {i: t for t, i in vt.items()}
            bad = min(i for i in set(id_d) | set(id_t) if id_d.get(i) != id_t.get(i))
            raise UsageError(f"--draft-model {draft}: token id {bad} is "
                             f"{id_d.get(bad)!r} there and {id_t.get(bad)!r} in --model "
                             f"{target} ({why})")
    return cfg


class NgramDrafter:
    """``--draft ngram``: :func:`ngram_draft` over each sequence's prompt and output,
    the same interface as :class:`ModelDrafter` (no model, no cache)."""

    def start(self, max_slots: int, max_len: int) -> None:
        pass

    def free(self, slot: int) -> None:
        pass

    def propose(self, seqs):
        return [(ngram_draft(toks, k), None) for _slot, toks, k, _p in seqs]
