"""``python -m hpcmac.bench.llm --ttft``: time to first token from a fresh process vs llama.cpp.

What a user waits for after typing a command: each round starts two fresh
processes on the same GGUF and the same prompt text, one thread each, and
alternates which goes first:

* hpcmac: ``python -m hpcmac.llm generate --model M --prompt TEXT
  --ignore-chat-template --max-tokens 1 --threads 1`` (interpreter start,
  imports, GGUF header, tokenizer, load, prefill, the first token);
* llama.cpp: a Python process that imports ``xllamacpp``, loads the same GGUF
  with ``n_threads = 1`` and completes the same text for one token.

The time is from starting the process to the first byte of the generated
token on its stdout (both print it as soon as it is known, then exit); the
time to exit is recorded too. Each side's own in-process time to the token
once loaded (hpcmac's ``ttft_s``, llama.cpp's ``prompt_ms``: the prefill) and
the prompt's token count (which must agree) come from the processes. Medians
over ``--rounds``; the ratio is hpcmac / llama.cpp.
"""

from __future__ import annotations

import json
import os
import random
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hpcmac.errors import UsageError

#: the llama.cpp side: load, complete one token, print it at once, then its timings
_LLAMACPP = r"""
import json, sys
import xllamacpp as xlc
p = xlc.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = int(sys.argv[3])
p.cpuparams.n_threads = 1
p.cpuparams_batch.n_threads = 1
server = xlc.Server(p)
res = server.handle_completions({"prompt": open(sys.argv[2]).read(), "max_tokens": 1,
                                 "n_predict": 1, "temperature": 0, "cache_prompt": False})
sys.stdout.write(res["choices"][0]["text"] or " ")
sys.stdout.flush()
t = res["timings"]
sys.stdout.write("\n@@" + json.dumps({"prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"]}))
"""

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his "
          "from at which but have an they you were her she there been one all we their has "
          "would when if so no will can more").split()


def prompt_text(words: int, seed: int = 0) -> str:
    """A deterministic prompt of ``words`` common English words (about one token each)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def timed(cmd: list[str], env: dict, timeout: float) -> tuple[float, float, str]:
    """(seconds to the first stdout byte, seconds to exit, stdout) of a fresh process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = None
    chunks = []
    fd = proc.stdout.fileno()
    deadline = t0 + timeout
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.perf_counter()))
        if not ready:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{cmd[:4]}: no output within {timeout:.0f} s")
        data = os.read(fd, 65536)
        if not data:
            break
        if first is None:
            first = time.perf_counter() - t0
        chunks.append(data)
    rc = proc.wait()
    total = time.perf_counter() - t0
    out = b"".join(chunks).decode("utf-8", errors="replace")
    if rc != 0 or first is None:
        raise RuntimeError(f"{' '.join(cmd[:5])} ...: exit {rc}, output {out[-300:]!r}")
    return first, total, out


def run(model: str | None, words: int, rounds: int, timeout: float, json_path: str | None) -> int:
    """The --ttft benchmark; prints a table, optionally writes JSON."""
    try:
        import xllamacpp  # noqa: F401
    except ImportError:
        raise UsageError("--ttft needs llama.cpp's Python wheel (pip install xllamacpp)") from None
    from hpcmac.llm.model.config import is_gguf, resolve_model

    path = resolve_model(model or "smollm2")
    if not is_gguf(path):
        raise UsageError(f"--ttft --model {model}: expected a GGUF file (llama.cpp reads GGUF)")
    text = prompt_text(words)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "OPAL_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", HPCMAC_QUIET_TRANSPORT="1")
    load0 = os.getloadavg()
    rows: dict[str, list[dict]] = {"hpcmac": [], "llama.cpp": []}
    with tempfile.TemporaryDirectory(prefix="hpcmac-ttft-") as tmp:
        prompt_file, js = Path(tmp, "prompt.txt"), Path(tmp, "gen.json")
        prompt_file.write_text(text)
        ours = [sys.executable, "-m", "hpcmac.llm", "generate", "--model", str(path),
                "--prompt", text, "--ignore-chat-template", "--max-tokens", "1",
                "--threads", "1", "--json", str(js)]
        theirs = [sys.executable, "-c", _LLAMACPP, str(path), str(prompt_file),
                  str(max(512, 2 * words))]
        print(f"# time to first token, fresh process, 1 thread: {path.name}, {words}-word "
              f"prompt, {rounds} rounds, {os.cpu_count()} cores, load average "
              f"{load0[0]:.1f} at start", flush=True)
        for r in range(rounds):
            order = ("hpcmac", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "hpcmac")
            for who in order:
                if who == "hpcmac":
                    first, total, out = timed(ours, env, timeout)
                    doc = json.loads(js.read_text())
                    rec = dict(first_s=first, exit_s=total, text=out,
                               prompt_tokens=len(doc["prompt_tokens"]), prefill_s=doc["ttft_s"])
                else:
                    first, total, out = timed(theirs, env, timeout)
                    token, _, tail = out.partition("\n@@")
                    t = json.loads(tail)
                    rec = dict(first_s=first, exit_s=total, text=token,
                               prompt_tokens=t["prompt_n"], prefill_s=t["prompt_ms"] / 1e3)
                rows[who].append(rec)
                print(f"  {who:<9} first token {rec['first_s']:6.3f} s  exit {rec['exit_s']:6.3f} s"
                      f"  prefill {rec['prefill_s']:6.3f} s  prompt {rec['prompt_tokens']} "
                      f"tokens  {rec['text'].strip()[:20]!r}", flush=True)
    med = {who: {k: statistics.median(x[k] for x in recs)
                 for k in ("first_s", "exit_s", "prefill_s")} for who, recs in rows.items()}
    ratio = med["hpcmac"]["first_s"] / med["llama.cpp"]["first_s"]
    per_round = [a["first_s"] / b["first_s"] for a, b in zip(rows["hpcmac"], rows["llama.cpp"])]
    load1 = os.getloadavg()
    print()
    print(f"{'':<10} {'first token s':>13} {'exit s':>7} {'prefill s':>9}")
    for who in rows:
        m = med[who]
        print(f"{who:<10} {m['first_s']:13.3f} {m['exit_s']:7.3f} {m['prefill_s']:9.3f}")
    print(f"ratio hpcmac / llama.cpp, time to first token: {ratio:.2f} (medians; per round "
          f"{min(per_round):.2f}-{max(per_round):.2f}); load average {load1[0]:.1f} at the end "
          "(shared machine)")
    same = {rows["hpcmac"][0]["prompt_tokens"], rows["llama.cpp"][0]["prompt_tokens"]}
    if len(same) > 1:
        print(f"note: the prompt is {sorted(same)} tokens on the two sides")
    if json_path:
        from hpcmac.io.outputs import write_atomic

        write_atomic(json_path, json.dumps(dict(
            model=str(path), words=words, rounds=rows, median=med, ratio=ratio,
            per_round=per_round, load_start=load0, load_end=load1, cores=os.cpu_count()),
            indent=1), what="--json")
    return 0
