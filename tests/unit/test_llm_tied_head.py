"""A tied head (SmolLM2, Qwen3's small models) is the embedding: one copy held, counted once."""

from __future__ import annotations

import numpy as np
import pytest
from held import held_nbytes

pytest.importorskip("transformers")

from hpcmac.llm.model.fixtures import random_checkpoint  # noqa: E402
from hpcmac.llm.model.stage import load_stage  # noqa: E402
from hpcmac.llm.model.weights import open_checkpoint, stage_nbytes  # noqa: E402

# every output size a multiple of the numpy backend's 32-column panels (no padding held)
SHAPES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return random_checkpoint("llama", tmp_path_factory.mktemp("tied") / "ck", seed=4, **SHAPES)


BACKENDS = ["numpy", pytest.param("mlx", marks=pytest.mark.skipif(
    not __import__("importlib").util.find_spec("mlx"), reason="no mlx"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tied_stage_holds_what_the_planner_counts(tied, backend):
    for rng in [(0, 2, True, True), (0, 1, True, False), (1, 2, False, True)]:
        st = load_stage(tied, *rng, backend=backend)
        assert held_nbytes(st) == st.nbytes == stage_nbytes(tied, *rng), rng


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_lookup_through_the_tied_head_is_the_embedding(tied, backend):
    emb = np.asarray(open_checkpoint(tied).get("model.embed_tokens.weight"), np.float32)
    st = load_stage(tied, 0, 2, True, True, backend=backend)
    ids = [0, 5, 31, 32, 95, 5]   # the panels' edges (32 columns) and the last row
    assert np.array_equal(np.asarray(st.embed(ids)), emb[ids])
    # and the head is that matrix: the logits are the normed row times every row
    ck = open_checkpoint(tied)
    h = emb[[7, 40]]
    x = h / np.sqrt((h * h).mean(-1, keepdims=True) + st.config.norm_eps)
    x = x * np.asarray(ck.get("model.norm.weight"), np.float32)
    assert np.allclose(np.asarray(st.logits(h)), x @ emb.T, rtol=1e-5, atol=1e-5)
