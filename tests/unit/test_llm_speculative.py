"""Speculative decoding (hpcmac.llm.model.speculative): the n-gram lookup, the rejection
rule's distribution, the whole pipeline's sampled tokens against the target's exact
distribution, and a draft whose tokenizer differs (one line, exit 2).

The statistical checks are chi-square goodness-of-fit tests at level 1e-4 with fixed
seeds (deterministic). Their power, from the noncentral chi-square: the rule's test
(20 000 draws, 8 tokens) detects moving 2% of the probability between two tokens of
probability 1/8 (noncentrality 128, df 7) with power > 0.999; the pipeline's test
(2 400 sequences, 16 tokens, df <= 15) detects moving 5% between two tokens of
probability 1/16 (noncentrality 192) with power > 0.999. Each test also shows it
fails on a wrong rule: drafts verified against another distribution than the one
they were drawn from (here uniform). (Verifying a sampled draft as if it were
one-hot is not wrong: the rule is exact for any given draft token, it only accepts
less often, p(x) instead of min(1, p(x)/q(x)).)
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from hpcmac.llm.model import speculative as S
from hpcmac.llm.model.sampling import Sampler, SamplingParams

ALPHA = 1e-4


def chi2_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """The goodness-of-fit p-value of ``counts`` against ``probs``, cells expecting
    fewer than 5 merged into one."""
    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum())
                 .pvalue)


def test_ngram_draft():
    assert S.ngram_draft([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # the 2-gram 2,3
    assert S.ngram_draft([7, 1, 2, 8, 1, 2, 9, 1, 2], 2) == [9, 1]  # the latest match
    assert S.ngram_draft([4, 5, 6, 1, 5, 6], 4) == [1, 5, 6]  # cut at the end
    assert S.ngram_draft([1, 2, 3], 2) == []  # no earlier occurrence
    assert S.ngram_draft([1, 2, 1], 0) == [] and S.ngram_draft([1], 3) == []


def test_greedy_verify_keeps_the_agreeing_prefix():
    rows = np.full((4, 6), -1.0, np.float32)
    rows[[0, 1, 2, 3], [2, 3, 5, 1]] = 1.0  # the target's argmax per row: 2, 3, 5, 1
    smp = Sampler(SamplingParams())
    assert S.verify(smp, rows, [2, 3, 4], None, []) == [2, 3, 5]
    assert S.verify(smp, rows, [2, 3, 5], None, []) == [2, 3, 5, 1]  # all, and one more
    assert S.verify(smp, rows, [0, 3, 5], None, []) == [2]
    assert S.verify_greedy(np.array([2, 3, 5, 1]), [2, 3, 4]) == [2, 3, 5]


def _uniform(q):
    return None if q is None else np.full_like(q, 1.0 / q.shape[-1])


def _rule_counts(draw_q: bool, wrong_q: bool = False, n: int = 20000):
    """Counts of the tokens one step emits at rows 0, 1 and 2 (k = 2, 8 tokens)."""
    rng = np.random.default_rng(5)
    V = 8
    logits = rng.normal(0, 1.0, (3, V)).astype(np.float32)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = rng.dirichlet(np.ones(V), 2).astype(np.float32) if draw_q else None
    smp = Sampler(SamplingParams(temperature=1.0, seed=9))
    counts = np.zeros((3, V), np.int64)
    for _ in range(n):
        draft = [int(rng.choice(V, p=S._norm(q[j]))) for j in range(2)] if draw_q \
            else [3, 5]
        out = S.verify(smp, logits, draft, _uniform(q) if wrong_q else q, [])
        for j, t in enumerate(out):
            counts[j, t] += 1
    return counts, p


@pytest.mark.parametrize("draw_q", [True, False], ids=["sampled draft", "one-hot draft"])
def test_rejection_rule_emits_the_target_distribution(draw_q):
    counts, p = _rule_counts(draw_q)
    for j in range(3):  # row j's token, whenever the step reached row j
        assert counts[j].sum() > 500
        assert chi2_p(counts[j], p[j]) > ALPHA, (j, counts[j], p[j])


def test_rule_check_fails_on_a_wrong_rule():
    """Drafts drawn from q verified against another distribution: the test sees it."""
    counts, p = _rule_counts(True, wrong_q=True)
    assert chi2_p(counts[0], p[0]) < 1e-12


# -- the whole pipeline, one rank ------------------------------------------------------

V16 = 16
N_SEQ = 2400
PROMPT = [*range(V16), 0, 1, 2]  # every token once: the n-gram lookup always drafts


@pytest.fixture(scope="module")
def tiny16(tmp_path_factory):
    pytest.importorskip("transformers")
    from hpcmac.llm.model.fixtures import random_checkpoint

    root = tmp_path_factory.mktemp("spec16")
    shape = dict(vocab_size=V16, num_hidden_layers=2, hidden_size=32, intermediate_size=48,
                 num_attention_heads=4, num_key_value_heads=2, initializer_range=0.15)
    return (random_checkpoint("llama", root / "target", seed=1, **shape),
            random_checkpoint("llama", root / "draft", seed=2, **shape))


def _exact(stage, params: SamplingParams) -> np.ndarray:
    """The target's distribution of the first three new tokens, (V, V, V), exactly."""
    from hpcmac.llm.model.stage import Batch

    smp = Sampler(params)
    out = np.ones((V16,) * 3)
    prefixes = [[]]
    for step in range(3):
        seqs = [PROMPT + list(t) for t in prefixes]
        cache = stage.new_cache(len(seqs), len(PROMPT) + 3)
        b = Batch(list(range(len(seqs))), [len(s) for s in seqs], [0] * len(seqs))
        h = stage.forward(stage.embed([t for s in seqs for t in s]), b, cache)
        lg = stage.logits(h[np.cumsum(b.lengths) - 1])
        probs = np.array([smp.probs(lg[i], seqs[i]) for i in range(len(seqs))])
        out *= probs.reshape((V16,) * step + (V16,) + (1,) * (2 - step))
        prefixes = [(*t, v) for t in prefixes for v in range(V16)]
    return out


