"""deepseek_v4 against transformers at any rank count: the whole model on one rank, tensor
parallel over all ranks (query heads split, 4 over 3 ranks 2/1/1: a grouped-projection group
split between ranks; the experts' and the shared expert's columns split; the K = V head, the
compressors, the indexer and the hyper-connections replicated), a pipeline of all ranks (the
hyper-connection streams cross the links), 2 x 2 and tensor 3 at four ranks. A hash-routed
layer on a stage that does not embed is refused in one line.

Odd shapes: 4 query heads of 16 over the one shared K = V head, rope on the last 8 of each
(interleaved), a Q LoRA of 20, the grouped output projection in 2 groups of 10; hc_mult 3
streams with 5 Sinkhorn iterations; one layer of each attention kind (sliding window 6, CSA
at rate 2 with a 16-head indexer keeping its top 3, HCA at rate 4) and a second CSA; a
hash-routed first layer then top-k ones (5 experts of 12 columns, 2 a token, plus the shared
one). transformers leaves the compressors' ``ape`` at 0 and ``tid2eid`` at 0 (every token
to expert 0, twice): the build draws both (each token's experts distinct). The oracle is
transformers itself (``family_util``): 16 greedy tokens equal and logits within 1e-4 of the
largest at every step, prompts of 23 and 9 tokens (the 23 longer than the window, 11 CSA
and 5 HCA windows) prefilled together in chunks of 3; then prompts of 300, 40 and 13 tokens
in chunks of 64 decoded together in three cache slots (150 CSA entries of which 3 are kept,
75 HCA ones, a window of 6).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from family_util import (
    build_checkpoint,
    check_case,
    check_together,
    planner_counts_the_stage,
    write_cases,
)

from hpcmac.errors import UsageError
from hpcmac.testing import world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

VOCAB = 97
CASES = {
    "h4-hc3-window6-csa2-hca4": (0, {}),
    # 6 heads of 12 in 3 groups (tp 4: 2/2/1/1), rope on 4, hc_mult 2, CSA at 3 keeping 4,
    # HCA at 5, window 5, sigmoid scores, the compress rope YaRN (factor 4 over 128)
    "h6-g3-hc2-csa3-hca5-yarn-sigmoid": (1, dict(
        num_attention_heads=6, head_dim=12, partial_rotary_factor=1 / 3, o_groups=3,
        o_lora_rank=7, hc_mult=2, sliding_window=5, index_topk=4, index_head_dim=6,
        compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5},
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention", "heavily_compressed_attention"],
        scoring_func="sigmoid",
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 128})),
}


def build(model_type, path, seed, fields):
    """A random checkpoint (fixtures) with the compressors' position biases and the hash
    table drawn, then transformers' model of it."""
    import torch
    from safetensors.torch import load_file, save_file

    build_checkpoint(model_type, path, seed, fields)
    t = load_file(f"{path}/model.safetensors")
    gen = torch.Generator().manual_seed(seed + 7)
    for k, v in t.items():
        if k.endswith(".ape"):
            t[k] = 0.5 * torch.randn(v.shape, generator=gen)
        elif k.endswith(".tid2eid"):
            n_experts = 5  # the tiny fields' n_routed_experts
            t[k] = torch.stack([torch.randperm(n_experts, generator=gen)[:v.shape[1]]
                                for _ in range(v.shape[0])])
    save_file(t, f"{path}/model.safetensors", metadata={"format": "pt"})
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def checkpoints():
    with write_cases("deepseek_v4", CASES, VOCAB, build=build, lengths=(23, 9)) as out:
        yield out


@pytest.fixture(scope="module")
def long_case():
    first = dict(list(CASES.items())[:1])
    with write_cases("deepseek_v4", first, VOCAB, build=build, lengths=(300, 40, 13)) as out:
        yield next(iter(out.values()))


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(checkpoints, name):
    check_case(f"deepseek_v4 {name}", checkpoints[name])


def test_long_prompt_chunked_then_decoded_together(long_case):
    """Prompts of 300, 40 and 13 tokens prefilled in chunks of 64 and decoded together in
    three slots, tensor parallel over all ranks: each one's tokens and logits as transformers
    gives for it alone."""
    check_together("deepseek_v4 long", long_case, chunk=64, max_batch=3)


def test_hash_layer_needs_the_embedding(checkpoints):
    """Every rank: a stage holding the hash-routed layer 0 but not the embedding is refused
    in one line."""
    from hpcmac.llm.model.stage import load_stage

    path = next(iter(checkpoints.values()))[0]
    with pytest.raises(UsageError, match="layer 0 routes by token id"):
        load_stage(path, 0, 2, False, False)
    world().barrier()


