"""``--quantize`` (MLX backend): matrices kept quantized in memory, as mlx-lm's ``-q``.

The oracle is the float32 numpy backend on a copy of the checkpoint whose
matrices went through MLX's quantize and dequantize: the same weights, so the
logits must agree to float32 rounding, and the greedy tokens exactly.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from held import held_nbytes

pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")

from hpcmac.errors import UsageError  # noqa: E402
from hpcmac.llm.model.backend import QWeight, quantized_nbytes  # noqa: E402
from hpcmac.llm.model.fixtures import random_checkpoint  # noqa: E402
from hpcmac.llm.model.generate import Generator  # noqa: E402
from hpcmac.llm.model.stage import Batch, load_stage  # noqa: E402
from hpcmac.llm.parallel.plan import weight_bytes  # noqa: E402

GROUP = 32
SHAPES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2)
CASES = {
    "llama-untied": ("llama", {}),
    "qwen3-tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3moe": ("qwen3_moe", dict(head_dim=16, moe_intermediate_size=32)),
}
PROMPTS = [[3, 17, 42, 5, 9, 11, 60, 2, 8], [7, 50, 51]]


def rounded_copy(folder, out, bits: int):
    """The checkpoint with every matrix the MLX backend quantizes (the embedding too:
    its lookup dequantizes rows) replaced by dequantize(quantize(w))."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(folder, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in tensors.items():
            if w.ndim == 2 and w.shape[-1] % GROUP == 0:
                q = mx.quantize(mx.array(w.astype(np.float32)), group_size=GROUP, bits=bits)
                w = np.array(mx.dequantize(*q, group_size=GROUP, bits=bits)).astype(w.dtype)
            tensors[name] = w
        save_file(tensors, f)
    return out


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_quantized_equals_float_on_rounded_weights(name, bits, tmp_path):
    arch, over = CASES[name]
    folder = random_checkpoint(arch, tmp_path / "ck", seed=3, initializer_range=0.3,
                               **{**SHAPES, **over})
    oracle = rounded_copy(folder, tmp_path / "rounded", bits)
    n = 3
    q = load_stage(folder, 0, n, backend="mlx", quantize=bits, group_size=GROUP)
    f = load_stage(oracle, 0, n, backend="numpy")
    assert isinstance(q.layers[0]["wqkv"], QWeight) and isinstance(q.extra["head"], QWeight)
    b = Batch([0], [len(PROMPTS[0])], [0])
    lq = q.logits(q.forward(q.embed(PROMPTS[0]), b, q.new_cache(1, 16)))
    lf = f.logits(f.forward(f.embed(PROMPTS[0]), b, f.new_cache(1, 16)))
    np.testing.assert_allclose(lq, lf, rtol=0, atol=2e-5 * np.abs(lf).max())
    gq = Generator(q, max_len=64, max_slots=2).generate_batch(PROMPTS, 12)
    gf = Generator(f, max_len=64, max_slots=2).generate_batch(PROMPTS, 12)
    assert [r.tokens for r in gq] == [r.tokens for r in gf]


def test_quantized_weight_bytes(tmp_path):
    """The plan counts quantized bytes for the matrices and float32 for the rest."""
    folder = random_checkpoint("llama", tmp_path / "ck", seed=1, **SHAPES)
    layers32, embed32, head32 = weight_bytes(str(folder))
    layers4, embed4, head4 = weight_bytes(str(folder), 4, GROUP)
    D, inter, vocab = 64, 128, 96
    kv = 2 * 16  # kv heads x head_dim
    mats = D * (D + 2 * kv) + D * D + 3 * D * inter  # qkv, o, gate/up/down
    assert layers32[0] == 4 * (mats + 2 * D)
    assert layers4[0] == quantized_nbytes(mats, 4, GROUP) + 4 * 2 * D
    assert embed32 == 4 * vocab * D
    assert embed4 == quantized_nbytes(vocab * D, 4, GROUP)  # the lookup dequantizes rows
    assert head4 == quantized_nbytes(vocab * D, 4, GROUP) + 4 * D
    st = load_stage(folder, 0, 1, first=False, last=False, backend="mlx", quantize=4,
                    group_size=GROUP)
    held = sum(w.nbytes for w in st.layers[0].values() if isinstance(w, QWeight))
    assert held == quantized_nbytes(mats, 4, GROUP)


def test_quantize_flags_are_checked(tmp_path):
    from hpcmac.llm.__main__ import main

    folder = str(random_checkpoint("llama", tmp_path / "ck", seed=1))
    base = ["generate", "--model", folder, "--prompt-ids", "1,2", "--max-tokens", "2"]
    with pytest.raises(UsageError, match="--quantize 4: needs --backend mlx"):
        main(base + ["--quantize", "4"])
    with pytest.raises(UsageError, match="--quantize 7: expected one of 2, 3, 4, 5, 6, 8"):
        main(base + ["--backend", "mlx", "--quantize", "7"])
    with pytest.raises(UsageError, match="--q-group-size 48: expected one of 32, 64, 128"):
        main(base + ["--backend", "mlx", "--quantize", "4", "--q-group-size", "48"])



@pytest.mark.parametrize("name", list(CASES))
def test_quantized_bytes_loaded_planned_and_held_agree(name, tmp_path):
    """``--quantize``: the loader's count (generate's JSON, the server's weights) is what
    MLX holds, and the planner's stage_nbytes counts the same."""
    from hpcmac.llm.model.weights import stage_nbytes

    arch, over = CASES[name]
    folder = random_checkpoint(arch, tmp_path / "ck", seed=2, **{**SHAPES, **over})
    for rng in [(0, 2, True, True), (0, 1, True, False), (1, 2, False, True)]:
        st = load_stage(folder, *rng, backend="mlx", quantize=4, group_size=GROUP)
        assert st.nbytes == held_nbytes(st) == \
            stage_nbytes(folder, *rng, quantize=4, group_size=GROUP), rng
