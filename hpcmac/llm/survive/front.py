"""The front's request source: what :func:`hpcmac.llm.server.build_app` serves from
under ``--survive``.

It has the HTTP side of :class:`~hpcmac.llm.parallel.live.LiveRequests`
(``submit``, ``cancel``, ``closed``, ``error``, ``load``) plus ``health()``, so
the same app serves from it. It keeps every request the job has not finished:
its prompt, sampling parameters (with a seed: one is chosen when the client
gave none, so a resumed stream draws what it would have) and every token
streamed so far. While a job is attached (:meth:`attach`) requests go to it
over the channel; when it is lost (:meth:`detach`) they wait, and the next job
gets each one again as prompt + tokens so far, ``max_tokens`` less those, and
``draws`` advanced by them (:meth:`resume_message`). A client sees a pause.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import asdict, dataclass, field, replace

from hpcmac.llm.parallel.live import Full, LiveRequest
from hpcmac.llm.survive.channel import Closed, Conn


@dataclass
class Held:
    """One request the front keeps until it ends."""

    req: LiveRequest
    toks: list[int] = field(default_factory=list)  # generated so far (eos included)
    resumed: int = 0  # times it was resubmitted to a new job
    cancelled: bool = False  # the client left; the job has not said it ended yet


def resume_message(key: int, h: Held) -> dict:
    """The ``submit`` frame for ``h``: its prompt plus what it has streamed (pure)."""
    req, n = h.req, len(h.toks)
    sampling = replace(req.sampling, draws=req.sampling.draws + n)
    return {"op": "submit", "key": key, "prompt": [*req.prompt, *h.toks],
            "max_tokens": req.max_tokens - n, "sampling": asdict(sampling),
            "eos": list(req.eos_ids), "stops": list(req.stops), "prior": n}


def _ended(h: Held) -> str:
    """Why ``h`` is over without its job's ``end`` (cancelled, eos, length), or ''."""
    if h.cancelled:
        return "cancelled"
    if h.toks and h.toks[-1] in h.req.eos_ids:
        return "eos"
    return "length" if len(h.toks) >= h.req.max_tokens else ""


#: a recovery's phases, in order (/health's ``phase``): the job is ended and its last
#: lines read; the lost host is named, doctor checks the rest, the model is placed
#: on the hosts left; the job is launched; rank 0 loads the weights; every resumed
#: stream's prompt + tokens so far is prefilled again (until each has a token back)
PHASES = ("detecting", "replacing", "relaunching", "reloading", "re-prefilling")


