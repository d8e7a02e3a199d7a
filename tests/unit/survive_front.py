"""A ``serve --survive`` front under test, its streaming clients and its ranks (shared by
tests/unit/test_survive.py and tests/cluster/test_survive_mesh.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
from test_llm_serve import _free_port, _rank_pids

PROMPTS = ["Tell me a story about France.", "Why is the sky blue?",
           "Name three rivers of Europe.", "What do cats eat?",
           "Describe a train journey.", "How do bees make honey?",
           "Write about the sea.", "What is a prime number?"]


class Front:
    """The front process; ``wrap`` puts it on a mesh host (``Mesh.argv``)."""

    def __init__(self, hostfile: str, *flags: str, wrap=None, env=None, wait: float = 240):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tag = f"HPCMAC_TEST_SURVIVE={self.port}"
        argv = [sys.executable, "-m", "hpcmac.llm", "serve", "--survive", "--hostfile",
                hostfile, "--model", "smollm2", "--port", str(self.port), *flags]
        env = dict(env or os.environ, HPCMAC_QUIET_TRANSPORT="1",
                   HPCMAC_TEST_SURVIVE=str(self.port))
        self.proc = subprocess.Popen(wrap(argv) if wrap else argv, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr),
                                       daemon=True)
        self.reader.start()
        self.wait_status("ok", wait)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def log(self) -> str:
        return "".join(list(self.lines))

    def health(self) -> tuple[int, dict]:
        r = httpx.get(self.url + "/health", timeout=5)
        return r.status_code, r.json()

    def wait_status(self, status: str, wait: float) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < wait:
            if self.proc.poll() is not None:
                self.reader.join(5)
                raise AssertionError(f"front exited {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                code, body = self.health()
                if body.get("status") == status:
                    return body
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"/health never said {status!r}: {self.log()[-3000:]}")

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=300)

    def stream(self, prompt: str, max_tokens: int, on_piece=None, **kw) -> str:
        """One streaming chat completion's text (greedy unless ``kw`` says otherwise)."""
        text, n = "", 0
        for ch in self.client().chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, stream=True, **{"temperature": 0, **kw}):
            if ch.choices and ch.choices[0].delta.content:
                text += ch.choices[0].delta.content
                n += 1
                if on_piece is not None:
                    on_piece(n)
        return text

    def streams(self, prompts, max_tokens: int, on_piece=None) -> list:
        """The prompts streamed at once, one client thread each: texts (or exceptions)."""
        out: list = [None] * len(prompts)

        def one(k):
            try:
                out[k] = self.stream(prompts[k], max_tokens,
                                     on_piece if k == 0 else None)
            except Exception as exc:  # reported by the test
                out[k] = exc

        threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(400)
        return out

    def stop(self, limit: float = 5.0) -> float:
        """SIGTERM the front; seconds until it and every rank it started were gone."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(limit + 10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        while rank_pids(self.tag) and time.monotonic() - t0 < limit + 10:
            time.sleep(0.1)
        took = time.monotonic() - t0
        for pid in rank_pids(self.tag).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return took


def rank_pids(tag: str) -> dict[int, int]:
    """rank -> pid of the job's ranks whose environment holds ``tag``."""
    return _rank_pids(tag.encode())
