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
Ratios: serve at 16 clients over generate --batch, and p95 ITL at 16
clients over p95 ITL at 1 client.
"""

from __future__ import annotations

import json
import os
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
    import httpx

    port = _port()
    proc = subprocess.Popen([*_mpirun(np_), sys.executable, "-m", "hpcmac.llm", "serve",
                             "--model", model, "--port", str(port), "--max-batch", str(slots),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, process_group=0,  # same session: same CPU share
                            env=dict(os.environ, HPCMAC_QUIET_TRANSPORT="1"))
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise UsageError(f"serve exited {proc.returncode}: {proc.stderr.read()[-300:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise UsageError("serve did not come up in 600 s")


def stop_server(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def load(url: str, clients: int, requests: list[tuple[str, int]]) -> dict:
    """Send ``requests`` from ``clients`` concurrent streaming clients; client-side timings."""
    import httpx

    todo = list(enumerate(requests))
    lock = threading.Lock()
    ttft, itl, tokens = [], [], [0]

    def client():
        with httpx.Client(timeout=600) as c:
            while True:
                with lock:
                    if not todo:
                        return
                    _, (prompt, n) = todo.pop(0)
                t0 = time.perf_counter()
                last = None
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n,
                        "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ch = json.loads(line[6:])
                        now = time.perf_counter()
                        if ch.get("usage"):
                            with lock:
                                tokens[0] += ch["usage"]["completion_tokens"]
                        if ch["choices"] and ch["choices"][0].get("delta", {}).get("content"):
                            with lock:
                                if last is None:
                                    ttft.append(now - t0)
                                else:
                                    itl.append(now - last)
                            last = now

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": len(requests), "tokens": tokens[0], "wall_s": wall,
            "tok_s": tokens[0] / wall, "ttft_p50": _pct(ttft, 0.5), "ttft_p95": _pct(ttft, 0.95),
            "itl_p50": _pct(itl, 0.5), "itl_p95": _pct(itl, 0.95)}


def generate_batch(np_: int, model: str, requests: list[tuple[str, int]], slots: int) -> dict:
    """``generate --batch`` on the same prompts: tokens over its wall time (from its JSON)."""
    with tempfile.TemporaryDirectory() as d:
        batch = Path(d) / "p.jsonl"
        batch.write_text("".join(json.dumps({"prompt": p, "max_tokens": n}) + "\n"
                                 for p, n in requests))
        out = Path(d) / "r.json"
        r = subprocess.run([*_mpirun(np_), sys.executable, "-m", "hpcmac.llm", "generate",
                            "--model", model, "--batch", str(batch), "--temperature", "0",
                            "--max-batch", str(slots), "--quiet", "--json", str(out)],
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
                    help="serve's --prefill-chunk (default: serve's own, 64)")
    ap.add_argument("--json", type=checked_output("--json"), default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if min(args.ranks) < 1 or min(args.clients) < 1 or args.requests < 1 or args.max_tokens < 1:
        raise UsageError("--ranks, --clients, --requests and --max-tokens must be >= 1")
    reqs = [(PROMPTS[i % len(PROMPTS)], args.max_tokens) for i in range(args.requests)]
    slots = max(args.clients)
    rows = []
    for np_ in args.ranks:
        ref = generate_batch(np_, args.model, reqs, slots)
        extra = ["--prefill-chunk", str(args.prefill_chunk)] if args.prefill_chunk else []
        proc, url = start_server(np_, args.model, slots, extra)
        try:
            load(url, 1, reqs[:2])  # warm-up (compiled kernels, caches)
            for c in args.clients:
                m = load(url, c, reqs)
                m.update(ranks=np_, generate_batch_tok_s=ref["tok_s"],
                         prefill_chunk=args.prefill_chunk or 64)
                rows.append(m)
        finally:
            stop_server(proc)
    print(f"hpcmac.bench.serve: {args.model}, {args.requests} chat requests of "
          f"{args.max_tokens} tokens per client count, greedy; client-side timings")
    print(f"{'ranks':>5} {'clients':>7} {'tok/s':>8} {'vs gen --batch':>14} {'TTFT p50':>9} "
          f"{'p95':>7} {'ITL p50':>8} {'p95':>7} {'p95/1 client':>12}")
    for r in rows:
        one = next(x for x in rows if x["ranks"] == r["ranks"] and x["clients"] == min(
            args.clients))
        r["vs_generate_batch"] = r["tok_s"] / r["generate_batch_tok_s"]
        r["itl_p95_vs_one"] = r["itl_p95"] / one["itl_p95"]
        print(f"{r['ranks']:>5} {r['clients']:>7} {r['tok_s']:>8.1f} "
              f"{r['vs_generate_batch']:>14.2f} {r['ttft_p50'] * 1e3:>7.0f}ms "
              f"{r['ttft_p95'] * 1e3:>5.0f}ms {r['itl_p50'] * 1e3:>6.1f}ms "
              f"{r['itl_p95'] * 1e3:>5.1f}ms {r['itl_p95_vs_one']:>12.2f}")
    if args.json:
        from hpcmac.io.outputs import write_atomic

        write_atomic(args.json, json.dumps(rows, indent=1), what="--json")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
