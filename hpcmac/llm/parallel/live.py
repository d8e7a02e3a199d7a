"""Requests that arrive while the pipeline runs: the one boundary between a server and MPI.

The HTTP side (its own thread, :mod:`hpcmac.llm.server`) calls :meth:`submit`,
:meth:`cancel` and :meth:`close`; rank 0's pipeline scheduler, on the main
thread, calls :meth:`take`, :meth:`cancelled`, :meth:`token`, :meth:`stop_check`
and :meth:`finish` between decode steps. Everything crosses through one lock
and one condition variable; the callbacks a request brings (``on_token``,
``on_finish``) run on the scheduler's thread and must only hand off (e.g.
``loop.call_soon_threadsafe``). Nothing here knows HTTP or MPI.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hpcmac.llm.parallel.pipeline import Request


class Full(Exception):
    """The queue is at capacity (the server answers 429)."""


@dataclass
class LiveRequest(Request):
    """A request with its server-side key, its stop strings and where its tokens go."""

    key: int = -1
    stops: tuple[str, ...] = ()
    on_token: Callable[[int], None] | None = field(default=None, repr=False)
    on_finish: Callable[[str, int], None] | None = field(default=None, repr=False)
    #: logprobs asked: called before on_token with float64 (chosen logprob, k top
    #: logprobs, their k ids)
    on_logprob: Callable[[object], None] | None = field(default=None, repr=False)
    decoder: object = field(default=None, repr=False)  # incremental text, for stops
    text: str = ""
    error: str | None = None  # why it ended, when it ended with "error"
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (set at admission)
    slot: int = -1  # its cache slot once the scheduler admitted it (-1: waiting)
    generated: int = 0  # tokens handed back so far
    t_submit: float = 0.0  # time.monotonic() when it was submitted


class LiveRequests:
    """A bounded, thread-safe queue of :class:`LiveRequest` (see the module docstring).

    capacity : requests admitted at once, running or waiting (more: :class:`Full`).
    ping_s : how long an idle scheduler waits for a request before it pings the stages.
    """

    def __init__(self, capacity: int, ping_s: float = 1.0):
        self.capacity, self.ping_s = capacity, ping_s
        self._lock = threading.Condition()
        self._new: deque[LiveRequest] = deque()
        self._cancel: set[int] = set()
        self._live: dict[int, LiveRequest] = {}
        self._next = 0
        self.closed = False
        self.error: str | None = None
        #: the scheduler's :class:`~hpcmac.llm.parallel.prefix.PrefixIndex` (None: no
        #: prefix cache); read its ``stats()`` or counters from any thread (metrics)
        self.prefix = None

    # -- the HTTP side ------------------------------------------------------------------
    def submit(self, req: LiveRequest) -> int:
        """Queue ``req``; returns its key. Raises :class:`Full` at capacity, RuntimeError
        once closed."""
        with self._lock:
            if self.closed:
                raise RuntimeError(self.error or "the server is shutting down")
            if len(self._live) >= self.capacity:
                raise Full
            req.key = self._next
            req.t_submit = time.monotonic()
            self._next += 1
            self._live[req.key] = req
            self._new.append(req)
            self._lock.notify_all()
            return req.key

    def cancel(self, key: int) -> None:
        """The client went away: free its slot at the next step."""
        with self._lock:
            if key in self._live:
                self._cancel.add(key)
                self._lock.notify_all()

    def close(self, error: str | None = None) -> None:
        with self._lock:
            self.closed = True
            self.error = self.error or error
            self._lock.notify_all()

    @property
    def load(self) -> int:
        """Requests running or waiting."""
        with self._lock:
            return len(self._live)

    def counts(self) -> tuple[int, int, int]:
        """(waiting for a slot, running, tokens they hold in the KV cache)."""
        with self._lock:
            running = [len(r.prompt) + r.generated for r in self._live.values() if r.slot >= 0]
            return len(self._live) - len(running), len(running), sum(running)

    def snapshot(self) -> list[dict]:
        """Each open request: its key, slot, prompt tokens, tokens reused from the prefix
        cache, tokens generated, state (``waiting`` for a slot, ``prefill`` until its
        first token, then ``decode``) and age in seconds. Read under the lock the
        scheduler writes them under, so a request is never seen half-admitted (a slot
        without its cached tokens) or between its count and its state."""
        now = time.monotonic()
        with self._lock:
            rows = [(r.key, r.slot, len(r.prompt), r.cached_tokens, r.generated, r.max_tokens,
                     r.t_submit) for r in self._live.values()]
        rows.sort()
        return [{"id": k, "slot": slot, "prompt_tokens": n, "cached_tokens": cached,
                 "generated": gen, "max_tokens": most,
                 "state": "waiting" if slot < 0 else "prefill" if not gen else "decode",
                 "age_s": round(now - t, 3)} for k, slot, n, cached, gen, most, t in rows]

    # -- the scheduler side (rank 0's main thread) ---------------------------------------
    def take(self, wait: float = 0.0) -> list[LiveRequest]:
        """New requests; waits up to ``wait`` s when there are none (and nothing to cancel)."""
        with self._lock:
            if wait > 0 and not self._new and not self._cancel and not self.closed:
                self._lock.wait(wait)
            out = list(self._new)
            self._new.clear()
            return out

    def cancelled(self) -> set[int]:
        with self._lock:
            out, self._cancel = self._cancel, set()
            return out

    def admitted(self, key: int, slot: int, cached: int = 0) -> None:
        """The scheduler gave request ``key`` cache slot ``slot``, its first ``cached``
        prompt tokens reused from the prefix cache (one update: a snapshot sees both)."""
        with self._lock:
            req = self._live.get(key)
            if req is not None:
                req.slot, req.cached_tokens = slot, cached

    def token(self, key: int, tok: int) -> None:
        with self._lock:
            req = self._live.get(key)
            if req is not None:
                req.generated += 1
        if req is not None and req.on_token is not None:
            req.on_token(tok)  # raising ends this request alone (the scheduler catches)

    def logprob(self, key: int, row) -> None:
        req = self._live.get(key)
        if req is not None and req.on_logprob is not None:
            req.on_logprob(row)

    def stop_check(self, key: int, generated: list[int]) -> bool:
        """Whether a stop string has appeared in the text so far (incremental decoding)."""
        req = self._live.get(key)
        if req is None or not req.stops or req.decoder is None:
            return False
        req.text += req.decoder.push(generated[-1])
        return any(s in req.text for s in req.stops)

    def finish(self, key: int, reason: str, n_generated: int = 0,
               error: str | None = None) -> None:
        """Request ``key`` ended (``reason``: eos, stop, length, cancelled, error, with
        ``error`` saying why)."""
        with self._lock:
            req = self._live.pop(key, None)
            self._cancel.discard(key)
        if req is None:
            return
        if error is not None:
            req.error = error
        if req.on_finish is not None:
            try:
                req.on_finish(reason, n_generated)
            except RuntimeError:  # its event loop is gone (the server is stopping)
                pass

    def fail_all(self, message: str) -> None:
        """The pipeline ended: every open request finishes with ``error``."""
        self.close(message)
        with self._lock:
            live, self._live = list(self._live.values()), {}
            self._new.clear()
        for req in live:
            if req.on_finish is not None:
                try:
                    req.on_finish("error", 0)
                except RuntimeError:  # its event loop is gone
                    pass
