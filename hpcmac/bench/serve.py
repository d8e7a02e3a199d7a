"""``python -m hpcmac.bench.serve``: a live ``serve`` under load, next to ``generate --batch``.

For each rank count it starts ``python -m hpcmac.llm serve`` under mpirun,
then, for 1, 4 and 16 concurrent streaming clients, sends a fixed set of
chat requests (each client sends its share one after another) and measures
from the client side: aggregate completion tok/s (tokens over the wall time
of the whole set), time to first token (p50/p95) and inter-token latency
(p50/p95, the gaps between streamed chunks). The reference, measured in the
same run: ``generate --batch`` on the same prompts and ``max_tokens`` at the
same rank count, aggregate tok/s over its own wall time from the first
prompt to the last token (its JSON's ``wall_s``; loading excluded).
Both run one BLAS thread a rank (``--threads 1``) and ``--serve-args``' layout
flags. With llama.cpp's Python wheel (``xllamacpp``) and a GGUF model,
llama-server (its ``Server``: HTTP, ``n_parallel`` = the largest client count,
as many threads as ranks, the same GGUF) gets the same requests from the same
clients right after serve at each client count (``--rounds N``: N rounds of
every client count, the two servers in turn first; medians, and the ratios' medians
per round). Ratios: serve over generate --batch, p95 ITL over p95 ITL at 1 client,
and tok/s and TTFT p50 over llama-server's. Requests that fail are counted per
server and cause (``failed``); llama-server's HTTP library closes kept-alive
connections under the next request, unanswered, and those are sent again once on a
new connection (``retried``), as ``openai``'s client does (see :func:`load`).

``--chat``: the prefix cache instead. One client holds a 6-turn chat (a long
system prompt, six questions, each answer of the cache-on server fed back) with
two servers at once, one BLAS thread a rank, the prefix cache on and off
(``--prefix-cache-gb 0``), and, with llama.cpp's Python wheel (``xllamacpp``),
its ``Server`` (``cache_prompt`` on, one slot, as many threads as ranks, the same
GGUF), each turn's same messages sent to the three one after another; per turn
the time to the first streamed token and ``cached_tokens``. Ratios: cache on over
off, and hpcmac over llama.cpp.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hpcmac.errors import ArgumentParser, UsageError
from hpcmac.io.outputs import checked_output
from hpcmac.lifecycle import run_cli

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["Write a short poem about the sea.", "List five prime numbers.",
           "Explain what a CPU cache is.", "Give three tips for learning Python.",
           "What is the capital of Japan?", "Describe a sunset in two sentences.",
           "Name four planets and one fact each.", "Why is the sky blue?"]


def _mpirun(np_: int) -> list[str]:
    return [str(ROOT / "tools" / "mpirun"), str(np_)] if (ROOT / "tools" / "mpirun").exists() \
        else ["hpcmac-mpirun", str(np_)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start_server(np_: int, model: str, slots: int, extra: list[str]):
    port = _port()
    proc = subprocess.Popen([*_mpirun(np_), sys.executable, "-m", "hpcmac.llm", "serve",
                             "--model", model, "--port", str(port), "--max-batch", str(slots),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, process_group=0,  # same session: same CPU share
                            env=dict(os.environ, HPCMAC_QUIET_TRANSPORT="1"))
    return _wait_up(proc, f"http://127.0.0.1:{port}", "serve")


def _wait_up(proc, url: str, what: str):
    """``(proc, url)`` once ``url``'s ``/health`` answers 200; one line if it never does."""
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            tail = proc.stderr.read()[-300:] if proc.stderr else ""
            raise UsageError(f"{what} exited {proc.returncode}: {tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise UsageError(f"{what} did not come up in 600 s")


#: llama-server (llama.cpp's HTTP server, from the ``xllamacpp`` wheel) for the load runs:
#: argv model, port, slots (n_parallel), threads; serves until killed
_LLAMACPP_SERVE = r"""
import signal, sys
import xllamacpp as xlc
p = xlc.CommonParams()
p.model.path, p.port, p.hostnames = sys.argv[1], int(sys.argv[2]), ["127.0.0.1"]
p.n_parallel = int(sys.argv[3])
p.n_ctx = 2048 * p.n_parallel
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[4])
stop = {signal.SIGINT, signal.SIGTERM}
signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # the server's threads inherit the mask
server = xlc.Server(p)
signal.sigwait(stop)
"""


def start_llama_server(model: str, slots: int, threads: int):
    """llama-server on ``model`` (a GGUF) with ``slots`` parallel sequences and ``threads``
    threads, as ``(proc, url)``; None without ``xllamacpp`` or for a model that is no GGUF."""
    from importlib.util import find_spec

    from hpcmac.llm.model.config import is_gguf, resolve_model

    path = resolve_model(model)
    if find_spec("xllamacpp") is None or not is_gguf(path):
        return None
    port = _port()
    proc = subprocess.Popen([sys.executable, "-c", _LLAMACPP_SERVE, str(path), str(port),
                             str(slots), str(threads)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, process_group=0)  # it logs a lot
    return _wait_up(proc, f"http://127.0.0.1:{port}", "llama-server")


def stop_server(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def load(url: str, clients: int, requests: list[tuple[str, int]],
         extra: dict | None = None) -> dict:
    """Send ``requests`` from ``clients`` concurrent streaming clients; client-side timings.
    ``extra``: more fields for every request's body (e.g. a ``response_format``).

    Each client keeps one connection (keep-alive) for its requests, as ``openai``'s
    client does. A request that fails is counted under ``failed`` by what failed (the
    exception's class, ``HTTP <status>``, or ``incomplete``: a stream that ended without
    its usage chunk) and its tokens are not counted. Only ``RemoteProtocolError`` before
    any byte of the answer (the server closed an idle kept-alive connection as the
    request went out: nothing was generated) is sent again, once, on a new connection,
    and counted under ``retried``, as ``openai``'s client retries it."""
    import httpx

    todo = list(enumerate(requests))
    lock = threading.Lock()
    ttft, itl, tokens = [], [], [0]
    failed: dict[str, int] = {}
    retried = [0]
    retry_s: list[float] = []  # how long each retried attempt took to fail

    def one(c, body: dict, t0: float) -> str | None:
        """One streamed request on ``c``: None when it completed, else why not."""
        last, got = None, False
        with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                return f"HTTP {r.status_code}"
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                now = time.perf_counter()
                if ch.get("usage"):
                    got = True
                    with lock:
                        tokens[0] += ch["usage"]["completion_tokens"]
                if ch["choices"] and ch["choices"][0].get("delta", {}).get("content"):
                    with lock:
                        if last is None:
                            ttft.append(now - t0)
                        else:
                            itl.append(now - last)
                    last = now
        return None if got else "incomplete"

    def client():
        c = httpx.Client(timeout=600)
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    _, (prompt, n) = todo.pop(0)
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}, **(extra or {})}
                t0 = time.perf_counter()
                try:
                    try:
                        why = one(c, body, t0)
                    except httpx.RemoteProtocolError as e:
                        if "without sending a response" not in str(e):
                            raise
                        with lock:
                            retried[0] += 1
                            retry_s.append(time.perf_counter() - t0)
                        c.close()
                        c = httpx.Client(timeout=600)
                        why = one(c, body, t0)
                except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                    why = type(e).__name__
                    c.close()
                    c = httpx.Client(timeout=600)
                if why is not None:
                    with lock:
                        failed[why] = failed.get(why, 0) + 1
        finally:
            c.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(requests), "tokens": tokens[0], "wall_s": wall,
            "tok_s": tokens[0] / wall, "ttft_p50": _pct(ttft, 0.5), "ttft_p95": _pct(ttft, 0.95),
            "itl_p50": _pct(itl, 0.5), "itl_p95": _pct(itl, 0.95), "failed": failed,
            "retried": retried[0], "retry_s": retry_s}


