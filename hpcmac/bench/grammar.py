"""``python -m hpcmac.bench.grammar``: what constrained decoding costs.

1. **The mask per token**, against one decode step of SmolLM2 on one rank (one
   sequence, numpy, measured in the same run): for each grammar engine installed
   (llguidance, which serve uses; xgrammar and outlines-core when present, for the
   comparison in docs/serve.md) and each vocabulary: SmolLM2's own 49,152 tokens,
   and a 150k one made from it offline (SmolLM2's byte-level BPE extended to
   151,000 tokens by merges of pairs of its own word tokens, as BPE training adds
   them; no tokenizer can be downloaded here). A JSON answer valid under a small
   schema is walked token by token; per token: the engine's mask, plus (llguidance)
   applying it to a float32 logits row as the sampler does. Compile time per
   schema and the tokenizer's one-time setup are reported apart.
2. **Serving** (``--serve``): a live ``serve`` (``--ranks``, 16 slots), 16 concurrent
   streaming clients sending the same chat requests without and with a JSON-schema
   ``response_format``; aggregate completion tok/s of each and their ratio. The
   schema's string has a ``minLength`` past ``max_tokens``, so that both runs decode
   the same number of tokens (a JSON answer that ends early would leave each
   request's prefill over fewer tokens, which is not the grammar's cost).
"""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.lifecycle import run_cli

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string"}}}}}
ANSWER = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36,
          "tags": ["mathematics", "poetry", "the analytical engine", "notes"],
          "address": {"city": "London", "zip": "W1"}}
SERVE_SCHEMA = {"type": "object", "additionalProperties": False,
                "required": ["answer", "confidence"],
                "properties": {"answer": {"type": "string", "minLength": 400},
                               "confidence": {"type": "integer", "minimum": 0,
                                              "maximum": 100}}}


def widened(tk, n: int, seed: int = 0):
    """A copy of the byte-level BPE ``tk`` (a ``tokenizers.Tokenizer``) with ``n`` tokens:
    new tokens are merges of two of its word tokens (at most 16 characters)."""
    from tokenizers import Tokenizer

    d = json.loads(tk.to_str())
    vocab, merges = d["model"]["vocab"], d["model"]["merges"]
    words = [t for t in vocab if t.isalpha() or t.startswith("\u0120")]
    have = set(vocab)
    top = max(list(vocab.values()) + [a["id"] for a in d.get("added_tokens", [])]) + 1
    rng = random.Random(seed)
    while top < n:
        a, b = rng.choice(words), rng.choice(words)
        if b.startswith("\u0120") and rng.random() < 0.7 and b[1:] in have:
            b = b[1:]
        t = a + b
        if t in have or len(t) > 16:
            continue
        have.add(t)
        vocab[t] = top
        top += 1
        merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
    return Tokenizer.from_str(json.dumps(d))


def _stats(times: list[float]) -> dict:
    a = np.asarray(times) * 1e6
    return {"mean_us": float(a.mean()), "p50_us": float(np.median(a)),
            "p95_us": float(np.percentile(a, 95)), "max_us": float(a.max())}


def mask_llguidance(tk, n: int, eos: list[int], ids: list[int]) -> dict:
    from hpcmac.llm import grammar

    class _Tok:  # what grammar.ll_tokenizer reads
        def __init__(self):
            self.tk, self.eos_ids = tk, eos

    t0 = time.perf_counter()
    lt = grammar.ll_tokenizer(_Tok(), n)
    t1 = time.perf_counter()
    g = grammar.json_schema(SCHEMA, "schema", lt)
    c = grammar.Constraint(g, lt)
    t2 = time.perf_counter()
    row = np.empty((1, grammar.mask_words(n)), dtype=np.int32)
    logits = np.random.default_rng(0).standard_normal((1, n)).astype(np.float32)
    masks, applies = [], []
    for t in ids:
        a = time.perf_counter()
        c.fill(row[0])
        b = time.perf_counter()
        grammar.apply_mask(logits.copy(), row)
        masks.append(b - a)
        applies.append(time.perf_counter() - b)
        c.accept(t)
    return {"setup_s": t1 - t0, "compile_s": t2 - t1, **_stats(masks),
            "with_apply_mean_us": float(np.mean(np.add(masks, applies)) * 1e6)}


def mask_xgrammar(tk, n: int, eos: list[int], ids: list[int]) -> dict:
    import xgrammar as xgr

    d = json.loads(tk.to_str())
    vocab = [""] * n
    for t, i in d["model"]["vocab"].items():
        vocab[i] = t
    for a in d.get("added_tokens", []):
        vocab[a["id"]] = a["content"]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=n,
                             stop_token_ids=eos)
    comp = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    m = xgr.GrammarMatcher(comp.compile_json_schema(json.dumps(SCHEMA),
                                                    any_whitespace=False,
                                                    separators=(",", ":")))
    t2 = time.perf_counter()
    bm = xgr.allocate_token_bitmask(1, n)
    times = []
    for t in ids:
        a = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        times.append(time.perf_counter() - a)
        if not m.accept_token(t):
            raise RuntimeError(f"xgrammar refused token {t}")
    return {"setup_s": t1 - t0, "compile_s": t2 - t1, **_stats(times)}


