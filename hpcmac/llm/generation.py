"""One request's generation as the HTTP side sees it, shared by every API shape.

Each endpoint (OpenAI chat and completions in :mod:`hpcmac.llm.server`, Anthropic
Messages in :mod:`hpcmac.llm.api_anthropic`, OpenAI Responses in
:mod:`hpcmac.llm.api_responses`) reads its own body into prompt ids, sampling
and stop strings, then goes through one :class:`Gateway`: the body read under
the size cap, the parse off the event loop, the submit to the
:class:`~hpcmac.llm.parallel.live.LiveRequests` source (429 at capacity), and a
:class:`Run` whose tokens arrive from the scheduler thread through
``loop.call_soon_threadsafe``. Only the shape of what goes back differs.
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from hpcmac.llm.parallel.live import Full, LiveRequest, LiveRequests
from hpcmac.llm.request import ApiError, ServeConfig

#: the scheduler's finish reasons, as OpenAI names them
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def listed(body: dict, name: str) -> list | None:
    """``body[name]``: None when absent, else a list (ApiError(400) naming it otherwise)."""
    value = body.get(name)
    if value is not None and not isinstance(value, list):
        raise ApiError(400, f"'{name}' must be a list", name)
    return value


class Run:
    """The tokens of one submitted request, handed from the scheduler thread to the event
    loop; the text the client may see (cut at stop strings, held back while a stop string
    could still be forming)."""

    def __init__(self, gw: Gateway, loop: asyncio.AbstractEventLoop, prompt: list[int],
                 stops: tuple[str, ...]):
        cfg = gw.cfg
        self.gw, self.loop, self.tok, self.stops = gw, loop, cfg.tok, stops
        self.eos = set(cfg.eos_ids)
        self.prompt = prompt
        self.q: asyncio.Queue = asyncio.Queue()
        self.decoder = cfg.tok.stream() if cfg.tok is not None else None
        self.text = ""  # everything decoded so far (without EOS)
        self.sent = 0  # characters already handed to the client
        self.ids: list[int] = []
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.key = -1
        self.req: LiveRequest | None = None
        self.reason: str | None = None  # the scheduler's finish reason, once ended
        self.t_submit = time.monotonic()
        self.t_last: float | None = None  # when the last token reached the event loop
        self.lps: list = []  # (token, logprob row) of each kept token, when asked
        self.lp_sent = 0  # of them, already streamed
        self._lp = None  # the row of the token on its way

    # scheduler thread
    def on_token(self, tok: int) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ("tok", tok))

    def on_finish(self, reason: str, n: int) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ("end", reason))

    def on_logprob(self, row) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ("lp", row))

    # event loop
    def _add(self, tok: int) -> None:
        now = time.monotonic()
        self.gw.metrics.token(now - (self.t_last if self.t_last is not None
                                     else self.t_submit), first=self.t_last is None)
        self.t_last = now
        row, self._lp = self._lp, None
        if tok in self.eos:
            return
        if row is not None:
            self.lps.append((tok, row))
        self.ids.append(tok)
        if self.decoder is not None:
            self.text += self.decoder.push(tok)

    def visible(self, final: bool) -> str:
        """Text the client may see now: cut at a stop string; while running, hold back
        what could still become the start of one."""
        text = self.text
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
        elif not final and self.hold:
            text = text[:max(self.sent, len(text) - self.hold)]
        return text

    def delta(self, final: bool) -> str:
        """The visible text not yet handed out (and mark it handed out)."""
        text = self.visible(final)
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out

    @property
    def failed(self) -> bool:
        return self.reason in ("error", "cancelled")

    @property
    def stopped_by_string(self) -> bool:
        return bool(self.stops) and any(s in self.text for s in self.stops)

    def finish_reason(self) -> str:
        """OpenAI's ``finish_reason`` (``stop`` or ``length``)."""
        return "stop" if self.stopped_by_string else FINISH.get(self.reason or "", "stop")

    def error(self) -> ApiError:
        """Why a failed run failed (a 500: the client's request was valid)."""
        msg = (self.req.error if self.req else None) or self.gw.source.error
        return ApiError(500, msg or "generation failed", kind="server_error")

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.ids),
                "total_tokens": len(self.prompt) + len(self.ids),
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens reused from the prefix cache."""
        return self.req.cached_tokens if self.req is not None else 0

    def new_lps(self) -> list:
        """Streaming: the (token, logprob row) pairs since the last call."""
        items = self.lps[self.lp_sent:]
        self.lp_sent = len(self.lps)
        return items

    async def events(self):
        """``"tok"`` as each token arrives (text through :meth:`delta`), then ``"end"``
        (:attr:`reason` set); cancels the request if the consumer stops early (the client
        left)."""
        done = False
        try:
            while True:
                what, value = await self.q.get()
                if what == "lp":  # the row of the token that follows
                    self._lp = value
                    continue
                if what == "tok":
                    self._add(value)
                    yield "tok"
                else:
                    done = True
                    self.reason = value
                    self.gw.metrics.finished(self)
                    yield "end"
                    return
        finally:
            if not done:
                self.gw.source.cancel(self.key)
                self.gw.metrics.finished(self, cancelled=True)

    async def whole(self, request) -> None:
        """Wait for the end (non-streaming); a client that leaves before it is cancelled."""
        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(1.0)
            self.gw.source.cancel(self.key)

        watcher = asyncio.create_task(watch())
        try:
            async for _ in self.events():
                pass
        finally:
            watcher.cancel()


class _NoMetrics:
    def token(self, dt: float, first: bool) -> None:
        pass

    def finished(self, run: Run, cancelled: bool = False) -> None:
        pass


class Gateway:
    """What every endpoint shares (server thread): the body cap, the parse pool, the
    source, the metrics."""

    def __init__(self, cfg: ServeConfig, source: LiveRequests, metrics=None):
        self.cfg, self.source = cfg, source
        self.metrics = metrics if metrics is not None else _NoMetrics()
        # JSON parsing, checks and tokenizing run here, off the event loop (a large body
        # never stalls the streams); two at once, the rest wait their turn
        self.parser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hpcmac-parse")

    def too_big(self) -> ApiError:
        return ApiError(413, f"the body is over this server's {self.cfg.max_body} bytes "
                             "(--max-body-mb)", headers={"Connection": "close"})

    async def read_body(self, request) -> bytes | None:
        """The body, at most ``cfg.max_body`` bytes (413 as soon as it is known to be
        more: from Content-Length, or counting a chunked body), None if the client left."""
        from starlette.requests import ClientDisconnect

        length = request.headers.get("content-length", "")
        if length.isascii() and length.isdigit() and int(length) > self.cfg.max_body:
            raise self.too_big()
        chunks, n = [], 0
        try:
            async for piece in request.stream():
                n += len(piece)
                if n > self.cfg.max_body:
                    raise self.too_big()
                chunks.append(piece)
        except ClientDisconnect:  # a client going away is normal: nothing to log
            return None
        return b"".join(chunks)

    async def parse(self, fn, *args):
        """``fn(*args)`` in the parse pool; ApiError passes, anything else is a defect of
        ours: one line on stderr and a 500, never a traceback."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.parser, fn, *args)
        except ApiError:
            raise
        except Exception as exc:
            print(f"serve: request failed: {type(exc).__name__}: {exc}"[:300],
                  file=sys.stderr, flush=True)
            raise ApiError(500, "internal error while reading the request",
                           kind="server_error") from None

    def start(self, ids: list[int], max_tokens: int, sampling, stops: tuple[str, ...],
              draft_k: int = 0) -> Run:
        """Submit one request (event loop); 429 at capacity, 503 once stopped.
        ``draft_k``: speculative tokens drafted per step (0: none)."""
        run = Run(self, asyncio.get_running_loop(), ids, stops)
        cfg = self.cfg
        run.req = LiveRequest(prompt=ids, max_tokens=max_tokens, sampling=sampling,
                              eos_ids=cfg.eos_ids, draft_k=draft_k, stops=stops,
                              on_token=run.on_token, on_finish=run.on_finish,
                              on_logprob=run.on_logprob if sampling.logprobs >= 0 else None,
                              decoder=cfg.tok.stream() if stops and cfg.tok else None)
        try:
            run.key = self.source.submit(run.req)
        except Full:
            raise ApiError(429, "the server is at capacity; retry later",
                           kind="rate_limit_error",
                           headers={"Retry-After": str(cfg.retry_after_s)}) from None
        except RuntimeError as exc:
            raise ApiError(503, str(exc), kind="server_error") from None
        return run