#: the chat of ``--chat``: a system prompt of ~300 tokens, then six questions
CHAT_SYSTEM = (
    "You are a patient assistant for a small team that runs a cluster of four Mac Studio "
    "computers. The team uses the cluster for two things: serving language models to the "
    "people in the office through an OpenAI-compatible endpoint, and running numerical "
    "codes (dense linear algebra, sparse solvers, finite elements) written in Python on top "
    "of MPI. The machines are connected by Thunderbolt cables in a full mesh, and each pair "
    "of machines has its own small subnet. Two machines have 512 GB of memory and two have "
    "256 GB. When you answer, be short and concrete: name the command or the setting, say "
    "why in one sentence, and mention what could go wrong. If a question is about memory, "
    "remember that each machine has a different amount, and that a model must fit in the "
    "memory of the machines that hold it, with room left for the cache of keys and values. "
    "If a question is about speed, remember that a single stream of tokens gets faster only "
    "with tensor parallelism, while many streams at once also gain from a pipeline. Never "
    "invent numbers; if you do not know, say so and suggest how to measure it.")
CHAT_QUESTIONS = ["How do I start the server on all four machines?",
                  "Which layout should I use for one user?", "And for twenty users?",
                  "How much memory does the cache need?", "What if one machine fails?",
                  "Summarise your advice in one sentence."]

