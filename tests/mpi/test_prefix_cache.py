"""The prefix cache (serve's scheduler, through a live source): output never changes.

A 6-turn chat at token level, each turn's prompt the previous prompt, its answer and
new "user" tokens, through every layout of the job (one rank; a pipeline; a tensor
group; tensor x pipeline at 4): the greedy tokens with the cache on, off, and so
small that it evicts, must be the same; each turn reuses exactly the whole blocks of
what the previous turn fed. Two requests sharing a "system prompt", submitted
together: the second waits for the first's blocks and reuses them; both answers are
the cache-off ones. Blocks of 4 tokens, prompts cut in chunks of 3 (blocks are saved
across chunk boundaries).

Qwen3-Next (Gated DeltaNet on 3 of its 4 layers): a reused prefix must end at a block
saved with the layers' recurrent states, which exist only where the sequence was fed to
exactly that token (prompt chunks end at block boundaries for it, and runs of generated
blocks end where they were fed); so it reuses at least the previous prompt's whole
blocks, at most what an attention model reuses.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

BLOCK = 4
N_NEW = 5
VOCAB = 96


@pytest.fixture(scope="module", params=["llama", "deepseek_v4", "qwen3_next"])
def checkpoint(request):
    """A random model: llama (K and V), deepseek_v4 (a K = V head: no V in its cache,
    and compressor projections in its third array, all copied with the blocks), and
    qwen3_next (linear-attention states kept with some blocks)."""
    from hpcmac.llm.model.fixtures import random_checkpoint

    g, fam = world(), request.param
    root = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-prefix-") if g.rank == 0 else None, 0)
    if g.rank == 0:
        random_checkpoint(fam, f"{root}/{fam}", seed=11, num_hidden_layers=4,
                          initializer_range=0.2)
    g.barrier()
    yield f"{root}/{fam}"
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def layouts(p: int) -> dict[str, int]:
    """name -> ranks per tensor group, at ``p`` ranks."""
    out = {"pipeline" if p > 1 else "one rank": 1}
    if p > 1:
        out["tensor 2" + (" x pipeline 2" if p == 4 else "")] = 2
    return out


_RUNTIMES: dict = {}


def runtime(path: str, tp: int):
    """Collective: the job's ranks brought up as ``tp`` x ``size / tp`` (kept per model and
    layout)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.parallel import plan as S
    from hpcmac.llm.parallel.placement import fixed
    from hpcmac.llm.parallel.runtime import bring_up

    if (path, tp) not in _RUNTIMES:
        g = world()
        cfg = load_config(path)
        hosts = g.allgather_obj(__import__("socket").gethostname())
        pl = fixed(cfg, hosts, tp, S.even_counts(cfg.n_layers, g.size // tp))
        _RUNTIMES[path, tp] = bring_up(g, pl, path, cfg)
    return _RUNTIMES[path, tp]


def serve(rt, turns, blocks: int, n_new: int = N_NEW):
    """Collective: run ``turns`` (a callable (done so far) -> next request's prompt, or
    None) one request after another through a live source; (prompt, tokens, cached) of
    each on every rank, and the prefix cache's counters."""
    from hpcmac.llm.parallel.live import LiveRequest, LiveRequests

    g = world()
    source, done = None, []
    if g.rank == 0:
        source = LiveRequests(capacity=8, ping_s=0.2)

        def submit(prompt):
            toks: list[int] = []

            def on_finish(reason, n, prompt=prompt, toks=toks):
                done.append((prompt, list(toks), req.cached_tokens))
                nxt = turns(done)
                if nxt is None:
                    source.close()
                else:
                    submit(nxt)

            req = LiveRequest(prompt=list(prompt), max_tokens=n_new, on_token=toks.append,
                              on_finish=on_finish)
            source.submit(req)

        submit(turns(done))
    res = rt.run(None, source=source, max_batch=4, max_len=128, prefill_chunk=3,
                 on_token=source.token if source else None, prefix_blocks=blocks,
                 prefix_block=BLOCK)
    return g.bcast_obj(done, 0), res.prefix


def on_and_off(rt, turns, blocks: int, what: str, n_new: int = N_NEW):
    """Collective: ``turns`` with the cache off and with ``blocks``; each request's tokens
    must be the same. (the cache-on results, the cache-off ones, the cache's counters)."""
    g = world()
    off, _ = serve(rt, turns, 0, n_new)
    on, stats = serve(rt, turns, blocks, n_new)
    for k in range(len(off)):
        parallel_assert(on[k][1] == off[k][1], f"{what} request {k + 1}: on {on[k][1]}, "
                                               f"off {off[k][1]}", g)
    return on, off, stats


def chat(done, chats: int = 1, turns: int = 6):
    """The next turn of ``chats`` interleaved chats of ``turns`` turns in all: the last
    prompt of its chat, its answer, 6 new tokens."""
    k = len(done)
    if k == turns:
        return None
    rng = np.random.default_rng(k)
    mine = done[k % chats::chats] if k >= chats else []
    if not mine:
        return [int(t) for t in rng.integers(0, VOCAB, 10)]
    prompt, toks, _ = mine[-1]
    return prompt + toks + [int(t) for t in rng.integers(0, VOCAB, 6)]


def two_chats(done):
    return chat(done, 2)


def check_cached(what: str, path: str, cached: int, prev: list[int], fed: int, limit: int):
    """A turn's reuse: every whole block fed before (attention); for linear attention a
    block boundary from the previous prompt's last one up to that."""
    g = world()
    want = min(fed, limit) // BLOCK * BLOCK
    if not path.endswith("qwen3_next"):
        parallel_assert(cached == want, f"{what}: cached {cached}, expected {want}", g)
        return
    lo = min(len(prev), limit) // BLOCK * BLOCK
    parallel_assert(cached % BLOCK == 0 and lo <= cached <= want,
                    f"{what}: cached {cached}, expected a block boundary in [{lo}, {want}]", g)


def test_chat_same_tokens_with_the_cache_on_off_and_evicting(checkpoint):
    g = world()
    for name, tp in layouts(g.size).items():
        rt = runtime(checkpoint, tp)
        what = f"np={g.size} {name}"
        on, off, stats = on_and_off(rt, chat, 64, what)
        for k in range(1, 6):
            prompt, (prev, prev_toks, _) = on[k][0], on[k - 1]
            fed = len(prev) + len(prev_toks) - 1  # the last token sampled is never fed
            check_cached(f"{what} turn {k + 1}", checkpoint, on[k][2], prev, fed,
                         len(prompt) - 1)
        parallel_assert(on[0][2] == 0 and all(c == 0 for _, _, c in off), f"{what}", g)
        parallel_assert(stats["hits"] == 5 and stats["evictions"] == 0, f"{what}: {stats}", g)
        # two chats taking turns in a cache of 5 blocks: each evicts the other's leaves
        tiny, _, tiny_stats = on_and_off(rt, two_chats, 5, f"{what} two chats")
        parallel_assert(tiny_stats["evictions"] > 0 and tiny_stats["hits"] > 0
                        and tiny_stats["blocks"] <= 5, f"{what}: {tiny_stats}", g)


def test_answers_saved_while_they_decode(checkpoint):
    """Answers of 35 tokens: the blocks holding generated tokens are saved every SAVE_RUN
    (16) tokens while the answer decodes, and the rest when it ends; the next turn reuses
    every whole block fed, and its tokens are the cache-off ones (3 turns)."""
    from hpcmac.llm.parallel.prefix import SAVE_RUN

    g = world()
    n_new = 2 * SAVE_RUN + 3

    def three(done):
        return chat(done, turns=3)

    for name, tp in layouts(g.size).items():
        rt = runtime(checkpoint, tp)
        what = f"np={g.size} {name}"
        on, _, stats = on_and_off(rt, three, 64, what, n_new)
        for k in range(3):
            parallel_assert(len(on[k][1]) == n_new, f"{what} turn {k + 1}: {on[k][1]}", g)
        for k in range(1, 3):
            prompt, (prev, prev_toks, _) = on[k][0], on[k - 1]
            check_cached(f"{what} turn {k + 1}", checkpoint, on[k][2], prev,
                         len(prev) + len(prev_toks) - 1, len(prompt) - 1)
            if checkpoint.endswith("qwen3_next"):  # a run of generated blocks was resumed
                parallel_assert(on[k][2] > len(prev), f"{what} turn {k + 1}: cached "
                                                       f"{on[k][2]} of a {len(prev)}-token "
                                                       "prompt and its answer", g)
        parallel_assert(stats["hits"] == 2, f"{what}: {stats}", g)


def together(rt, prompts, blocks: int):
    """Collective: ``prompts`` submitted at once; (tokens, cached) of each on every rank."""
    from hpcmac.llm.parallel.live import LiveRequest, LiveRequests

    g = world()
    source, done = None, {}
    if g.rank == 0:
        source = LiveRequests(capacity=8, ping_s=0.2)
        reqs = []
        for i, p in enumerate(prompts):
            toks: list[int] = []

            def on_finish(reason, n, i=i, toks=toks):
                done[i] = (list(toks), reqs[i].cached_tokens)
                if len(done) == len(prompts):
                    source.close()

            reqs.append(LiveRequest(prompt=p, max_tokens=N_NEW, on_token=toks.append,
                                    on_finish=on_finish))
        for r in reqs:
            source.submit(r)
    rt.run(None, source=source, max_batch=4, max_len=128, prefill_chunk=3,
           on_token=source.token if source else None, prefix_blocks=blocks,
           prefix_block=BLOCK)
    return g.bcast_obj(done, 0)


def test_two_requests_sharing_a_system_prompt(checkpoint):
    g = world()
    rng = np.random.default_rng(5)
    system = [int(t) for t in rng.integers(0, VOCAB, 13)]
    prompts = [system + [int(t) for t in rng.integers(0, VOCAB, n)] for n in (5, 7)]
    for name, tp in layouts(g.size).items():
        rt = runtime(checkpoint, tp)
        off, on = together(rt, prompts, 0), together(rt, prompts, 64)
        what = f"np={g.size} {name}"
        for i in range(2):
            parallel_assert(on[i][0] == off[i][0], f"{what} request {i}: {on[i][0]} != "
                                                   f"{off[i][0]}", g)
        # the second waited for the first's blocks: all 3 whole blocks of the 13 shared
        parallel_assert([on[i][1] for i in range(2)] == [0, 12],
                        f"{what}: cached {[on[i][1] for i in range(2)]}", g)


def test_a_prompt_reuses_part_of_a_block(checkpoint):
    """A prompt run again reuses all but its last token, and one that leaves a cached
    prompt inside a block reuses that block's first tokens too (its KV is the prompt's
    own), as llama.cpp reuses a slot token by token; tokens as with the cache off. With
    linear attention a reuse ends at a block boundary that holds the states."""
    g = world()
    rng = np.random.default_rng(9)
    a = [int(t) for t in rng.integers(0, VOCAB, 13)]
    b = a[:10] + [int(t) for t in rng.integers(0, VOCAB, 3)]
    prompts = [a, a, b]

    def three(done):
        return prompts[len(done)] if len(done) < 3 else None

    want = [0, 12, 8] if checkpoint.endswith("qwen3_next") else [0, 12, 10]
    for name, tp in layouts(g.size).items():
        rt = runtime(checkpoint, tp)
        what = f"np={g.size} {name}"
        on, _, _ = on_and_off(rt, three, 64, what)
        parallel_assert([c for _, _, c in on] == want,
                        f"{what}: cached {[c for _, _, c in on]}, expected {want}", g)
