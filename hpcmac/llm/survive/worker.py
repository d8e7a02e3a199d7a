"""Rank 0's end of the survive channel: the front's requests into the scheduler's source.

Under ``serve --survive`` the front launches the job with ``--channel HOST:PORT``;
rank 0 then opens no HTTP port. :class:`ChannelFront` connects back, says
``hello``, and turns each ``submit`` into a
:class:`~hpcmac.llm.parallel.live.LiveRequest` on the same
:class:`~hpcmac.llm.parallel.live.LiveRequests` the HTTP thread would feed;
the tokens and the end of each request go back as frames. It has the
``start``/``stop`` of :class:`hpcmac.llm.server.HttpThread`, which it replaces.
When the channel closes (the front ended), every request is cancelled and the
source closed: the pipeline stops and the job ends.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

from hpcmac.llm.model.sampling import SamplingParams
from hpcmac.llm.parallel.live import Full, LiveRequest, LiveRequests
from hpcmac.llm.survive.channel import BEAT_S, TOKEN_ENV, Closed, Conn, connect


class ChannelFront:
    """Rank 0: the requests the front sends, fed into ``source`` (see the module doc)."""

    def __init__(self, address: str, source: LiveRequests, tok, hello: dict):
        self.address, self.source, self.tok, self.hello = address, source, tok, hello
        self.conn: Conn | None = None
        self.keys: dict[int, int] = {}  # the front's key -> the source's key
        self.lock = threading.Lock()
        self.done = threading.Event()

    def start(self) -> None:
        self.conn = connect(self.address)
        self.conn.send({"op": "hello", "token": os.environ.get(TOKEN_ENV, ""), **self.hello})
        threading.Thread(target=self._read, name="hpcmac-channel", daemon=True).start()
        threading.Thread(target=self._beat, name="hpcmac-beat", daemon=True).start()

    def stop(self) -> None:
        self.done.set()
        if self.conn is not None:
            self.conn.close()

    # -- frames from the front ------------------------------------------------------------
    def _read(self) -> None:
        why = "the survive front closed the channel"
        try:
            while True:
                msg = self.conn.recv()
                if msg["op"] == "submit":
                    self._submit(msg)
                elif msg["op"] == "cancel":
                    with self.lock:
                        key = self.keys.get(int(msg["key"]))
                    if key is not None:
                        self.source.cancel(key)
                elif msg["op"] == "stop":
                    why = "stopped by the survive front"
                    break
        except (Closed, KeyError, TypeError, ValueError) as exc:
            if not self.done.is_set() and not isinstance(exc, Closed):
                why = f"bad message from the survive front: {exc}"
        if not self.done.is_set():
            print(f"serve: {why}: stopping", file=sys.stderr, flush=True)
        with self.lock:
            keys = list(self.keys.values())
        for key in keys:
            self.source.cancel(key)
        self.source.close(why)

    def _submit(self, msg: dict) -> None:
        fkey, prompt, prior = int(msg["key"]), [int(t) for t in msg["prompt"]], int(msg["prior"])
        stops = tuple(str(s) for s in msg["stops"])
        decoder, text = None, ""
        if stops and self.tok is not None:  # the stop check sees the text streamed before
            decoder = self.tok.stream()
            for t in prompt[len(prompt) - prior:]:
                text += decoder.push(t)
        conn = self.conn

        def on_token(tok: int) -> None:
            try:
                conn.send({"op": "tok", "key": fkey, "tok": int(tok)})
            except Closed:  # the front is gone: _read cancels everything
                pass

        def on_finish(reason: str, n: int) -> None:
            with self.lock:
                self.keys.pop(fkey, None)
            if reason == "error" and self.source.closed:
                return  # the job is ending (fail_all): the front resumes the request
            try:
                conn.send({"op": "end", "key": fkey, "reason": reason, "error": req.error})
            except Closed:
                pass

        def on_logprob(row) -> None:
            try:
                conn.send({"op": "lp", "key": fkey, "row": np.asarray(row)})
            except Closed:
                pass

        sampling = SamplingParams(**msg["sampling"])
        req = LiveRequest(prompt=prompt, max_tokens=int(msg["max_tokens"]), sampling=sampling,
                          on_logprob=on_logprob if sampling.logprobs >= 0 else None,
                          eos_ids=tuple(int(t) for t in msg["eos"]), stops=stops,
                          on_token=on_token, on_finish=on_finish, decoder=decoder, text=text)
        try:
            key = self.source.submit(req)
        except (Full, RuntimeError) as exc:
            conn.send({"op": "end", "key": fkey, "reason": "error",
                       "error": str(exc) or "the job is at capacity"})
            return
        with self.lock:
            self.keys[fkey] = key

    def _beat(self) -> None:
        while not self.done.wait(BEAT_S):
            try:
                self.conn.send({"op": "beat", "load": self.source.load})
            except Closed:
                return