def mask_outlines(tk, n: int, eos: list[int], ids: list[int]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    from hpcmac.llm.model.tokenizer import _bytes_to_unicode

    u2b = {v: k for k, v in _bytes_to_unicode().items()}
    by_bytes: dict[bytes, list[int]] = {}
    for t, i in json.loads(tk.to_str())["model"]["vocab"].items():
        if i in eos or any(ch not in u2b for ch in t):
            continue
        by_bytes.setdefault(bytes(u2b[ch] for ch in t), []).append(i)
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos[0], by_bytes))
    t1 = time.perf_counter()
    guide = Guide(index)
    times = []
    for t in ids:
        a = time.perf_counter()
        guide.get_tokens()
        times.append(time.perf_counter() - a)
        guide.advance(t)
    return {"setup_s": 0.0, "compile_s": t1 - t0, **_stats(times)}


ENGINES = {"llguidance": mask_llguidance, "xgrammar": mask_xgrammar,
           "outlines-core": mask_outlines}


def decode_step_s(model: str, steps: int = 24) -> float:
    """Seconds of one decode step (one sequence, the whole model on one rank, numpy)."""
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.stage import Batch, load_stage

    cfg = load_config(model)
    stage = load_stage(model, 0, cfg.n_layers)
    cache = stage.new_cache(1, 64 + steps)
    prompt = np.arange(1, 33, dtype=np.int64)
    stage.logits(stage.forward(stage.embed(prompt), Batch([0], [32], [0]), cache)[-1:])
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        h = stage.forward(stage.embed(np.array([7 + k], dtype=np.int64)),
                          Batch([0], [1], [32 + k]), cache)
        stage.logits(h)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def serve_ratio(np_: int, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    from hpcmac.bench.serve import PROMPTS, load, start_server, stop_server

    reqs = [(PROMPTS[i % len(PROMPTS)] + " Answer as JSON.", max_tokens)
            for i in range(requests)]
    rf = {"response_format": {"type": "json_schema",
                              "json_schema": {"name": "answer", "schema": SERVE_SCHEMA}}}
    proc, url = start_server(np_, model, clients, [])
    try:
        load(url, 2, reqs[:2], rf)  # warm-up (the grammar's tokenizer, kernels)
        plain = load(url, clients, reqs)
        structured = load(url, clients, reqs, rf)
    finally:
        stop_server(proc)
    return {"ranks": np_, "clients": clients, "plain_tok_s": plain["tok_s"],
            "structured_tok_s": structured["tok_s"],
            "ratio": structured["tok_s"] / plain["tok_s"],
            "plain_tokens": plain["tokens"], "structured_tokens": structured["tokens"]}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hpcmac.bench.grammar", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--vocab", type=int, nargs="+", default=[0, 151_000],
                    help="vocabulary sizes (0: the model's own)")
    ap.add_argument("--serve", action="store_true", help="also the 16-client serve ratio")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    from importlib.util import find_spec

    from hpcmac.llm.model.tokenizer import load_tokenizer

    tok = load_tokenizer(args.model)
    if tok is None:
        raise UsageError(f"--model {args.model}: no tokenizer")
    step = decode_step_s(args.model)
    load_avg = open("/proc/loadavg").read().split()[:3]
    print(f"hpcmac.bench.grammar: {args.model}, one decode step (1 sequence, 1 rank, numpy): "
          f"{step * 1e3:.1f} ms; load average {' '.join(load_avg)}")
    print(f"{'engine':<14} {'vocab':>7} {'mask mean':>10} {'p95':>8} {'max':>8} "
          f"{'+apply':>8} {'of a step':>9} {'compile':>9} {'setup':>7}")
    rows = []
    for n in args.vocab:
        tk = tok.tk if n == 0 else widened(tok.tk, n)
        size = tk.get_vocab_size(with_added_tokens=True)
        ids = tk.encode(json.dumps(ANSWER, separators=(",", ":"))).ids
        for eng in args.engines:
            mod = {"llguidance": "llguidance", "xgrammar": "xgrammar",
                   "outlines-core": "outlines_core"}[eng]
            if find_spec(mod) is None:
                print(f"{eng:<14} {size:>7} (not installed)")
                continue
            r = ENGINES[eng](tk, size, list(tok.eos_ids), ids)
            cost = r.get("with_apply_mean_us", r["mean_us"])
            r.update(engine=eng, vocab=size, tokens=len(ids), step_ms=step * 1e3,
                     of_step=cost * 1e-6 / step)
            rows.append(r)
            apply = f"{r['with_apply_mean_us']:>6.0f}us" if "with_apply_mean_us" in r else \
                f"{'-':>8}"
            print(f"{eng:<14} {size:>7} {r['mean_us']:>8.0f}us {r['p95_us']:>6.0f}us "
                  f"{r['max_us']:>6.0f}us {apply} {r['of_step'] * 100:>8.2f}% "
                  f"{r['compile_s'] * 1e3:>7.1f}ms {r['setup_s']:>6.2f}s")
    if args.serve:
        r = serve_ratio(args.ranks, args.model, args.clients, args.requests, args.max_tokens)
        load_avg = open("/proc/loadavg").read().split()[:3]
        print(f"serve, {r['ranks']} rank(s), {r['clients']} streaming clients, "
              f"{args.requests} requests of <= {args.max_tokens} tokens: plain "
              f"{r['plain_tok_s']:.1f} tok/s ({r['plain_tokens']} tokens), json_schema "
              f"{r['structured_tok_s']:.1f} tok/s ({r['structured_tokens']} tokens): "
              f"{r['ratio']:.2f}x; load average {' '.join(load_avg)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
