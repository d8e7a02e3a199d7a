"""glm4_moe (GLM-4.5 to 4.7) against transformers at any rank count: the whole model on one
rank, tensor parallel over all ranks, a pipeline of all ranks (and 2 x 2 at four ranks).

Odd shapes: 5 query heads over 1 KV head and 6 over 2 (heads the rank counts do not
divide, fewer KV heads than ranks), 6 and 5 experts of odd widths (21, 13 columns), odd
MLP widths; rotary on half and on a quarter of each head; QK-norm on and off; Q/K/V
biases; one and two shared experts; one and two dense first layers; grouped and
ungrouped routing. The oracle is transformers itself (rank 0 runs it, each prompt
alone): 16 greedy tokens equal and logits within 1e-4 of the largest at every step,
with two prompts run together, prefilled in chunks of 3 tokens.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

N_NEW = 16
VOCAB = 97
#: case -> (seed, config.json fields); seeds whose greedy runs are not degenerate
CASES = {
    "qknorm-bias-grouped": (32, dict(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=73, moe_intermediate_size=21,
        num_hidden_layers=4, num_attention_heads=5, num_key_value_heads=1, head_dim=12,
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.5,
        attention_bias=True, use_qk_norm=True, norm_topk_prob=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))),
    "quarter-rope-tied": (31, dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=61, moe_intermediate_size=13,
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        n_routed_experts=5, num_experts_per_tok=3, n_group=1, topk_group=1,
        first_k_dense_replace=2, n_shared_experts=2, routed_scaling_factor=2.0,
        attention_bias=False, use_qk_norm=False, norm_topk_prob=False,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=5e4,
                             partial_rotary_factor=0.25))),
}


def hf_reference(model, prompts, n_new):
    """transformers' greedy tokens and per-step logits of each prompt alone."""
    import torch

    out = []
    for prompt in prompts:
        with torch.no_grad():
            r = model.generate(torch.tensor([prompt]), max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0,
                               eos_token_id=None)
        out.append((r.sequences[0, len(prompt):].tolist(),
                    np.array([lg[0].numpy() for lg in r.logits])))
    return out


@pytest.fixture(scope="module")
def checkpoints():
    """Each case written once by rank 0, with transformers' tokens and logits."""
    g = world()
    root = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-glm-") if g.rank == 0 else None, 0)
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(0, VOCAB, 9))), list(map(int, rng.integers(0, VOCAB, 4)))]
    out = {}
    for name, (seed, fields) in CASES.items():
        path, ref = f"{root}/{name}", None
        if g.rank == 0:
            import torch
            import transformers

            from hpcmac.llm.model.fixtures import random_checkpoint

            random_checkpoint("glm4_moe", path, seed=seed, initializer_range=0.3, **fields)
            # the eager experts: torch's grouped GEMM wants 16-byte strides (odd widths)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, experts_implementation="eager").eval()
            ref = hf_reference(model, prompts, N_NEW)
        out[name] = (path, prompts, g.bcast_obj(ref, 0))
    g.barrier()
    yield out
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def run(path, tp, prompts):
    """Collective: the prompts together through ``tp`` x ``size/tp`` ranks."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.pipeline import Request
    from hpcmac.llm.parallel.tensor import TensorGroup, make_groups, run_tensor_pipeline

    g = world()
    cfg = load_config(path)
    groups = make_groups(g, tp)
    spec = S.stages_from_counts(S.even_counts(cfg.n_layers, groups.pp))[groups.stage]
    shards = make_shards(cfg, [1.0] * tp)
    tg = None
    if tp > 1:
        members = [groups.stage * tp + t for t in range(tp)]
        tg = TensorGroup(groups.tensor, [groups.hosts[r] for r in members], 60.0, members)
        tg.set_vocab_slices([s.vocab[1] - s.vocab[0] for s in shards])
    stage = load_stage(path, spec.start, spec.end, spec.first, spec.last,
                       shard=shards[groups.tp_rank], reduce=tg.allreduce if tg else None)
    reqs = [Request(list(p), N_NEW) for p in prompts] if g.rank == 0 else None
    return run_tensor_pipeline(groups, tg, stage, spec, cfg.hidden, reqs, keep_logits=True,
                               prefill_chunk=3)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(checkpoints, name):
    g = world()
    path, prompts, ref = checkpoints[name]
    layouts = {f"tensor {g.size}": g.size}
    if g.size > 1:
        layouts[f"pipeline {g.size}"] = 1
    if g.size == 4:
        layouts["pipeline 2 x tensor 2"] = 2
    for layout, tp in layouts.items():
        res = run(path, tp, prompts)
        for i, (s, (toks, logits)) in enumerate(zip(res.seqs, ref)):
            what = f"glm4_moe {name} np={g.size} {layout} seq {i}"
            parallel_assert(s.tokens == toks, f"{what}: {s.tokens} != {toks}", g)
            err = float(np.max(np.abs(np.array(s.logits) - logits)))
            parallel_assert(err <= 1e-4 * float(np.max(np.abs(logits))),
                            f"{what}: logits differ by {err:.3g}", g)
    parallel_assert(all(len(set(t)) > 3 for t, _ in ref), "degenerate greedy sequence", g)
