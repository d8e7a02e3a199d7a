"""One request that fails inside the pipeline ends that request alone (serve's scheduler).

Requests come through a :class:`~hpcmac.llm.parallel.live.LiveRequests` source, as
``serve`` feeds them, but without the HTTP edge's checks, so that bad values reach
the scheduler: a seed numpy refuses, a seed too wide for the wire (np > 1), a
sampling failure injected on the last stage, a callback that raises. Each must
finish with ``error`` and a reason; the good requests around them must give the
whole model's greedy tokens; the job must end normally.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from hpcmac.llm.model.sampling import Sampler, SamplingParams
from hpcmac.llm.parallel import plan as S
from hpcmac.llm.parallel.pipeline import run_pipeline
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

N_NEW = 5
INJECTED = 666  # the seed whose sampling is made to fail on the last stage


@pytest.fixture(scope="module")
def checkpoint():
    from hpcmac.llm.model.fixtures import random_checkpoint

    g = world()
    root = tempfile.mkdtemp(prefix="hpcmac-live-") if g.rank == 0 else None
    root = g.bcast_obj(root, 0)
    if g.rank == 0:
        random_checkpoint("llama", f"{root}/llama", seed=4, num_hidden_layers=4)
    g.barrier()
    yield f"{root}/llama"
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def test_a_failing_request_ends_alone(checkpoint, monkeypatch):
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.fixtures import stage_greedy
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.parallel.live import LiveRequest, LiveRequests

    g = world()
    real_call = Sampler.__call__

    def failing(self, logits, seen=(), mask=None):
        if self.params.seed == INJECTED:
            raise RuntimeError("injected sampling failure")
        return real_call(self, logits, seen, mask)

    monkeypatch.setattr(Sampler, "__call__", failing)
    cfg = load_config(checkpoint)
    spec = S.stages_from_counts(S.even_counts(cfg.n_layers, g.size))[g.rank]
    stage = load_stage(checkpoint, spec.start, spec.end, first=spec.first, last=spec.last)
    good = {"good-a": [3, 17, 42, 8], "good-b": [5, 9, 60]}
    cases = {  # name -> (prompt, sampling, raising on_token)
        "good-a": (good["good-a"], SamplingParams(), False),
        "seed -1": ([1, 2, 3], SamplingParams(temperature=0.7, seed=-1), False),
        "seed 2**70": ([1, 2, 3], SamplingParams(temperature=0.7, seed=2**70), False),
        "injected": ([4, 5, 6], SamplingParams(seed=INJECTED), False),
        "callback": ([7, 8], SamplingParams(), True),
        "good-b": (good["good-b"], SamplingParams(), False),
    }
    done: dict[str, tuple[str, str | None, list[int]]] = {}
    reqs: dict[str, LiveRequest] = {}
    source = None
    if g.rank == 0:
        source = LiveRequests(capacity=16, ping_s=0.2)
        for name, (prompt, sampling, raising) in cases.items():
            toks: list[int] = []

            def on_token(tok, toks=toks, raising=raising):
                if raising:
                    raise RuntimeError("the client's queue broke")
                toks.append(tok)

            def on_finish(reason, n, name=name, toks=toks):
                done[name] = (reason, reqs[name].error, toks)
                if len(done) == len(cases):
                    source.close()

            reqs[name] = LiveRequest(prompt=prompt, max_tokens=N_NEW, sampling=sampling,
                                     on_token=on_token, on_finish=on_finish)
            source.submit(reqs[name])
    res = run_pipeline(g, stage, spec, cfg.hidden, None, source=source, max_batch=4,
                       max_len=32, on_token=source.token if source else None, timeout=60)
    done = g.bcast_obj(done, 0)
    parallel_assert(set(done) == set(cases), f"finished: {sorted(done)}", g)
    parallel_assert(not res.interrupted, "the pipeline was interrupted", g)
    whole = load_stage(checkpoint, 0, cfg.n_layers, first=True, last=True)
    for name, prompt in good.items():
        reason, _, toks = done[name]
        want = stage_greedy(whole, prompt, N_NEW)
        parallel_assert(reason == "length" and toks == want, f"{name}: {done[name]} != {want}", g)
    expect = {"seed -1": "non-negative", "injected": "sampling failed",
              "callback": "queue broke"}
    if g.size > 1:  # one rank samples locally: numpy takes any non-negative seed
        expect["seed 2**70"] = "64 at most"
    for name, words in expect.items():
        reason, error, _ = done[name]
        parallel_assert(reason == "error" and words in (error or ""),
                        f"{name}: {reason} {error!r}", g)


def test_generate_still_fails_on_a_bad_request(checkpoint):
    """Without a live source (generate), a request's failure is the run's, as before
    (generate checks its flags first); one rank, so that no peer is left waiting."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.parallel.pipeline import Request

    g = world()
    if g.size > 1:
        pytest.skip("a failing rank would leave its peers waiting; one rank shows the rule")
    cfg = load_config(checkpoint)
    stage = load_stage(checkpoint, 0, cfg.n_layers, first=True, last=True)
    spec = S.stages_from_counts([cfg.n_layers])[0]
    bad = Request([1, 2, 3], 3, SamplingParams(temperature=0.7, seed=-1))
    with pytest.raises(ValueError, match="non-negative"):
        run_pipeline(g, stage, spec, cfg.hidden, [bad])
