"""gpt_oss against transformers at any rank count: the whole model on one rank, tensor
parallel over all ranks, a pipeline of all ranks (and 2 x 2 at four ranks).

Odd shapes: 5 query heads over 1 KV head (a KV group split between ranks: the sinks
padded with the heads) and 6 over 2; 6 and 7 experts, 4 per token, of 21 and 13 columns;
sliding windows of 8 and 5 tokens, alternating as transformers' default and as a given
``layer_types``; gpt-oss's own YaRN (factor 32, no truncation) and a YaRN of factor 4
over 16 positions; the SwiGLU clamp at 7 and at 2 (so that it bites); every bias
perturbed. The oracle is transformers itself (``family_util``; rank 0 runs it, each prompt
alone): 16 greedy tokens equal and logits within 1e-4 of the largest at every step, with
three prompts (23, 9 and 17 tokens: longer than the window) prefilled together in chunks
of 3 tokens and decoded together. A third checkpoint holds its experts in MXFP4 as gpt-oss
publishes them (random codes and scales), kept 4-bit by hpcmac; transformers decodes the
same file (``Mxfp4Config(dequantize=True)``). The weights are exact in float32 on both
sides, and the 4-bit kernels sum in another order than float32 BLAS (within
``2 gamma_n sum |w||x|`` of it per product: tests/unit/test_llm_float_formats.py), far
inside the same 1e-4 of the largest. At tensor 2 the experts' 32 columns split 16 and 16,
off MXFP4's groups of 32, so ``down_proj`` is dequantized there (gate/up stay 4-bit).
A fourth is that MXFP4 checkpoint converted to GGUF (llama.cpp's ``gpt-oss``: gate and up
split, each expert (out, in), MXFP4 type 39, the rest F32), whose experts requantize to
the same codes and scales: the same oracle, so the GGUF's experts put back together and
sliced per rank are checked in every layout.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest
from family_util import N_NEW, matches_transformers, write_cases

from hpcmac.errors import UsageError
from hpcmac.testing import world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
#: case -> (seed, config.json fields); seeds whose greedy runs are not degenerate
CASES = {
    "kv1-window8-yarn32": (3, dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=21, num_hidden_layers=4,
        num_attention_heads=5, num_key_value_heads=1, head_dim=12, num_local_experts=6,
        num_experts_per_tok=4, sliding_window=8, max_position_embeddings=256)),
    "kv2-window5-clamp2-tied": (5, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=13, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=7,
        num_experts_per_tok=4, sliding_window=5, max_position_embeddings=256,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        swiglu_limit=2.0, swiglu_alpha=1.2, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                             original_max_position_embeddings=16))),
    # the experts as gpt-oss publishes them: MXFP4 blocks and scales (sizes of 32s)
    "mxfp4-experts": (3, dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=5, num_key_value_heads=1, head_dim=12, num_local_experts=6,
        num_experts_per_tok=4, sliding_window=8, max_position_embeddings=256)),
}


def build_mxfp4(model_type, path, seed, fields):
    """A float checkpoint converted to MXFP4 experts; transformers decodes the file itself."""
    import torch
    import transformers

    from hpcmac.llm.model.fixtures import mxfp4_checkpoint, random_checkpoint

    random_checkpoint(model_type, path + "-float", seed=seed, initializer_range=0.3, **fields)
    mxfp4_checkpoint(path + "-float", path, seed=seed)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


def build_gguf(model_type, path, seed, fields):
    """The MXFP4 checkpoint of :func:`build_mxfp4` as one GGUF file at ``path``."""
    from hpcmac.llm.model.fixtures import write_gguf

    model = build_mxfp4(model_type, path + "-folder", seed, fields)
    write_gguf(path + "-folder", path, "MXFP4", experts_only=True)
    return model


@pytest.fixture(scope="module")
def checkpoints():
    lengths = (23, 9, 17)  # longer than the windows
    mx = {n: c for n, c in CASES.items() if n.startswith("mxfp4")}
    floats = {n: c for n, c in CASES.items() if n not in mx}
    gg = {"gguf-mxfp4-experts": CASES["mxfp4-experts"]}
    with write_cases("gpt_oss", floats, VOCAB, lengths=lengths) as a, \
            write_cases("gpt_oss", mx, VOCAB, build=build_mxfp4, lengths=lengths) as b, \
            write_cases("gpt_oss", gg, VOCAB, build=build_gguf, lengths=lengths) as c:
        yield {**a, **b, **c}


test_matches_transformers = matches_transformers("gpt_oss", [*CASES, "gguf-mxfp4-experts"])


def test_window_and_sinks_matter(checkpoints):
    """The checks above can fail: the same prompts with the window or the sinks taken
    away give other logits (one rank's whole model, rank 0)."""
    from dataclasses import replace

    from hpcmac.llm.model.fixtures import stage_greedy
    from hpcmac.llm.model.stage import load_stage

    g = world()
    path, prompts, ref = checkpoints["kv1-window8-yarn32"]
    if g.rank == 0:
        stage = load_stage(path, 0, 4)
        assert stage_greedy(stage, prompts[0], N_NEW) == ref[0][0]
        no_window = load_stage(path, 0, 4)
        no_window.config = no_window.local = replace(stage.config, sliding_window=0)
        no_sinks = load_stage(path, 0, 4)
        for w in no_sinks.layers:
            w["sinks"] = w["sinks"] - 1e9
        for other in (no_window, no_sinks):
            from hpcmac.llm.model.stage import Batch

            cache = other.new_cache(1, 64)
            x = other.forward(other.embed(prompts[0]), Batch([0], [23], [0]), cache)
            assert np.abs(other.logits(x[-1:])[0] - ref[0][1][0]).max() > 1e-2
    g.barrier()


@pytest.mark.parametrize("name", ["kv2-window5-clamp2-tied", "mxfp4-experts"])
def test_mlx_backend_matches_numpy(checkpoints, name):
    """The MLX backend (rank 0): the three prompts together through the one-rank generator
    (one packed prefill, then batched decode) give numpy's and transformers' tokens;
    prefill logits within 1e-4 of the largest."""
    from hpcmac.llm.model.generate import Generator
    from hpcmac.llm.model.stage import Batch, load_stage

    g = world()
    if g.rank == 0:
        pytest.importorskip("mlx.core")
        path, prompts, ref = checkpoints[name]
        a = Generator(load_stage(path, 0, 4, backend="numpy"), max_len=64, max_slots=3)
        b = Generator(load_stage(path, 0, 4, backend="mlx"), max_len=64, max_slots=3)
        got = [r.tokens for r in b.generate_batch(prompts, N_NEW)]
        assert got == [r.tokens for r in a.generate_batch(prompts, N_NEW)]
        assert got == [t for t, _ in ref]
        x, bt = a.stage.embed(prompts[0]), Batch([0], [len(prompts[0])], [0])
        la = a.stage.logits(a.stage.forward(x, bt, a.stage.new_cache(1, 32)))
        lb = b.stage.logits(b.stage.forward(x, bt, b.stage.new_cache(1, 32)))
        # the bound against transformers: MLX sums in float32 in another order; the MXFP4
        # case's larger weights (up to 1.5) put its logits 1.2e-5 of the largest apart
        # (the float case's 6.6e-6), past test_llm_models' 1e-5
        np.testing.assert_allclose(lb, la, rtol=0, atol=1e-4 * np.abs(la).max())
    g.barrier()


def test_planner_counts_the_bytes_held(checkpoints):
    """weights.stage_nbytes (the planners' count, from headers) is what a stage holds:
    float and MXFP4 checkpoints (kept 4-bit), whole and as one tensor rank's part; the
    MXFP4 stage holds at most 1.1x the file's bytes (numpy: a bfloat16 per 32 where the
    file has the E8M0 byte; MLX the byte itself)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import stage_nbytes

    g = world()
    if g.rank == 0:
        for name in ("kv1-window8-yarn32", "mxfp4-experts"):
            path = checkpoints[name][0]
            shard = make_shards(load_config(path), [1.0, 1.0])[1]
            assert stage_nbytes(path, 0, 4, True, True) == load_stage(path, 0, 4).nbytes
            part = load_stage(path, 1, 4, False, True, shard=shard, reduce=lambda a: a)
            assert stage_nbytes(path, 1, 4, False, True, shard=shard) == part.nbytes
        path = checkpoints["mxfp4-experts"][0]
        file = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        for backend in ("numpy", "mlx") if find_spec("mlx") else ("numpy",):
            held = load_stage(path, 0, 4, backend=backend).nbytes
            assert held <= 1.1 * file, (backend, held, file)
    g.barrier()


@pytest.mark.parametrize("field, value, says", [
    ("quantization_config", {"quant_method": "fp8"}, "quant_method 'fp8'"),
    ("layer_types", ["sliding_attention"], "field 'layer_types'"),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
     "rope_type 'dynamic'"),
])
def test_refused_in_one_line(field, value, says):
    from hpcmac.llm.model.arch import config_from_hf

    raw = dict(model_type="gpt_oss", vocab_size=VOCAB, hidden_size=40, intermediate_size=21,
               num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
               head_dim=12, num_local_experts=6, num_experts_per_tok=4, sliding_window=8)
    cfg = config_from_hf(dict(raw))
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_theta == 150000.0
    with pytest.raises(UsageError, match=says) as e:
        config_from_hf({**raw, field: value})
    assert "\n" not in str(e.value)
