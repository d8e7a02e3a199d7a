"""The fused one-token decode (hpcmac.llm.model.fused) against the numpy operations it
replaces: same logits, step by step, on the attention variants it takes (plain GQA;
sinks and a sliding window shorter than the prompt; Q/K norm, biases and partial
rotary)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from hpcmac.llm.model import fused  # noqa: E402
from hpcmac.llm.model.fixtures import random_checkpoint  # noqa: E402
from hpcmac.llm.model.stage import Batch, load_stage  # noqa: E402

PROMPT = [3, 17, 42, 5, 9, 11, 60, 2, 8, 30, 31, 7]  # longer than gpt_oss's window of 8
STEPS = 6


def _decode(stage, tokens):
    """Logits of the prompt's last position and of each decode step fed ``tokens``."""
    cache = stage.new_cache(1, 64)
    h = stage.forward(stage.embed(PROMPT), Batch([0], [len(PROMPT)], [0]), cache)
    out = [stage.logits(h[-1:])[0]]
    for i, t in enumerate(tokens):
        h = stage.forward(stage.embed([t]), Batch([0], [1], [len(PROMPT) + i]), cache)
        out.append(stage.logits(h)[0])
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "glm4_moe"])
def test_fused_decode_equals_numpy_ops(arch, tmp_path, monkeypatch):
    folder = random_checkpoint(arch, tmp_path, seed=5, initializer_range=0.3)
    stage = load_stage(folder, 0, stage_layers(folder))
    calls = []
    attend = fused.attend_one

    def counted(*a):
        calls.append(1)
        return attend(*a)

    monkeypatch.setattr(fused, "attend_one", counted)
    tokens = list(np.random.default_rng(0).integers(0, stage.config.vocab, STEPS))
    on = _decode(stage, tokens)
    assert len(calls) == STEPS * stage.config.n_layers  # every decode step took it
    monkeypatch.setattr(fused, "MAX_KEYS", 0)
    monkeypatch.setattr(fused, "MAX_ROWS", 0)
    off = _decode(stage, tokens)
    assert len(calls) == STEPS * stage.config.n_layers  # and now none
    for i, (a, b) in enumerate(zip(on, off)):
        # float32 sums in another order (the numpy path's BLAS dot products)
        assert np.abs(a - b).max() <= 2e-6 * np.abs(b).max(), f"step {i}"


def stage_layers(folder) -> int:
    from hpcmac.llm.model.config import load_config

    return load_config(folder).n_layers