def _sampled(target: str, drafter, params: SamplingParams) -> np.ndarray:
    """(N_SEQ, 3) first three tokens of N_SEQ seeded sequences through run_pipeline."""
    from hpcmac.comm.local import LocalGroup
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.parallel.pipeline import Request, run_pipeline
    from hpcmac.llm.parallel.plan import StageSpec

    stage = load_stage(target, 0, 2)
    reqs = [Request(list(PROMPT), 3, SamplingParams(**{**params.__dict__, "seed": 100 + i}),
                    draft_k=2) for i in range(N_SEQ)]
    res = run_pipeline(LocalGroup(), stage, StageSpec(0, 0, 2, True, True), 32, reqs,
                       max_batch=64, drafter=drafter)
    assert drafter is None or res.speculative["drafted"] > N_SEQ // 2, res.speculative
    return np.array([s.tokens for s in res.seqs])


@pytest.mark.parametrize("kind", ["draft model", "ngram", "plain"])
def test_pipeline_samples_the_target_distribution(tiny16, kind):
    """Sampled with drafts, the first three tokens' joint law is the target's (and
    without: plain sampling passes the same check)."""
    from hpcmac.llm.model.stage import load_stage

    target, draft = tiny16
    params = SamplingParams(temperature=1.0, top_k=12)
    exact = _exact(load_stage(target, 0, 2), params)
    drafter = None  # plain sampling: the same check of the oracle itself
    if kind == "ngram":
        drafter = S.NgramDrafter()
    elif kind == "draft model":
        drafter = S.ModelDrafter(load_stage(draft, 0, 2))
    toks = _sampled(target, drafter, params)
    # token 1 comes from the prefill; tokens 2 and 3 from verified drafts
    pair = np.bincount(toks[:, 1] * V16 + toks[:, 2], minlength=V16 * V16)
    assert chi2_p(pair, exact.sum(0).ravel()) > ALPHA
    assert chi2_p(np.bincount(toks[:, 2], minlength=V16), exact.sum((0, 1))) > ALPHA
    full = np.bincount((toks[:, 0] * V16 + toks[:, 1]) * V16 + toks[:, 2],
                       minlength=V16 ** 3)
    assert chi2_p(full, exact.ravel()) > ALPHA


