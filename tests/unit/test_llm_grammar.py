"""hpcmac.llm.grammar without a model: SmolLM2's real vocabulary, llguidance's masks.

Oracles: ``jsonschema`` on text built from random allowed tokens (anything the mask
lets through must end as a valid value); the whole-vocabulary mask against each
slice's mask (a vocabulary-parallel head's ranks)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from hpcmac.llm import grammar  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "tags", "n"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["a", "b", "c d"]}},
                         "n": {"type": "integer", "minimum": -5, "maximum": 500}}}


@pytest.fixture(scope="module")
def tok():
    from hpcmac.llm.model.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


def _walk(tok, g: str, seed: int, steps: int = 300) -> str:
    lt = grammar.ll_tokenizer(tok, tok.vocab_size)
    c = grammar.Constraint(g, lt)
    rng = np.random.default_rng(seed)
    row = np.empty(grammar.mask_words(tok.vocab_size), dtype=np.int32)
    out = []
    for _ in range(steps):
        c.fill(row)
        ok = np.flatnonzero(grammar.allowed(row, 0, tok.vocab_size)[0])
        if c.done:
            assert set(ok) <= set(tok.eos_ids), "a finished grammar allows EOS alone"
            return tok.decode(out)
        t = int(rng.choice(ok))
        out.append(t)
        c.accept(t)
    raise AssertionError(f"no end after {steps} random tokens: {tok.decode(out)!r}")


def test_random_allowed_tokens_make_valid_json(tok):
    g = grammar.json_schema(SCHEMA, "s")
    for seed in range(8):
        jsonschema.validate(json.loads(_walk(tok, g, seed)), SCHEMA)


def test_a_forbidden_token_is_refused(tok):
    c = grammar.Constraint(grammar.json_schema(SCHEMA, "s"), grammar.ll_tokenizer(tok, 49152))
    with pytest.raises(ValueError, match="not allowed"):
        c.accept(tok.encode("hello", add_bos=False)[0])


def test_slice_masks_equal_the_whole_mask(tok):
    """Each rank of a vocabulary-parallel head masks [v0, v1) of the same packed mask: the
    slices side by side are the whole (uneven cuts, not multiples of 32)."""
    c = grammar.Constraint(grammar.json_schema(SCHEMA, "s"), grammar.ll_tokenizer(tok, 49152))
    c.accept(tok.encode("{", add_bos=False)[0])
    m = np.empty((1, grammar.mask_words(49152)), dtype=np.int32)
    c.fill(m[0])
    logits = np.random.default_rng(0).standard_normal((1, 49152)).astype(np.float32)
    whole = grammar.apply_mask(logits.copy(), m)
    cuts = [0, 16389, 32771, 49152]
    parts = [grammar.apply_mask(logits[:, a:b].copy(), m, a) for a, b in zip(cuts, cuts[1:])]
    assert np.array_equal(np.concatenate(parts, axis=1), whole)
    assert 0 < np.isfinite(whole).sum() < 49152


def test_uncompilable_schema_names_its_path():
    bad = {"type": "object", "$defs": {"x": {"type": "string"}},
           "properties": {"a": {"$ref": "#/$defs/x"},
                          "b": {"type": "array", "items": {"type": "string",
                                                           "pattern": "(?<=a)b"}}}}
    with pytest.raises(grammar.GrammarError) as e:
        grammar.json_schema(bad, "response_format.json_schema.schema")
    assert e.value.path == "response_format.json_schema.schema.properties.b.items"
    assert "look-around" in e.value.message
    with pytest.raises(grammar.GrammarError):
        grammar.json_schema([1], "r")
