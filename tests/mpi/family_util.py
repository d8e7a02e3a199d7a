"""One model family against transformers at any rank count (the family tests share it).

``write_cases`` has rank 0 write each case's random checkpoint (transformers builds it:
``fixtures.random_checkpoint``) and run transformers on each prompt alone: 16 greedy tokens
and the logits of every step. ``check_case`` runs the prompts together, prefilled in chunks
of 3 tokens, as the whole model on one rank (tensor N at N ranks), a pipeline of all ranks
and (at four ranks) 2 x 2 and tensor 3 on three of them, and asserts tokens equal and
logits within 1e-4 of the largest.

A family's test module holds its cases and what it alone checks; the skeleton they share
is made here: ``checkpoints = cases_fixture(...)`` (and ``long_case = cases_fixture(...,
one="long")``), ``test_matches_transformers = matches_transformers(label, CASES)``, and
:func:`check_planner_and_mlx` for the planners' count and the MLX backend.
"""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager

import numpy as np
import pytest

from hpcmac.testing import parallel_assert, world

N_NEW = 16


def hf_reference(model, prompts, n_new=N_NEW):
    """transformers' greedy tokens and per-step logits of each prompt alone (one torch
    thread: the models are tiny, and a second thread only spins on a loaded machine)."""
    import torch

    torch.set_num_threads(1)
    out = []
    for prompt in prompts:
        with torch.no_grad():
            # an explicit mask: generate would otherwise take token 0 (pad_token_id) in a
            # prompt for padding and mask it
            r = model.generate(torch.tensor([prompt]),
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=n_new,
                               min_new_tokens=n_new, do_sample=False, output_logits=True,
                               return_dict_in_generate=True, pad_token_id=0,
                               eos_token_id=None)
        out.append((r.sequences[0, len(prompt):].tolist(),
                    np.array([lg[0].numpy() for lg in r.logits])))
    return out


def build_checkpoint(model_type: str, path: str, seed: int, fields: dict):
    """The default ``build`` of :func:`write_cases`: ``fixtures.random_checkpoint`` and
    transformers' model of the folder."""
    import torch
    import transformers

    from hpcmac.llm.model.fixtures import random_checkpoint

    random_checkpoint(model_type, path, seed=seed, initializer_range=0.3, **fields)
    # the eager experts: torch's grouped GEMM wants 16-byte strides (odd widths)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager").eval()


@contextmanager
def write_cases(model_type: str, cases: dict, vocab: int, build=build_checkpoint,
                lengths=(9, 4)):
    """Collective. ``cases``: name -> (seed, config.json fields). Yields name -> (folder,
    prompts, transformers' (tokens, logits) per prompt), the same on every rank; the
    folders are removed afterwards. ``build(model_type, folder, seed, fields)`` writes a
    checkpoint and returns transformers' model of it (rank 0); ``lengths``: the prompts'."""
    g = world()
    root = g.bcast_obj(tempfile.mkdtemp(prefix=f"hpcmac-{model_type}-") if g.rank == 0
                       else None, 0)
    rng = np.random.default_rng(11)
    prompts = [list(map(int, rng.integers(0, vocab, n))) for n in lengths]
    out = {}
    try:
        for name, (seed, fields) in cases.items():
            path, ref = f"{root}/{name}", None
            if g.rank == 0:
                ref = hf_reference(build(model_type, path, seed, fields), prompts)
            out[name] = (path, prompts, g.bcast_obj(ref, 0))
        g.barrier()
        yield out
    finally:
        g.barrier()
        if g.rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def run(path, tp, prompts, n_new=N_NEW, group=None, chunk=3, backend="numpy", **kw):
    """Collective over ``group`` (the world): the prompts together through ``tp`` x
    ``size/tp`` ranks on ``backend``, prefilled in chunks of ``chunk`` tokens (``kw``:
    run_pipeline's)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.pipeline import Request
    from hpcmac.llm.parallel.runtime import run_tensor_pipeline
    from hpcmac.llm.parallel.tensor import TensorGroup, make_groups

    g = group or world()
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
                       shard=shards[groups.tp_rank], reduce=tg.allreduce if tg else None,
                       backend=backend)
    reqs = [Request(list(p), n_new) for p in prompts] if g.rank == 0 else None
    return run_tensor_pipeline(groups, tg, stage, spec, cfg.residual_width, reqs, keep_logits=True,
                               prefill_chunk=chunk, **kw)


def check_together(label: str, case, chunk: int, max_batch: int) -> None:
    """Collective: the case's prompts prefilled in chunks of ``chunk`` tokens and decoded
    together in ``max_batch`` cache slots (a later prompt in a slot an earlier one freed),
    tensor parallel over all ranks: each sequence's tokens as transformers gives for it
    alone, logits within 1e-4 of the largest."""
    g = world()
    path, prompts, ref = case
    res = run(path, g.size, prompts, chunk=chunk, max_batch=max_batch)
    for i, (toks, logits) in enumerate(ref):
        s = res.seqs[i]
        parallel_assert(s.tokens == toks, f"{label} np={g.size} seq {i}: {s.tokens} != {toks}",
                        g)
        err = float(np.max(np.abs(np.array(s.logits) - logits)))
        parallel_assert(err <= 1e-4 * float(np.max(np.abs(logits))),
                        f"{label} np={g.size} seq {i}: logits differ by {err:.3g}", g)


def check_case(label: str, case) -> None:
    """Collective: one case in every layout this rank count has, against transformers
    (at four ranks also tensor 3 on ranks 0-2: shares the rank counts of two do not
    give, heads split 2/2/1)."""
    g = world()
    path, prompts, ref = case
    layouts = {f"tensor {g.size}": (g.size, None)}
    if g.size > 1:
        layouts[f"pipeline {g.size}"] = (1, None)
    if g.size == 4:
        layouts["pipeline 2 x tensor 2"] = (2, None)
        three = g.split(0 if g.rank < 3 else 1, g.rank)
        layouts["tensor 3 of ranks 0-2"] = (3, three if g.rank < 3 else False)
    for layout, (tp, group) in layouts.items():
        res = run(path, tp, prompts, group=group) if group is not False else None
        for i, (toks, logits) in enumerate(ref):
            what = f"{label} np={g.size} {layout} seq {i}"
            s = res.seqs[i] if res is not None else None
            parallel_assert(s is None or s.tokens == toks,
                            f"{what}: {s and s.tokens} != {toks}", g)
            err = 0.0 if s is None else float(np.max(np.abs(np.array(s.logits) - logits)))
            parallel_assert(err <= 1e-4 * float(np.max(np.abs(logits))),
                            f"{what}: logits differ by {err:.3g}", g)
    parallel_assert(all(len(set(t)) > 3 for t, _ in ref), f"{label}: degenerate greedy "
                    "sequence (choose another seed)", g)


def cases_fixture(model_type: str, cases: dict, vocab: int, lengths=(9, 4),
                  build=build_checkpoint, one: str | None = None):
    """A module-scoped fixture (assign it to the name the tests ask for) of
    :func:`write_cases`' checkpoints of ``cases``: name -> (folder, prompts, transformers'
    tokens and logits); ``one``: that case's alone."""
    @pytest.fixture(scope="module")
    def fixture():
        with write_cases(model_type, cases, vocab, build=build, lengths=lengths) as out:
            yield out if one is None else out[one]

    return fixture


