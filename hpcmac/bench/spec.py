"""``python -m hpcmac.bench.spec``: speculative decoding against plain decoding, and llama.cpp's.

Measured in one run, in interleaved rounds (medians reported), one BLAS or llama.cpp
thread per rank:

* the target is SmolLM2-135M-Instruct dequantized to float32 (a GGUF written from the
  package's Q4_1 file, :func:`~hpcmac.llm.model.fixtures.dequantized_gguf`), the draft
  model that Q4_1 file itself (kept quantized);
* ``generate`` at 1 rank and at ``--tp 2`` (mpirun): plain, ``--draft-model`` on a chat
  prompt, and ``--draft ngram`` on a repetitive one (a code block to edit and print
  again), greedy; decode tok/s and the acceptance from its ``--json``; the tokens of
  each speculative run are checked equal to the plain run's;
* llama.cpp (``xllamacpp``, if installed) on the same two files at 1 thread: plain,
  its draft-model speculation and its n-gram one (``ngram_simple``), the same prompts.

Ratios are per round (a shared machine's load moves between rounds): speculative over
plain decode tok/s in the same layout, and hpcmac's speculative tok/s over llama.cpp's.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output

ROOT = Path(__file__).resolve().parents[2]
CHAT = "Write a short story about a robot who learns to paint."
CODE = '''Here is a Python function:

```python
def summarize(values):
    total = 0
    count = 0
    for v in values:
        if v is None:
            continue
        total += v
        count += 1
    if count == 0:
        return None
    mean = total / count
    spread = 0
    for v in values:
        if v is None:
            continue
        spread += (v - mean) ** 2
    return {"total": total, "count": count, "mean": mean, "spread": spread / count}
```

Rename the variable `total` to `acc` and print the whole function again.'''

_LLAMACPP = r"""
import json, sys, xllamacpp as xlc
target, draft, kind, k, n, threads, prompt = sys.argv[1:8]
p = xlc.CommonParams()
p.model.path = target
p.n_ctx = 2048
p.cpuparams.n_threads = int(threads)
p.cpuparams_batch.n_threads = int(threads)
T = xlc.common_speculative_type
if kind == "draft":
    p.speculative.types = [T.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE]
    p.speculative.draft.mparams.path = draft
    p.speculative.draft.n_max = int(k)
    p.speculative.draft.cpuparams.n_threads = int(threads)
    p.speculative.draft.cpuparams_batch.n_threads = int(threads)
elif kind == "ngram":
    p.speculative.types = [T.COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE]
server = xlc.Server(p)
req = {"messages": [{"role": "user", "content": prompt}], "max_tokens": int(n),
       "temperature": 0, "cache_prompt": False}
for _ in range(2):  # the first warms up
    res = server.handle_chat_completions(req)
t = res["timings"]
print(json.dumps({"tok_s": t["predicted_per_second"], "n": t.get("predicted_n"),
                  "draft": t.get("draft_n"), "accepted": t.get("draft_n_accepted")}))
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1")
    return env


def generate(np_: int, target: str, prompt: str, n: int, extra: list[str], work: Path,
             timeout: float) -> dict:
    """One ``generate`` run's JSON (1 rank, or ``np_`` ranks under tools/mpirun)."""
    out = work / "gen.json"
    cmd = [sys.executable, "-m", "hpcmac.llm", "generate", "--model", target, "--prompt",
           prompt, "--max-tokens", str(n), "--threads", "1", "--quiet", "--json", str(out),
           *extra]
    if np_ > 1:
        cmd = [str(ROOT / "tools" / "mpirun"), str(np_), *cmd, "--tp", str(np_)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"generate {' '.join(extra)} at np {np_}: exit {r.returncode}: "
                           f"{r.stderr.strip()[-400:]}")
    doc = json.loads(out.read_text())
    sp = doc.get("speculative") or {}
    return {"tok_s": doc["aggregate_decode_tok_s"], "tokens": doc["tokens"],
            "draft": sp.get("drafted"), "accepted": sp.get("accepted"),
            "draft_s": sp.get("draft_s"), "wall_s": doc["wall_s"]}