def test_what_v4_adds_matters(checkpoints):
    """The check above can fail: the prompt's logits (every position; the last is
    transformers') move when the compressors' position biases, the indexer's top-k, the hash
    table or the Sinkhorn iterations change (rank 0)."""
    from hpcmac.llm.model.stage import Batch, load_stage

    g = world()
    path, prompts, ref = next(iter(checkpoints.values()))
    if g.rank == 0:
        def logits(stage):
            x = stage.forward(stage.embed(prompts[0]), Batch([0], [23], [0]),
                              stage.new_cache(1, 64))
            return stage.logits(x)

        want = logits(load_stage(path, 0, 4))
        assert np.abs(want[-1] - ref[0][1][0]).max() <= 1e-4 * np.abs(ref[0][1][0]).max()
        changes = {
            "csa ape": lambda st: st.layers[1].__setitem__(
                "attn.compressor.ape", 0 * st.layers[1]["attn.compressor.ape"]),
            "hca ape": lambda st: st.layers[2].__setitem__(
                "attn.compressor.ape", 0 * st.layers[2]["attn.compressor.ape"]),
            "indexer ape": lambda st: st.layers[3].__setitem__(
                "attn.indexer.compressor.ape", 0 * st.layers[3]["attn.indexer.compressor.ape"]),
            "hash table": lambda st: st.layers[0].__setitem__(
                "tid2eid", np.roll(st.layers[0]["tid2eid"], 1, axis=0)),
            "index_topk": lambda st: setattr(st, "local", replace(st.local, index_topk=50)),
            "sinkhorn": lambda st: setattr(st, "local", replace(
                st.local, family={**st.local.family, "hc_iters": 1})),
        }
        for name, change in changes.items():
            st = load_stage(path, 0, 4)
            change(st)
            assert np.abs(logits(st) - want).max() > 1e-3 * np.abs(want).max(), name
    g.barrier()


_RAW = {"model_type": "deepseek_v4", "vocab_size": 96, "hidden_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 16, "partial_rotary_factor": 0.5, "q_lora_rank": 8,
        "layer_types": ["sliding_attention"] * 2,
        "mlp_layer_types": ["hash_moe", "moe"], "o_groups": 2, "index_head_dim": 8}


@pytest.mark.parametrize("field,value,says", [
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("layer_types", ["sliding_attention"], "layer_types"),
    ("mlp_layer_types", ["moe", "dense"], "mlp_layer_types"),
    ("scoring_func", "softmax", "scoring_func"),
    ("o_groups", 3, "o_groups"),
    ("compress_rates", {"full_attention": 4}, "compress_rates"),
])
def test_bad_config_is_one_line(field, value, says):
    from hpcmac.llm.model.arch import config_from_hf

    with pytest.raises(UsageError, match=says):
        config_from_hf({**_RAW, field: value})
    cfg = config_from_hf(dict(_RAW))
    assert cfg.rope_dim == 8 and cfg.family["rates"]["heavily_compressed_attention"] == 128


def test_planner_counts_what_the_stage_holds(checkpoints):
    """Rank 0: the planners' byte count (weights.stage_nbytes, from headers) is what the
    stage reads, whole and as tensor rank 1 of 2 of layers 1-3, and so is the cache's
    (stage_cache_bytes: the K = V head per token, the compressors' projections)."""
    from hpcmac.llm.model.stage import load_stage

    g = world()
    if g.rank == 0:
        path = next(iter(checkpoints.values()))[0]
        cfg = planner_counts_the_stage(path)
        import importlib.util

        if importlib.util.find_spec("mlx") is not None:  # MLX is refused in one line
            with pytest.raises(UsageError, match="numpy backend only"):
                load_stage(path, 0, cfg.n_layers, backend="mlx")
    g.barrier()


def test_release_fields_read_as_transformers_reads_them():
    """The releases' older fields (compress_ratios, num_hash_layers, qk_rope_head_dim, a flat
    YaRN rope_scaling) and the defaults give transformers' layer types and ropes."""
    import transformers

    from hpcmac.llm.model.arch import config_from_hf

    base = {k: v for k, v in _RAW.items() if k not in ("layer_types", "mlp_layer_types",
                                                       "partial_rotary_factor")}
    yarn = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1}
    for raw in ({**base, "num_hidden_layers": 5, "qk_rope_head_dim": 8},
                {**base, "num_hidden_layers": 3, "compress_ratios": [128, 0, 4],
                 "num_hash_layers": 1, "qk_rope_head_dim": 4, "rope_scaling": yarn,
                 "compress_rate_csa": 4, "compress_rope_theta": 5e4}):
        cfg = config_from_hf(dict(raw))
        hf = transformers.DeepseekV4Config(**{k: v for k, v in raw.items()
                                              if k != "model_type"})
        assert cfg.layer_types == hf.layer_types and cfg.family["mlp_types"] == \
            hf.mlp_layer_types
        assert cfg.rope_dim == hf.qk_rope_head_dim
        for label in ("main", "compress"):
            want = dict(hf.rope_parameters[label])
            theta, p = cfg.family["ropes"][label]
            assert theta == want.pop("rope_theta")
            want.pop("partial_rotary_factor", None)
            want.pop("type", None)  # the legacy spelling transformers keeps beside rope_type
            assert p == want, (label, p, want)