#: the llama.cpp side of --chat: one Server; a turn's messages per stdin line, its TTFT
#: (the first streamed content) per stdout line
_LLAMACPP_CHAT = r"""
import json, sys, time
import xllamacpp as xlc
p = xlc.CommonParams()
p.model.path = sys.argv[1]
p.n_ctx = 4096
p.n_parallel = 1
p.cpuparams.n_threads = p.cpuparams_batch.n_threads = int(sys.argv[2])
server = xlc.Server(p)
print("@@ready", flush=True)
for line in sys.stdin:
    msgs, n = json.loads(line)
    t0, first = time.perf_counter(), []
    def chunk(ch):
        ch = ch if isinstance(ch, dict) else json.loads(ch)
        for c in ch.get("choices") or ():
            if not first and (c.get("delta") or {}).get("content"):
                first.append(time.perf_counter() - t0)
    server.handle_chat_completions({"messages": msgs, "max_tokens": n, "temperature": 0,
                                    "stream": True, "cache_prompt": True}, chunk)
    print("@@" + json.dumps(first[0] if first else None), flush=True)
"""


def chat_turn(url: str, sent: list[dict], max_tokens: int) -> dict:
    """One streamed chat request: TTFT (to the first content), usage, the answer."""
    import httpx

    body = {"messages": sent, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, first, text, usage = time.perf_counter(), None, [], {}
    with httpx.Client(timeout=600) as c, \
            c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            usage = ch.get("usage") or usage
            piece = ch["choices"][0].get("delta", {}).get("content") \
                if ch.get("choices") else None
            if piece:
                first = first if first is not None else time.perf_counter() - t0
                text.append(piece)
    return {"ttft_s": first, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens"),
            "answer": "".join(text)}


class _Llama:
    """llama.cpp's Server in a process of its own (None from :meth:`start` without
    ``xllamacpp`` or a GGUF model)."""

    @classmethod
    def start(cls, model: str, threads: int):
        from importlib.util import find_spec

        from hpcmac.llm.model.config import is_gguf, resolve_model

        path = resolve_model(model)
        if find_spec("xllamacpp") is None or not is_gguf(path):
            return None
        self = cls()
        self.proc = subprocess.Popen([sys.executable, "-c", _LLAMACPP_CHAT, str(path),
                                      str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        self._read()
        return self

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return line[2:].strip()
        raise UsageError(f"llama.cpp's server exited {self.proc.wait()}")

    def ttft(self, sent: list[dict], max_tokens: int) -> float | None:
        self.proc.stdin.write(json.dumps([sent, max_tokens]) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read())

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_chat(args) -> int:
    """``--chat``: the 6-turn chat with the prefix cache on, off, and llama.cpp, the three
    asked one after another at each turn (so that a busy machine's drift hits them alike)."""
    rows = []
    for np_ in args.ranks:
        # one BLAS thread a rank: llama.cpp gets as many threads as there are ranks
        servers = [start_server(np_, args.model, 1, ["--threads", "1", *extra])
                   for extra in ([], ["--prefix-cache-gb", "0"])]
        llama = _Llama.start(args.model, np_)
        try:
            for _, url in servers:  # warm-up
                chat_turn(url, [{"role": "user", "content": "Hi"}], 2)
            if llama is not None:
                llama.ttft([{"role": "user", "content": "Hi"}], 2)
            msgs = [{"role": "system", "content": CHAT_SYSTEM}]
            for k, q in enumerate(CHAT_QUESTIONS):
                sent = msgs + [{"role": "user", "content": q}]
                on, off = (chat_turn(url, sent, args.max_tokens) for _, url in servers)
                lt = llama.ttft(sent, args.max_tokens) if llama is not None else None
                rows.append({"ranks": np_, "turn": k + 1, "prompt_tokens": on["prompt_tokens"],
                             "cached_tokens": on["cached_tokens"], "ttft_on_s": on["ttft_s"],
                             "ttft_off_s": off["ttft_s"],
                             "same_answer": on["answer"] == off["answer"], "llama_ttft_s": lt})
                msgs = sent + [{"role": "assistant", "content": on["answer"]}]
        finally:
            for proc, _ in servers:
                stop_server(proc)
            if llama is not None:
                llama.stop()
    print(f"hpcmac.bench.serve --chat: {args.model}, a 6-turn chat, answers of "
          f"{args.max_tokens} tokens, greedy; TTFT client side; llama.cpp: cache_prompt on")
    print(f"{'ranks':>5} {'turn':>4} {'prompt':>6} {'cached':>6} {'TTFT on':>8} {'off':>8} "
          f"{'on/off':>6} {'llama.cpp':>9} {'on/llama':>8} {'same':>5}")
    for r in rows:
        r["on_over_off"] = r["ttft_on_s"] / r["ttft_off_s"]
        lt = r["llama_ttft_s"]
        r["on_over_llama"] = r["ttft_on_s"] / lt if lt else None
        print(f"{r['ranks']:>5} {r['turn']:>4} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} "
              f"{r['ttft_on_s'] * 1e3:>6.0f}ms {r['ttft_off_s'] * 1e3:>6.0f}ms "
              f"{r['on_over_off']:>6.2f} "
              + (f"{lt * 1e3:>7.0f}ms {r['on_over_llama']:>8.2f}" if lt else f"{'-':>9} {'-':>8}")
              + f" {'yes' if r['same_answer'] else 'NO':>5}")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(rows, indent=1), what="--json")
    return 0


def generate_batch(np_: int, model: str, requests: list[tuple[str, int]], slots: int,
                   layout: list[str]) -> dict:
    """``generate --batch`` on the same prompts, one BLAS thread a rank and ``layout``'s
    flags: tokens over its wall time (from its JSON)."""
    with tempfile.TemporaryDirectory() as d:
        batch = Path(d) / "p.jsonl"
        batch.write_text("".join(json.dumps({"prompt": p, "max_tokens": n}) + "\n"
                                 for p, n in requests))
        out = Path(d) / "r.json"
        r = subprocess.run([*_mpirun(np_), sys.executable, "-m", "hpcmac.llm", "generate",
                            "--model", model, "--batch", str(batch), "--temperature", "0",
                            "--max-batch", str(slots), "--threads", "1", *layout, "--quiet",
                            "--json", str(out)],
                           capture_output=True, text=True, timeout=1800,
                           env=dict(os.environ, HPCMAC_QUIET_TRANSPORT="1"))
        if r.returncode != 0:
            raise UsageError(f"generate --batch failed: {r.stderr.strip()[-300:]}")
        doc = json.loads(out.read_text())
    tokens = sum(len(s["tokens"]) for s in doc["sequences"])
    return {"tokens": tokens, "wall_s": doc["wall_s"], "tok_s": tokens / doc["wall_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m hpcmac.bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=32, help="requests per client count")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="serve's --prefill-chunk (default: serve's own)")
    ap.add_argument("--serve-args", default="", metavar="FLAGS",
                    help="layout flags for serve and generate --batch, e.g. '--tp 2'")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of every client count on both servers, in turn first; "
                         "medians reported (default 1)")
    ap.add_argument("--no-generate", action="store_true",
                    help="without the generate --batch reference")
    ap.add_argument("--no-llama", action="store_true",
                    help="without llama-server beside (default: with it when xllamacpp is "
                         "installed and the model is a GGUF)")
    ap.add_argument("--chat", action="store_true",
                    help="the prefix cache: a 6-turn chat's TTFT, cache on and off, and "
                         "llama.cpp's with cache_prompt (see the module docstring)")
    ap.add_argument("--json", type=checked_output("--json"), default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if min(args.ranks) < 1 or min(args.clients) < 1 or args.requests < 1 or args.max_tokens < 1 \
            or args.rounds < 1:
        raise UsageError("--ranks, --clients, --requests, --max-tokens and --rounds must be >= 1")
    if args.chat:
        return run_chat(args)
    reqs = [(PROMPTS[i % len(PROMPTS)], args.max_tokens) for i in range(args.requests)]
    slots = max(args.clients)
    layout = shlex.split(args.serve_args)
    rows = []
    load0 = os.getloadavg()
    for np_ in args.ranks:
        ref = None if args.no_generate else generate_batch(np_, args.model, reqs, slots, layout)
        extra = ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []
        proc, url = start_server(np_, args.model, slots, ["--threads", "1", *layout, *extra])
        llama = None if args.no_llama else start_llama_server(args.model, slots, np_)
        try:
            load(url, 1, reqs[:2])  # warm-up (compiled kernels, caches)
            if llama is not None:
                load(llama[1], 1, reqs[:2])
            runs: dict[int, list] = {c: [] for c in args.clients}
            for k in range(args.rounds):
                for c in args.clients:  # each client count on both, one after the other,
                    # in turn first (so that a load that drifts hits them alike)
                    pair = [("serve", url)] + ([("llama", llama[1])] if llama else [])
                    got = {}
                    for who, u in (pair if k % 2 == 0 else pair[::-1]):
                        got[who] = load(u, c, reqs)
                        got[who]["loadavg"] = os.getloadavg()[0]
                    runs[c].append(got)
            for c in args.clients:
                rows.append(_row(runs[c], np_, c, args, ref))
        finally:
            stop_server(proc)
            if llama is not None:
                stop_server(llama[0])
    load1 = os.getloadavg()
    print(f"hpcmac.bench.serve: {args.model}, {args.requests} chat requests of "
          f"{args.max_tokens} tokens per client count, greedy; client-side timings; one BLAS "
          "thread a rank; llama-server: as many threads as ranks, n_parallel "
          f"{slots}{', serve ' + args.serve_args if args.serve_args else ''}; medians of "
          f"{args.rounds} round(s), ratios per round; load average {load0[0]:.1f} at the "
          f"start, {load1[0]:.1f} at the end, {os.cpu_count()} cores")
    print(f"{'ranks':>5} {'clients':>7} {'tok/s':>8} {'vs gen --batch':>14} {'TTFT p50':>9} "
          f"{'p95':>7} {'ITL p50':>8} {'p95':>7} {'p95/1 client':>12} {'llama tok/s':>11} "
          f"{'vs llama':>8} {'llama TTFT':>10} {'TTFT vs llama':>13} {'failed':>6} "
          f"{'llama failed':>12}")
    for r in rows:
        one = next(x for x in rows if x["ranks"] == r["ranks"] and x["clients"] == min(
            args.clients))
        r["itl_p95_vs_one"] = r["itl_p95"] / one["itl_p95"]
        vs_gen = f"{r['vs_generate_batch']:>14.2f}" if r["vs_generate_batch"] else f"{'-':>14}"
        line = (f"{r['ranks']:>5} {r['clients']:>7} {r['tok_s']:>8.1f} {vs_gen} "
                f"{r['ttft_p50'] * 1e3:>7.0f}ms "
                f"{r['ttft_p95'] * 1e3:>5.0f}ms {r['itl_p50'] * 1e3:>6.1f}ms "
                f"{r['itl_p95'] * 1e3:>5.1f}ms {r['itl_p95_vs_one']:>12.2f}")
        if "llama" in r:
            lm = r["llama"]
            line += (f" {lm['tok_s']:>11.1f} {r['vs_llama_tok_s']:>8.2f} "
                     f"{lm['ttft_p50'] * 1e3:>8.0f}ms {r['ttft_p50_vs_llama']:>13.2f}")
        else:
            line += f" {'-':>11} {'-':>8} {'-':>10} {'-':>13}"
        line += f" {_fails(r):>6} {_fails(r['llama']) if 'llama' in r else '-':>12}"
        print(line)
    for r in rows:
        for who, m in (("serve", r), ("llama-server", r.get("llama"))):
            if m and (m["failed"] or m["retried"]):
                print(f"  {r['ranks']} ranks, {r['clients']} clients, {who}: failed "
                      f"{m['failed'] or 'none'}, retried (kept-alive connection closed) "
                      f"{m['retried']}")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(rows, indent=1), what="--json")
    return 0


_MEDIANS = ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95", "wall_s", "loadavg")


def _merge(ms: list[dict]) -> dict:
    """Rounds of one server at one client count: the medians, failures summed."""
    import statistics

    out = {k: statistics.median(m[k] for m in ms) for k in _MEDIANS}
    out["failed"] = {}
    for m in ms:
        for why, n in m["failed"].items():
            out["failed"][why] = out["failed"].get(why, 0) + n
    out.update(retried=sum(m["retried"] for m in ms), rounds=ms,
               requests=sum(m["requests"] for m in ms), tokens=sum(m["tokens"] for m in ms))
    return out


def _row(runs: list[dict], np_: int, clients: int, args, ref: dict | None) -> dict:
    """One table row: serve's medians, llama-server's under ``llama``, per-round ratios'
    medians."""
    import statistics

    row = _merge([g["serve"] for g in runs])
    row.update(clients=clients, ranks=np_, layout=args.serve_args,
               prefill_chunk=args.prefill_chunk or None,
               generate_batch_tok_s=ref["tok_s"] if ref else None,
               vs_generate_batch=row["tok_s"] / ref["tok_s"] if ref else None)
    if "llama" in runs[0]:
        row["llama"] = _merge([g["llama"] for g in runs])
        row["vs_llama_tok_s"] = statistics.median(
            g["serve"]["tok_s"] / g["llama"]["tok_s"] for g in runs)
        row["ttft_p50_vs_llama"] = statistics.median(
            g["serve"]["ttft_p50"] / g["llama"]["ttft_p50"] for g in runs)
    return row


def _fails(m: dict) -> str:
    return str(sum(m["failed"].values()))


if __name__ == "__main__":
    sys.exit(run_cli(main))
