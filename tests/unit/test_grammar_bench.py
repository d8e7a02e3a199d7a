"""hpcmac.bench.grammar's pieces: the widened vocabulary is a real BPE of that size that
still encodes text as SmolLM2 does, and the llguidance measurement walks a valid answer."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")


def test_widened_vocabulary_and_llguidance_mask():
    from hpcmac.bench import grammar as bench
    from hpcmac.llm.model.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    big = bench.widened(tok.tk, 50_000)
    assert big.get_vocab_size(with_added_tokens=True) == 50_000
    text = json.dumps(bench.ANSWER, separators=(",", ":"))
    ids = big.encode(text).ids
    assert big.decode(ids) == text and max(ids) < 50_000
    r = bench.mask_llguidance(big, 50_000, list(tok.eos_ids), ids)
    assert r["mean_us"] > 0 and r["with_apply_mean_us"] >= r["mean_us"]