def matches_transformers(label: str, names):
    """The test (assign it to ``test_matches_transformers``) of each case in ``names``
    against transformers in every layout (:func:`check_case`), from the module's
    ``checkpoints`` fixture."""
    @pytest.mark.parametrize("name", list(names))
    def test_matches_transformers(checkpoints, name):
        check_case(f"{label} {name}", checkpoints[name])

    return test_matches_transformers


def planner_counts_the_stage(path: str, cache: bool = True):
    """Rank 0's checks: the planners' count (``weights.stage_nbytes``, from headers) is what
    the stage holds, whole and as tensor rank 1 of 2 (``cache``: and so is the cache's,
    ``cache.stage_cache_bytes``). The checkpoint's config, for what the caller checks next."""
    from hpcmac.llm.model.cache import stage_cache_bytes
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.spec import local_config, make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import stage_nbytes

    cfg = load_config(path)
    n = cfg.n_layers
    assert stage_nbytes(path, 0, n, True, True) == load_stage(path, 0, n).nbytes
    shard = make_shards(cfg, [1.0, 1.0])[1]
    part = load_stage(path, 1, n, False, True, shard=shard, reduce=lambda a: a)
    assert stage_nbytes(path, 1, n, False, True, shard=shard) == part.nbytes
    if cache:
        assert part.new_cache(2, 32).nbytes == \
            stage_cache_bytes(local_config(cfg, shard), 1, n, 2, 2 * 32)
    return cfg


def check_planner_and_mlx(case, max_slots: int, cache: bool = False) -> None:
    """Collective; the checks on rank 0: :func:`planner_counts_the_stage`; the MLX
    backend, the prompts together through the one-rank generator in ``max_slots`` slots
    (one packed prefill, then batched decode), gives transformers' tokens (up to an end
    token, where the generator stops; transformers was told not to)."""
    from hpcmac.llm.model.generate import Generator
    from hpcmac.llm.model.stage import load_stage

    g = world()
    if g.rank == 0:
        path, prompts, ref = case
        cfg = planner_counts_the_stage(path, cache)
        pytest.importorskip("mlx.core")
        b = Generator(load_stage(path, 0, cfg.n_layers, backend="mlx"), max_len=64,
                      max_slots=max_slots)
        eos = set(cfg.eos_token_ids)
        want = [next((t[:i + 1] for i, x in enumerate(t) if x in eos), t) for t, _ in ref]
        assert [r.tokens for r in b.generate_batch(prompts, N_NEW)] == want
    g.barrier()
