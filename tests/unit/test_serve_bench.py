"""``hpcmac.bench.serve.load``'s client against a stub server that misbehaves as
llama-server's HTTP library did in the load table: it closes a kept-alive connection
once the next request is on it, without answering (``Server disconnected without
sending a response``), and as servers can: a 500, a stream cut before its usage."""

from __future__ import annotations

import json
import socket
import threading

from hpcmac.bench.serve import load


def _read_request(conn: socket.socket, buf: bytes) -> tuple[dict | None, bytes]:
    """One HTTP request's JSON body from ``conn`` (None at EOF), and what follows it."""
    while b"\r\n\r\n" not in buf:
        got = conn.recv(65536)
        if not got:
            return None, b""
        buf += got
    head, rest = buf.split(b"\r\n\r\n", 1)
    n = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
             if line.lower().startswith(b"content-length"))
    while len(rest) < n:
        rest += conn.recv(65536)
    return json.loads(rest[:n]), rest[n:]


def _answer(conn: socket.socket, body: dict) -> None:
    prompt = body["messages"][0]["content"]
    if prompt == "fail":
        msg = b'{"error": "no"}'
        conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(msg), msg))
        return
    n = body["max_tokens"]
    events = [{"choices": [{"delta": {"content": f"t{i}"}}]} for i in range(n)]
    if prompt != "cut":
        events.append({"choices": [], "usage": {"completion_tokens": n}})
    data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    if prompt != "cut":
        data += b"data: [DONE]\n\n"
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))


def _stub() -> tuple[str, dict, socket.socket]:
    """A server answering one request per connection and closing the connection when
    the next one arrives on it, unanswered; counts in the returned dict."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    seen = {"answered": 0, "dropped": 0}
    lock = threading.Lock()

    def serve(conn: socket.socket) -> None:
        with conn:
            body, rest = _read_request(conn, b"")
            if body is None:
                return
            with lock:  # counted before the answer leaves: the client may end on it
                seen["answered"] += 1
            _answer(conn, body)
            body, _ = _read_request(conn, rest)
            if body is not None:  # the next request came on the kept-alive connection
                with lock:
                    seen["dropped"] += 1

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", seen, srv


def test_load_survives_closed_keepalive_and_counts_failures():
    url, seen, srv = _stub()
    try:
        reqs = [("hello", 3)] * 6 + [("fail", 3), ("cut", 3)]
        m = load(url, 2, reqs)
    finally:
        srv.close()
    # every good request was answered and its tokens counted, though the server closed
    # each kept-alive connection under the next request: those were sent again
    assert m["tokens"] == 6 * 3
    assert m["retried"] == seen["dropped"] > 0
    assert m["failed"] == {"HTTP 500": 1, "incomplete": 1}
    assert seen["answered"] == 8
