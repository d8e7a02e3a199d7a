"""Speculative decoding == plain decoding, in every layout the rank count allows.

At temperature 0 the tokens are exactly plain decoding's, whatever the draft: the
target's Q8_0 GGUF (most drafts accepted), a random other model with the same
vocabulary (hardly any accepted) and the n-gram lookup.
Layouts: one rank; at 2 ranks tensor 2 and pipeline 2; at 4 ranks tensor 2 x
pipeline 2. Two prompts decode together, prefilled in chunks of 3 tokens. With
sampling, a seeded run gives the same tokens in every layout (the draft model's
distributions cross the pipeline with its drafts); the distribution itself is
checked in tests/unit/test_llm_speculative.py.
"""

from __future__ import annotations

import shutil
import socket
import tempfile

import pytest

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

N_NEW = 14
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 9, 7], [5, 6, 7, 5, 6]]


@pytest.fixture(scope="module")
def models():
    from hpcmac.llm.model.fixtures import random_checkpoint, write_gguf

    g = world()
    root = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-spec-") if g.rank == 0 else None, 0)
    paths = {"target": f"{root}/target", "other": f"{root}/other", "q8": f"{root}/q8.gguf"}
    if g.rank == 0:
        shape = dict(num_hidden_layers=3, initializer_range=0.2, hidden_size=64,
                     intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
        random_checkpoint("llama", paths["target"], seed=3, **shape)
        random_checkpoint("llama", paths["other"], seed=4, **shape)
        write_gguf(paths["target"], paths["q8"], "Q8_0")
    g.barrier()
    yield paths
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def layouts(p: int) -> dict[str, tuple[int, int]]:
    """name -> (tp, pp) at p ranks."""
    return {1: {"one rank": (1, 1)}, 2: {"tensor 2": (2, 1), "pipeline 2": (1, 2)},
            4: {"tensor 2 x pipeline 2": (2, 2)}}.get(p, {})


def run(path: str, tp: int, pp: int, draft: str | None, sampling=None, k: int = 3, g=None):
    """Collective over ``g`` (the world): the prompts through tp x pp ranks, drafting
    with ``draft``."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.sampling import SamplingParams
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.pipeline import Request
    from hpcmac.llm.parallel.placement import fixed
    from hpcmac.llm.parallel.runtime import bring_up

    g = g or world()
    cfg = load_config(path)
    hosts = g.allgather_obj(socket.gethostname())
    rt = bring_up(g, fixed(cfg, hosts, tp, S.even_counts(cfg.n_layers, pp)), path, cfg,
                  draft=draft)
    sampling = sampling or SamplingParams()
    reqs = [Request(list(p), N_NEW, SamplingParams(**{**sampling.__dict__, "seed": (
        None if sampling.seed is None else sampling.seed + i)}), draft_k=k)
        for i, p in enumerate(PROMPTS)] if g.rank == 0 else None
    return rt.run(reqs, prefill_chunk=3, max_batch=2)


#: plain decoding's tokens per layout (tp, pp), computed by the first test that needs them
PLAIN: dict[tuple[int, int], list[list[int]]] = {}


@pytest.mark.parametrize("draft", ["q8", "other", "ngram"])
def test_greedy_tokens_are_plain_decodings(models, draft):
    g = world()
    src = "ngram" if draft == "ngram" else models[draft]
    for name, (tp, pp) in layouts(g.size).items():
        if (tp, pp) not in PLAIN:  # plain decoding in this layout, once for every draft
            PLAIN[tp, pp] = [s.tokens for s in run(models["target"], tp, pp, None).seqs]
        plain = PLAIN[tp, pp]
        res = run(models["target"], tp, pp, src)
        what = f"np={g.size} {name} draft {draft}"
        parallel_assert([s.tokens for s in res.seqs] == plain,
                        f"{what}: {[s.tokens for s in res.seqs]} != {plain}", g)
        sp = res.speculative
        parallel_assert(sp is not None and sp["drafted"] > 0, f"{what}: no drafts: {sp}", g)
        if draft == "q8":
            parallel_assert(sp["accepted"] >= 0.7 * sp["drafted"], f"{what}: {sp}", g)
        if draft == "other":
            parallel_assert(sp["accepted"] <= 0.3 * sp["drafted"], f"{what}: {sp}", g)


def test_seeded_sampling_is_the_same_in_every_layout(models):
    """The verifier's draws live on the last stage's leader: a seed gives the same
    tokens in every layout, with the draft model's distributions sent down the pipeline."""
    from hpcmac.comm.local import LocalGroup
    from hpcmac.llm.model.sampling import SamplingParams

    g = world()
    params = SamplingParams(temperature=1.0, top_k=40, seed=11)
    one = None
    if g.rank == 0:  # the one-rank run, in this process alone
        one = [s.tokens for s in run(models["target"], 1, 1, models["other"], params,
                                     g=LocalGroup()).seqs]
    one = g.bcast_obj(one, 0)
    for name, (tp, pp) in layouts(g.size).items():
        res = run(models["target"], tp, pp, models["other"], params)
        toks = [s.tokens for s in res.seqs]
        parallel_assert(toks == one, f"np={g.size} {name}: {toks} != one rank's {one}", g)
        parallel_assert(res.speculative["drafted"] > 0, f"{name}: {res.speculative}", g)
    parallel_assert(len(set(map(tuple, one))) == 2 and all(len(t) == N_NEW for t in one),
                    f"{one}", g)