class FrontSource:
    """Requests held by the front (thread-safe; see the module doc).

    capacity : requests held at once, running or waiting (more: :class:`Full`, a 429).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._held: dict[int, Held] = {}
        self._next = 0
        self._conn: Conn | None = None
        self.closed = False
        self.error: str | None = None
        self.refusal: str | None = None  # why no job can run (the model does not fit)
        self.state, self.reason = "starting", "the first job is starting"
        #: where a recovery is (PHASES), None when none runs
        self.phase: str | None = None
        self._prefill: set[int] = set()  # resumed requests with no token back yet
        self._then: tuple[str, str] | None = None  # the state once they all have one
        self.info: dict = {}  # the job's hello: placement line, ranks, load seconds
        self.recoveries: list[dict] = []  # one per recovery: what was lost, its seconds
        self.resumed = 0  # requests resubmitted to a new job, all recoveries together
        self._t_attach: float | None = None  # a recovery's first token is not back yet
        self._t_attach_all: float | None = None  # ... nor every resumed request's
        self.on_readmit = None  # the supervisor's: host -> (body, status)
        self.lost_hosts = None  # the supervisor's: () -> the hosts out now

    # -- the HTTP side (build_app) --------------------------------------------------------
    def submit(self, req: LiveRequest) -> int:
        with self._lock:
            if self.closed:
                raise RuntimeError(self.error or "the server is shutting down")
            if self.refusal:
                raise RuntimeError(self.refusal)
            if len(self._held) >= self.capacity:
                raise Full
            if req.max_tokens <= 0:
                req.key = -1
                req.on_finish("length", 0)
                return -1
            if req.sampling.seed is None:  # resumable: the same draws after a recovery
                req.sampling = replace(req.sampling, seed=random.getrandbits(63))
            key = req.key = self._next
            self._next += 1
            h = self._held[key] = Held(req)
            conn = self._conn
        if conn is not None:
            self._send(conn, resume_message(key, h))
        return key

    def cancel(self, key: int) -> None:
        with self._lock:
            conn = self._conn
            h = self._held.pop(key, None) if conn is None else self._held.get(key)
        if h is None:
            return
        if conn is None:
            self._end(h, "cancelled", None)
        else:
            h.cancelled = True  # not resumed if the job is lost before it answers
            self._send(conn, {"op": "cancel", "key": key})

    @property
    def load(self) -> int:
        with self._lock:
            return len(self._held)

    def health(self) -> tuple[dict, int]:
        """/health: ``ok``, ``degraded`` (with the reason) while recovering or after a
        host was lost, ``error`` (503) when nothing can serve."""
        with self._lock:
            rec = {"count": len(self.recoveries), "resumed_requests": self.resumed,
                   "seconds": [r["seconds"] for r in self.recoveries],
                   "each": [dict(r) for r in self.recoveries[-50:]],
                   "last": self.recoveries[-1] if self.recoveries else None}
            lost = self.lost_hosts() if self.lost_hosts is not None else []
            body = {"status": self.state, "load": len(self._held), "recoveries": rec,
                    **({"reason": self.reason} if self.reason else {}),
                    **({"phase": self.phase} if self.phase else {}),
                    **({"lost": lost} if lost else {}),
                    **({k: self.info[k] for k in ("placement", "hosts", "ranks")
                        if k in self.info})}
            if self.closed or self.refusal:
                body["status"] = "error"
                body["error"] = self.refusal or self.error or "not running"
                return body, 503
            return body, 200 if self.state in ("ok", "degraded") else 503

    def recovery_stats(self) -> dict:
        """/metrics (hpcmac.llm.metrics): recoveries, their seconds, what is lost."""
        with self._lock:
            secs = [r["seconds"] for r in self.recoveries]
            lost = {h for r in self.recoveries for h in r.get("lost", ())}
            return {"count": len(secs), "seconds": float(sum(secs)),
                    "resumed": self.resumed, "last_seconds": secs[-1] if secs else 0.0,
                    "hosts_lost": len(self.lost_hosts()) if self.lost_hosts is not None
                    else len(lost),
                    "degraded": int(self.state != "ok" or bool(self.refusal))}

    # -- the job side (the supervisor) ----------------------------------------------------
    def attach(self, conn: Conn, info: dict) -> int:
        """A job is up: every held request goes to it (resumed); how many."""
        with self._lock:
            self._conn, self.info = conn, info
            # ended before the job could say so: the client left, or the last token was
            # its EOS or its last allowed one
            gone = [(k, h, _ended(h)) for k, h in self._held.items() if _ended(h)]
            for k, _, _ in gone:
                del self._held[k]
            held = list(self._held.items())
        for _, h, reason in gone:
            self._end(h, reason, None)
        with self._lock:
            self._prefill = {key for key, h in held if h.toks}
            if self._prefill:
                self.phase = "re-prefilling"
        for key, h in held:
            if h.toks:
                h.resumed += 1
            self._send(conn, resume_message(key, h))
        with self._lock:
            n = sum(1 for _, h in held if h.toks)
            self.resumed += n
            return n

    def serving(self, state: str, reason: str) -> None:
        """The job attached is serving: ``state`` now, or once every resumed request has
        its first token back (until then /health says ``re-prefilling``)."""
        with self._lock:
            if self._prefill:
                self._then = (state, reason)
                self.reason = f"recovering: re-prefilling {len(self._prefill)} stream(s)"
                return
            self.state, self.reason, self.phase = state, reason, None

    def _prefilled(self, key: int) -> None:
        """``key`` has a token back (or ended): the re-prefill may be over (lock held)."""
        if key in self._prefill:
            self._prefill.discard(key)
            if not self._prefill:
                if self.recoveries and self._t_attach_all is not None:
                    self.recoveries[-1]["reprefill_s"] = round(
                        time.monotonic() - self._t_attach_all, 3)
                if self._then is not None:
                    (self.state, self.reason), self._then = self._then, None
                self.phase = None

    def detach(self) -> None:
        """The job is lost: requests wait for the next one."""
        with self._lock:
            self._conn = None
            self._prefill, self._then = set(), None

    def on_message(self, msg: dict) -> None:
        """A frame from the job (the supervisor's reader thread)."""
        op = msg["op"]
        if op == "tok":
            with self._lock:
                h = self._held.get(int(msg["key"]))
                self._prefilled(int(msg["key"]))
            if self._t_attach is not None:  # the first token after a recovery
                with self._lock:
                    if self._t_attach is not None and self.recoveries:
                        self.recoveries[-1]["first_token_s"] = round(
                            time.monotonic() - self._t_attach, 3)
                        self._t_attach = None
            if h is not None:
                h.toks.append(int(msg["tok"]))
                if h.req.on_token is not None:
                    h.req.on_token(int(msg["tok"]))
        elif op == "lp":  # a token's logprobs, just before the token
            with self._lock:
                h = self._held.get(int(msg["key"]))
            if h is not None and h.req.on_logprob is not None:
                h.req.on_logprob(msg["row"])
        elif op == "end":
            with self._lock:
                h = self._held.pop(int(msg["key"]), None)
                self._prefilled(int(msg["key"]))
            if h is not None:
                self._end(h, str(msg["reason"]), msg.get("error"))

    def readmit(self, host: str) -> tuple[dict, int]:
        """``POST /admin/hosts/HOST/readmit``: handed to the supervisor (``on_readmit``),
        which checks the host with doctor and re-places onto the larger set."""
        if self.on_readmit is None:
            return {"error": {"message": "no supervisor"}}, 503
        return self.on_readmit(host)

    def set_state(self, state: str, reason: str = "", phase: str | None = None) -> None:
        """The front's state, its reason and where a recovery is (``phase``, one of
        PHASES; None: no recovery runs)."""
        with self._lock:
            self.state, self.reason, self.phase = state, reason, phase
            self._then = None

    def set_phase(self, phase: str | None) -> None:
        with self._lock:
            self.phase = phase

    def refuse(self, why: str) -> None:
        """No job can run (the model does not fit the hosts left): every held request
        ends with ``why``, and new ones get 503 naming it."""
        with self._lock:
            self.refusal, self.state, self.reason, self.phase = why, "error", why, None
            held, self._held = list(self._held.values()), {}
        for h in held:
            self._end(h, "error", why)

    def unrefuse(self, reason: str, phase: str | None = None) -> None:
        """A lost host is back: requests are taken again, and wait for the next job."""
        with self._lock:
            self.refusal = None
            self.state, self.reason, self.phase = "degraded", reason, phase

    def fail_all(self, message: str) -> None:
        with self._lock:
            self.closed = True
            self.error = self.error or message
            held, self._held = list(self._held.values()), {}
        for h in held:
            self._end(h, "error", message)

    def record(self, recovery: dict, t_attach: float) -> None:
        """A recovery done (the new job attached at ``t_attach``, monotonic): its
        ``first_token_s`` (attach to the first token back: the re-prefill) comes later."""
        with self._lock:
            self.recoveries.append(recovery)
            self._t_attach = t_attach
            self._t_attach_all = t_attach if self._prefill else None

    # -- helpers --------------------------------------------------------------------------
    def _send(self, conn: Conn, msg: dict) -> None:
        try:
            conn.send(msg)
        except Closed:  # the job is going: the supervisor notices and resubmits
            pass

    @staticmethod
    def _end(h: Held, reason: str, error: str | None) -> None:
        if error is not None:
            h.req.error = error
        if h.req.on_finish is not None:
            try:
                h.req.on_finish(reason, len(h.toks))
            except RuntimeError:  # its event loop is gone
                pass