@pytest.mark.slow  # the rule's own control above is the cheap one
def test_pipeline_check_fails_on_a_wrong_rule(tiny16, monkeypatch):
    """The same test, the draft model's distributions replaced by uniform ones before
    the verifier: the check rejects it."""
    from hpcmac.llm.model.stage import load_stage

    target, draft = tiny16
    params = SamplingParams(temperature=1.0, top_k=12)
    exact = _exact(load_stage(target, 0, 2), params)
    real = S.verify
    monkeypatch.setattr(S, "verify", lambda smp, rows, d, q, seen: real(smp, rows, d,
                                                                         _uniform(q), seen))
    toks = _sampled(target, S.ModelDrafter(load_stage(draft, 0, 2)), params)
    pair = np.bincount(toks[:, 1] * V16 + toks[:, 2], minlength=V16 * V16)
    assert chi2_p(pair, exact.sum(0).ravel()) < 1e-6


# -- refusals ----------------------------------------------------------------------------


def _with_tokenizer(folder, tokens: list[str]):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0])) \
        .save(str(folder / "tokenizer.json"))
    return folder


def test_another_vocabulary_or_linear_attention_is_one_line(tiny16, tmp_path, capsys):
    import shutil

    from hpcmac.lifecycle import run_cli
    from hpcmac.llm.__main__ import main
    from hpcmac.llm.model.fixtures import random_checkpoint

    target, _ = tiny16

    def refused(draft, model, pattern, flag="--draft-model"):
        try:
            code = run_cli(main, ["generate", "--model", str(model), "--prompt-ids", "1,2",
                                  flag, str(draft)])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: --"), err
        assert pattern in err[0], err[0]

    small = random_checkpoint("llama", tmp_path / "v12", vocab_size=12, num_hidden_layers=1,
                              hidden_size=32, intermediate_size=48, num_attention_heads=4,
                              num_key_value_heads=2)
    capsys.readouterr()  # the writer's progress lines
    refused(small, target, "its vocabulary has 12 tokens")
    words = [f"w{i}" for i in range(V16)]
    a = _with_tokenizer(shutil.copytree(target, tmp_path / "a"), words)
    b = _with_tokenizer(shutil.copytree(target, tmp_path / "b"), words[:7] + ["x"] + words[8:])
    refused(b, a, "token id 7 is 'x' there and 'w7'")
    refused(a, target, "has a tokenizer and")
    linear = random_checkpoint("qwen3_next", tmp_path / "q3n")  # Gated DeltaNet layers
    capsys.readouterr()
    refused("ngram", linear, "whose state cannot rewind", "--draft")


def test_dequantized_gguf_is_the_float_form(tmp_path):
    """hpcmac.bench.spec's target: a Q8_0 GGUF copied with float32 tensors loads to the
    same weights as the quantized file dequantized at load (same logits)."""
    pytest.importorskip("transformers")
    from hpcmac.llm.model.fixtures import dequantized_gguf, random_checkpoint, write_gguf
    from hpcmac.llm.model.stage import Batch, load_stage

    folder = random_checkpoint("llama", tmp_path / "m", num_hidden_layers=2, hidden_size=64,
                               intermediate_size=96, num_attention_heads=4,
                               num_key_value_heads=2)
    q8 = write_gguf(folder, tmp_path / "q8.gguf", "Q8_0")
    f32 = dequantized_gguf(q8, tmp_path / "f32.gguf")
    a, b = load_stage(q8, 0, 2, keep_quantized=False), load_stage(f32, 0, 2)
    assert b.formats == {} and a.nbytes == b.nbytes
    out = []
    for st in (a, b):
        h = st.forward(st.embed([1, 5, 9, 2]), Batch([0], [4], [0]), st.new_cache(1, 8))
        out.append(st.logits(h))
    np.testing.assert_array_equal(out[0], out[1])
