"""gemma4 (its text model) against transformers at any rank count: the whole model on one
rank, tensor parallel over all ranks, a pipeline of all ranks (and 2 x 2 and tensor 3 at
four ranks).

Odd shapes: 5 query heads over 1 KV head (a KV group split between ranks) with full layers
of 20-wide heads whose K is their V (``attention_k_eq_v``, one global KV head), and 6 over
2 with full layers of 16-wide heads (8 in the sliding ones) and their own V; sliding windows
of 8 and 5 tokens; the full layers' proportional rope on 2 of 10 and 4 of 8 pairs (theta
1e6 and 1e4), the sliding ones' default rope (theta 1e4 and 100); transformers' default
layer pattern (the last layer made full) and a given one; the logit soft-cap at 10 (it bites:
capped logits reach 6.2, 7.3 before the cap) and none; Q/K/V/O biases; every norm, bias and
``layer_scalar`` perturbed; and the MoE block (26B-A4B's form: 7 routed experts of 13
columns, 3 a token, beside the MLP in every layer, the router's scales perturbed around 1;
13 columns split 7/6 and 5/4/4, off any even cut). The heads are untied: with Gemma's
embedding scale a random tied head repeats the last token (seeds 0-7 of the first case and
0-3 of the second, tied, gave degenerate greedy runs). The oracle is transformers itself
(``family_util``: rank 0 runs it, each prompt alone): 16 greedy tokens equal and logits
within 1e-4 of the largest at every step, three prompts (23, 9 and 17 tokens: longer than
the windows) prefilled together in chunks of 3 tokens and decoded together.

Then the issue's long case: prompts of 300, 40 and 13 tokens prefilled in chunks of 64 and
decoded together in three cache slots, tensor parallel over all ranks (the window of 8, far
shorter than the prompt): each one's tokens and logits as transformers gives for it alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_util import (
    cases_fixture,
    check_planner_and_mlx,
    check_together,
    matches_transformers,
)

from hpcmac.errors import UsageError
from hpcmac.testing import world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
#: case -> (seed, config.json fields); seeds whose greedy runs are not degenerate
CASES = {
    "h5-kv1-keqv-window8-cap10": (3, dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=5, num_key_value_heads=1, head_dim=12, global_head_dim=20,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
        final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"])),
    "h6-kv2-window5-bias-default-pattern": (5, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=13, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        attention_k_eq_v=False, sliding_window=5, attention_bias=True, layer_types=None,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.5}})),
    # the MoE block (26B-A4B's form): 7 experts of 13 columns (3 a token) beside the MLP
    "moe-h6-kv2-e7-top3-keqv-cap30": (0, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=13, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5,
        final_logit_softcapping=30.0, enable_moe_block=True, num_experts=7, top_k_experts=3,
        moe_intermediate_size=13,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.5}})),
}
_COMMON = dict(hidden_size_per_layer_input=0, max_position_embeddings=512)
LONG = {"long": (3, {**CASES["h5-kv1-keqv-window8-cap10"][1], **_COMMON})}

checkpoints = cases_fixture("gemma4_text", {n: (seed, {**f, **_COMMON})
                                            for n, (seed, f) in CASES.items()},
                            VOCAB, lengths=(23, 9, 17))
long_case = cases_fixture("gemma4_text", LONG, VOCAB, lengths=(300, 40, 13), one="long")
test_matches_transformers = matches_transformers("gemma4", CASES)


def test_long_prompt_chunked_then_decoded_together(long_case):
    """Three prompts (300, 40 and 13 tokens; window 8) prefilled in chunks of 64 and decoded
    together in three cache slots, tensor parallel over all ranks: each sequence's tokens
    and logits as transformers gives for it alone."""
    check_together("gemma4 long", long_case, chunk=64, max_batch=3)


def test_what_gemma_adds_matters(checkpoints):
    """The checks above can fail: the same prompt with the window, the soft-cap, the V norm
    or the layer scalars taken away gives other logits (one rank's whole model, rank 0)."""
    from dataclasses import replace

    from hpcmac.llm.model.stage import Batch, load_stage

    g = world()
    path, prompts, ref = checkpoints["h5-kv1-keqv-window8-cap10"]
    if g.rank == 0:
        def last_logits(stage):
            cache = stage.new_cache(1, 64)
            x = stage.forward(stage.embed(prompts[0]), Batch([0], [23], [0]), cache)
            return stage.logits(x[-1:])[0]

        base = load_stage(path, 0, 4)
        assert np.abs(last_logits(base) - ref[0][1][0]).max() <= 1e-4 * np.abs(ref[0][1][0]).max()
        for change in ("sliding_window", "final_logit_softcap", "v_norm", "layer_scalar"):
            other = load_stage(path, 0, 4)
            if change == "layer_scalar":
                for w in other.layers:
                    w["scalar"] = w["scalar"] * 0 + 1
            else:
                value = {"sliding_window": 0, "final_logit_softcap": 0.0, "v_norm": False}
                other.config = replace(other.config, **{change: value[change]})
                other.local = replace(other.local, **{change: value[change]})
            assert np.abs(last_logits(other) - ref[0][1][0]).max() > 1e-2, change
    g.barrier()


@pytest.mark.parametrize("name", list(CASES))
def test_mlx_backend_and_planner(checkpoints, name):
    """Rank 0: the planners' count (weights.stage_nbytes, from headers) is what the stage
    holds, whole and as tensor rank 1 of 2 (the full layers' own KV heads), and so is the
    cache's; the MLX backend, the prompts together through the one-rank generator (one
    packed prefill, then batched decode), gives transformers' tokens."""
    check_planner_and_mlx(checkpoints[name], max_slots=3, cache=True)


def test_released_folder_is_the_same_model(checkpoints, tmp_path_factory):
    """Rank 0: the folder as Gemma 4 is released (``model_type`` gemma4, the text model's
    config nested in ``text_config``, its tensors under ``model.language_model.``) gives the
    text folder's logits."""
    from safetensors.numpy import load_file, save_file

    from hpcmac.llm.model.stage import Batch, load_stage

    g = world()
    if g.rank == 0:
        path, prompts, _ = checkpoints["h6-kv2-window5-bias-default-pattern"]
        out = tmp_path_factory.mktemp("gemma4-released")
        text = json.load(open(f"{path}/config.json"))
        json.dump({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                   "tie_word_embeddings": text["tie_word_embeddings"],
                   "text_config": text, "vision_config": {"model_type": "gemma4_vision"}},
                  open(out / "config.json", "w"))
        t = load_file(f"{path}/model.safetensors")
        save_file({"model.language_model." + k[len("model."):] if k.startswith("model.")
                   else k: v for k, v in t.items()}, str(out / "model.safetensors"))
        logits = []
        for p in (path, out):
            st = load_stage(p, 0, 4)
            x = st.forward(st.embed(prompts[0]), Batch([0], [23], [0]), st.new_cache(1, 32))
            logits.append(st.logits(x))
        assert st.config.arch == "gemma4"
        np.testing.assert_array_equal(logits[0], logits[1])
    g.barrier()


_RAW = {"model_type": "gemma4_text", "vocab_size": 96, "hidden_size": 40,
        "intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 24,
        "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 8,
        "hidden_size_per_layer_input": 0}


def test_config_mapping():
    """transformers' defaults and both ways of naming the full layers' shapes."""
    from hpcmac.llm.model.arch import config_from_hf

    cfg = config_from_hf(dict(_RAW))
    assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    full = cfg.at(3)
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.v_from_k) == (16, 2, False)
    assert (full.head_dim, full.n_kv_heads, full.v_from_k) == (24, 1, True)
    assert full.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                 "factor": 1.0} and full.rope_theta == 1e6
    assert cfg.tie_embeddings and cfg.embed_scale == 40 ** 0.5 and cfg.attention_scale == 1.0
    saved = {k: v for k, v in _RAW.items() if "global" not in k}
    per = config_from_hf({**saved, "per_layer_config": {
        "3": {"head_dim": 24, "num_key_value_heads": 1}}})
    assert per == cfg


@pytest.mark.parametrize("field, value, says", [
    ("hidden_size_per_layer_input", 256, "field 'hidden_size_per_layer_input'"),
    ("num_kv_shared_layers", 2, "field 'num_kv_shared_layers'"),
    ("enable_moe_block", "yes", "field 'enable_moe_block'"),
    ("use_bidirectional_attention", "all", "field 'use_bidirectional_attention'"),
    ("hidden_activation", "silu", "field 'hidden_activation'"),
    ("layer_types", ["sliding_attention"] * 3, "field 'layer_types'"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4}},
     "field 'rope_parameters.full_attention.rope_type'"),
    ("per_layer_config", {"0": {"head_dim": 8}}, "field 'per_layer_config.0'"),
    ("num_global_key_value_heads", 3, "KV heads do not divide"),
    ("head_dim", "16", "field 'head_dim'"),
])
def test_refused_in_one_line(field, value, says):
    from hpcmac.llm.model.arch import config_from_hf

    with pytest.raises(UsageError, match=says) as e:
        config_from_hf({**_RAW, field: value}, "m/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("m/config.json")
