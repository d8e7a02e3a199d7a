"""qwen3_5 and qwen3_5_moe (Qwen3.5 and Qwen3.5-MoE, their text part) against transformers at
any rank count: the whole model on one rank, tensor parallel over all ranks, a pipeline of
all ranks (and 2 x 2 and tensor 3 at four ranks).

The folders are laid out as Qwen3.5 is released: ``config.json`` with the language model in
a nested ``text_config`` and a ``vision_config``, the text model's tensors under
``model.language_model.`` beside ``model.visual.``; transformers' own
``Qwen3_5(Moe)ForConditionalGeneration`` is the oracle (its vision tower random: the
prompts are text, so its multimodal rotary sees text positions). A text-only folder
(``qwen3_5_text``, as ``Qwen3_5ForCausalLM`` saves it) is a case too. Odd shapes: Gated
DeltaNet layers of 2 key heads over 6 value heads (a key head held by two tensor ranks at
tensor 3) and 4 over 4; attention of 5 heads over 1 KV head and 6 over 2 with the output
gate; 6 experts, 2 per token, and a gated shared expert of another width; tied and untied
heads (tied at the top level only). 16 greedy tokens equal and logits within 1e-4 of the
largest, two prompts prefilled together in chunks of 3 (``family_util``). A text-only model
converted to GGUF (llama.cpp's ``qwen35``: the value heads in its tiled order, put back by
the reader; value heads as wide as key heads, as llama.cpp assumes) is a case too, so its
gathered tensors are sliced per rank in every layout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from family_util import matches_transformers, write_cases

from hpcmac.errors import UsageError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2)
TEXT = dict(vocab_size=VOCAB, hidden_size=40, num_hidden_layers=4, num_attention_heads=5,
            num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="default", rope_theta=1e4,
                                 partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                                 mrope_interleaved=True))
#: model_type -> case -> (seed, (text_config fields, top-level fields)); seeds whose greedy
#: runs are not degenerate
CASES = {
    "qwen3_5": {
        "released-k2v6": (1, ({**TEXT, "intermediate_size": 24},
                              dict(tie_word_embeddings=False))),
        "released-tied-at-top": (3, ({**TEXT, "intermediate_size": 20,
                                      "linear_num_key_heads": 4, "linear_num_value_heads": 4,
                                      "num_attention_heads": 6, "num_key_value_heads": 2,
                                      "head_dim": 12, "linear_conv_kernel_dim": 3,
                                      "rope_parameters": dict(
                                          rope_type="default", rope_theta=1e4,
                                          partial_rotary_factor=0.5, mrope_section=[1, 1, 1],
                                          mrope_interleaved=True)},
                                     dict(tie_word_embeddings=True))),
    },
    "qwen3_5_moe": {
        "released-k2v6-moe": (2, ({**TEXT, "num_experts": 6, "num_experts_per_tok": 2,
                                   "moe_intermediate_size": 10,
                                   "shared_expert_intermediate_size": 14},
                                  dict(tie_word_embeddings=False))),
    },
}
TEXT_ONLY = {"text-only": (4, {**TEXT, "intermediate_size": 22, "tie_word_embeddings": True})}
GGUF = {"gguf-k2v6": (1, {**TEXT, "intermediate_size": 24, "linear_value_head_dim": 8})}


def build_gguf(model_type, path, seed, fields):
    """A text-only folder written as one F32 GGUF file at ``path``; transformers' model of
    the folder."""
    from family_util import build_checkpoint

    from hpcmac.llm.model.fixtures import write_gguf

    model = build_checkpoint(model_type, path + "-folder", seed, fields)
    write_gguf(path + "-folder", path, "F32")
    return model


def build_released(model_type, path, seed, fields):
    """A random text model (``fixtures.random_checkpoint`` of the ``*_text`` family) moved
    into a released Qwen3.5 folder: the config nested, the tensors under
    ``model.language_model.``; returns transformers' ConditionalGeneration model of it."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    from hpcmac.llm.model.fixtures import random_checkpoint

    text, top = fields
    src = Path(path + "-text")
    random_checkpoint(model_type + "_text", src, seed=seed, initializer_range=0.3, **text,
                      tie_word_embeddings=top["tie_word_embeddings"])
    out = Path(path)
    out.mkdir(parents=True)
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    text_cfg = json.loads((src / "config.json").read_text())
    text_cfg.pop("tie_word_embeddings", None)  # the top level's alone says
    cls = "Qwen3_5MoeForConditionalGeneration" if model_type.endswith("moe") else \
        "Qwen3_5ForConditionalGeneration"
    (out / "config.json").write_text(json.dumps(dict(
        architectures=[cls], model_type=model_type, text_config=text_cfg,
        vision_config={**VISION, "out_hidden_size": text["hidden_size"]}, **top), indent=1))
    return getattr(transformers, cls).from_pretrained(
        out, dtype=torch.float32, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def checkpoints():
    from family_util import build_checkpoint

    with write_cases("qwen3_5", CASES["qwen3_5"], VOCAB, build=build_released) as a, \
            write_cases("qwen3_5_moe", CASES["qwen3_5_moe"], VOCAB, build=build_released) as b, \
            write_cases("qwen3_5_text", TEXT_ONLY, VOCAB, build=build_checkpoint) as c, \
            write_cases("qwen3_5_text", GGUF, VOCAB, build=build_gguf) as d:
        yield {**a, **b, **c, **d}


test_matches_transformers = matches_transformers(
    "qwen3_5", [*CASES["qwen3_5"], *CASES["qwen3_5_moe"], *TEXT_ONLY, *GGUF])


def test_mlx_backend_matches_transformers(checkpoints):
    """The MLX backend (rank 0) on the released MoE folder: the prompts together through the
    one-rank generator (one packed prefill, then batched decode) give transformers' tokens."""
    from hpcmac.llm.model.generate import Generator
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.testing import world

    g = world()
    if g.rank == 0:
        pytest.importorskip("mlx.core")
        path, prompts, ref = checkpoints["released-k2v6-moe"]
        b = Generator(load_stage(path, 0, 4, backend="mlx"), max_len=64, max_slots=2)
        assert [r.tokens for r in b.generate_batch(prompts, 16)] == [t for t, _ in ref]
    g.barrier()


def test_planner_counts_the_bytes_held(checkpoints):
    """weights.stage_nbytes (the planners' count, from headers) is what a stage holds, whole
    and as each rank's part of tensor 3 (the released layout's renamed tensors)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import stage_nbytes
    from hpcmac.testing import world

    g = world()
    if g.rank == 0:
        for name in ("released-k2v6", "released-k2v6-moe"):
            path = checkpoints[name][0]
            assert stage_nbytes(path, 0, 4, True, True) == load_stage(path, 0, 4).nbytes
            for shard in make_shards(load_config(path), [1.0, 1.0, 1.0]):
                part = load_stage(path, 2, 4, False, True, shard=shard, reduce=lambda a: a)
                assert stage_nbytes(path, 2, 4, False, True, shard=shard) == part.nbytes
    g.barrier()


_RAW = dict(model_type="qwen3_5", tie_word_embeddings=True, vision_config=VISION,
            text_config=dict(model_type="qwen3_5_text", **TEXT, intermediate_size=24))


@pytest.mark.parametrize("change, says", [
    (dict(text_config=[1]), "field 'text_config' = [1]"),
    (dict(text_config={**_RAW["text_config"], "model_type": "qwen3_next"}),
     "field 'text_config.model_type' = 'qwen3_next'"),
    (dict(text_config={**_RAW["text_config"], "linear_num_value_heads": 7}),
     "(text_config): field 'linear_num_value_heads' = 7"),
    (dict(text_config={**_RAW["text_config"], "layer_types": ["linear_attention"]}),
     "(text_config): field 'layer_types'"),
    # mlx-lm's folders are read, in MLX's formats only (the top level's reaches the text)
    (dict(quantization={"bits": 7, "group_size": 64}), "7-bit quantization is not supported"),
])
def test_refused_in_one_line(change, says):
    from hpcmac.llm.model.arch import config_from_hf

    cfg = config_from_hf(dict(_RAW))
    assert cfg.arch == "qwen3_5" and cfg.tie_embeddings and cfg.rope_dim == 4
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(UsageError, match=re.escape(says)) as e:
        config_from_hf({**_RAW, **change}, "m/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("m/config.json")