def llamacpp(target: str, draft: str, kind: str, k: int, prompt: str, n: int,
             timeout: float) -> dict | None:
    """llama.cpp's decode tok/s (plain, "draft" or "ngram"); None without xllamacpp."""
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        return None
    r = subprocess.run([sys.executable, "-c", _LLAMACPP, target, draft, kind, str(k), str(n),
                        "1", prompt], capture_output=True, text=True, timeout=timeout,
                       env=_env())
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp {kind}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hpcmac.bench.spec", description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None,
                    help="where the float32 target GGUF is written (kept: reused next time)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2, help="the tensor layout measured (0: none)")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    ap.add_argument("--json", type=checked_output("--json"), default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.max_tokens < 2 or args.rounds < 1 or args.draft_k < 1 or args.tp < 0:
        raise UsageError("--max-tokens >= 2, --rounds >= 1, --draft-k >= 1, --tp >= 0")
    from hpcmac.llm.model.config import resolve_model
    from hpcmac.llm.model.fixtures import dequantized_gguf

    draft = str(resolve_model("smollm2"))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hpcmac-spec-"))
    work.mkdir(parents=True, exist_ok=True)
    target = work / "SmolLM2-135M-Instruct.F32.gguf"
    if not target.exists():
        dequantized_gguf(draft, work / "f32.part")
        (work / "f32.part").rename(target)
    target = str(target)
    k = ["--draft-k", str(args.draft_k)]
    cases = {  # name -> (ranks, prompt, flags)
        "1 rank plain": (1, CHAT, []),
        "1 rank draft model": (1, CHAT, ["--draft-model", draft, *k]),
        "1 rank plain, code": (1, CODE, []),
        "1 rank ngram, code": (1, CODE, ["--draft", "ngram", *k]),
    }
    if args.tp > 1:
        cases.update({f"tp {args.tp} plain": (args.tp, CHAT, []),
                      f"tp {args.tp} draft model": (args.tp, CHAT, ["--draft-model", draft, *k]),
                      f"tp {args.tp} plain, code": (args.tp, CODE, []),
                      f"tp {args.tp} ngram, code": (args.tp, CODE, ["--draft", "ngram", *k])})
    lc_cases = {} if args.no_llamacpp else {
        "llama.cpp plain": ("plain", CHAT), "llama.cpp draft model": ("draft", CHAT),
        "llama.cpp plain, code": ("plain", CODE), "llama.cpp ngram, code": ("ngram", CODE)}
    load0 = os.getloadavg()
    print(f"# hpcmac.bench.spec: target {Path(target).name} (float32), draft "
          f"{Path(draft).name}, {args.max_tokens} new tokens, K {args.draft_k}, "
          f"{args.rounds} rounds, {os.cpu_count()} cores, load average {load0[0]:.1f} at "
          "start", flush=True)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name, (np_, prompt, flags) in cases.items():
            row[name] = generate(np_, target, prompt, args.max_tokens, flags, work,
                                 args.timeout)
        for name, (kind, prompt) in lc_cases.items():
            got = llamacpp(target, draft, kind, args.draft_k, prompt, args.max_tokens,
                           args.timeout)
            if got is not None:
                row[name] = got
        for name, v in row.items():  # greedy speculation must give plain decoding's tokens
            plain = name.replace("draft model", "plain").replace("ngram", "plain")
            if "tokens" in v and plain != name and v["tokens"] != row[plain]["tokens"]:
                raise RuntimeError(f"{name}: tokens differ from {plain}'s")
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{n} {v['tok_s']:.1f}" for n, v in row.items()),
              flush=True)
    med = {n: statistics.median(r[n]["tok_s"] for r in rounds) for n in rounds[0]}
    print(f"\n| run | decode tok/s | vs plain | acceptance | load at end "
          f"{os.getloadavg()[0]:.1f} |")
    print("|---|---|---|---|---|")
    summary = {}
    for name in rounds[0]:
        plain = name.replace("draft model", "plain").replace("ngram", "plain")
        ratio = statistics.median(r[name]["tok_s"] / r[plain]["tok_s"] for r in rounds) \
            if plain != name else None
        last = rounds[-1][name]
        acc = last["accepted"] / last["draft"] if last.get("draft") else None
        summary[name] = {"tok_s": med[name], "vs_plain": ratio, "acceptance": acc,
                         "rounds": [r[name]["tok_s"] for r in rounds]}
        shown = "" if acc is None else f"{acc:.0%} of {last['draft']}"
        print(f"| {name} | {med[name]:.1f} | {'' if ratio is None else f'{ratio:.2f}x'} | "
              f"{shown} | |")
    for ours, theirs in (("1 rank draft model", "llama.cpp draft model"),
                         ("1 rank ngram, code", "llama.cpp ngram, code")):
        if theirs in med:
            ratio = statistics.median(r[ours]["tok_s"] / r[theirs]["tok_s"] for r in rounds)
            summary[f"{ours} vs {theirs}"] = ratio
            print(f"{ours} / {theirs}: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_start": load0[0], "summary": summary,
                                               "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    from hpcmac.lifecycle import run_cli

    raise SystemExit(run_cli(main))
