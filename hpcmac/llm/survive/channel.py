"""The local channel between the survive front and rank 0: framed plain messages.

One TCP connection on the loopback. A frame is a 4-byte little-endian length
and that many bytes of :mod:`hpcmac.comm.wire` (plain tagged data, never
pickle), holding one dict with an ``op``. The first frame rank 0 sends is
``hello`` carrying the token the front handed the job in its environment
(:data:`TOKEN_ENV`): a connection without it is dropped.

front -> rank 0: ``submit`` (key, prompt ids, max_tokens, sampling fields, eos ids,
stops, ``prior``: how many of the prompt's last ids are tokens already
generated), ``cancel`` (key), ``stop``.
rank 0 -> front: ``hello`` (token, placement line, ranks, load seconds, weight
bytes), ``tok`` (key, token id), ``lp`` (key, the token's logprob row, before its
``tok``, when asked), ``end`` (key, reason, error),
``beat`` (every :data:`BEAT_S`: rank 0's scheduler is alive).
"""

from __future__ import annotations

import socket
import struct
import threading

from hpcmac.comm import wire

TOKEN_ENV = "HPCMAC_SURVIVE_TOKEN"
CHANNEL_ENV = "HPCMAC_SURVIVE_CHANNEL"
BEAT_S = 0.5
#: the line rank 0 prints under --channel when it starts loading the weights (the
#: front's /health then says "reloading")
LOADING = "serve: loading the weights"
MAX_FRAME = 64 * 2**20  # a prompt of a few million ids at most


class Closed(Exception):
    """The other end went away (or sent something that is not a frame)."""


class Conn:
    """One end of the channel: :meth:`send` from any thread, :meth:`recv` from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._wlock = threading.Lock()
        self.closed = False

    def send(self, msg: dict) -> None:
        data = wire.encode(msg)
        with self._wlock:
            if self.closed:
                raise Closed("channel closed")
            try:
                self.sock.sendall(struct.pack("<I", len(data)) + data)
            except OSError as exc:
                self.closed = True
                raise Closed(str(exc)) from None

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                piece = self.sock.recv(n - len(out))
            except OSError as exc:
                raise Closed(str(exc)) from None
            if not piece:
                raise Closed("the other end closed the channel")
            out += piece
        return bytes(out)

    def recv(self) -> dict:
        (n,) = struct.unpack("<I", self._exact(4))
        if n > MAX_FRAME:
            raise Closed(f"a frame of {n} bytes (at most {MAX_FRAME})")
        try:
            msg = wire.decode(self._exact(n))
        except ValueError as exc:
            raise Closed(f"malformed frame: {exc}") from None
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            raise Closed("a frame that is not a message")
        return msg

    def close(self) -> None:
        with self._wlock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(address: str, timeout: float = 10.0) -> Conn:
    """Rank 0's end: connect to ``HOST:PORT``."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    return Conn(sock)
