"""``python -m hpcmac.llm serve``: an OpenAI-compatible HTTP endpoint on rank 0.

The boundary (docs/serve.md): rank 0 runs two threads. The **main thread** is
the pipeline's scheduler (:func:`hpcmac.llm.parallel.pipeline.run_pipeline`
with a :class:`~hpcmac.llm.parallel.live.LiveRequests` source), exactly as
``generate`` runs it, with every other rank running its stage; it never
touches HTTP. The **server thread** runs uvicorn + Starlette (asyncio): it
validates requests, renders the chat template, tokenizes, submits to the
source, and streams the tokens the scheduler hands back through
``loop.call_soon_threadsafe``. The two share only the source's lock.

Requests join and leave the running batch between decode steps (the
pipeline admits waiting sequences into free cache slots as others finish);
long prompts are prefilled in chunks so running streams keep flowing; a
client that disconnects is cancelled and its slot freed at the next step. At
capacity (``--max-batch`` running + ``--queue`` waiting) a request gets 429
with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass

from hpcmac.llm.model.sampling import SamplingParams
from hpcmac.llm.parallel.live import Full, LiveRequest, LiveRequests

#: fields we honour, per endpoint; others OpenAI defines but we do not implement are
#: refused by name (400) rather than silently ignored
_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "n", "stream", "stream_options", "user", "logprobs",
           "repetition_penalty"}
FIELDS = {"chat": _COMMON | {"messages"}, "completion": _COMMON | {"prompt"}}
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class ServeConfig:
    """What the HTTP side needs (rank 0)."""

    model_id: str
    tok: object  # hpcmac.llm.model.tokenizer.Tokenizer
    vocab: int
    context: int
    eos_ids: tuple[int, ...]
    default_max_tokens: int = 256
    retry_after_s: int = 1


# -- request parsing ----------------------------------------------------------------------

def _number(body: dict, name: str, kind, default, lo=None, hi=None, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        ok = ok and float(v) == int(v)
    if ok and v != v:  # NaN
        ok = False
    if ok and lo is not None and (v <= lo if lo_open else v < lo):
        ok = False
    if ok and hi is not None and v > hi:
        ok = False
    if not ok:
        rng = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
        rng += f"{' and ' if rng else ''}<= {hi}" if hi is not None else ""
        raise ApiError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}"
                            f"{' ' + rng if rng else ''}; got {json.dumps(v)[:40]}", name)
    return kind(v)


def parse(body, endpoint: str, cfg: ServeConfig) -> tuple[list[int], int, SamplingParams,
                                                          tuple[str, ...], bool]:
    """(prompt ids, max_tokens, sampling, stop strings, stream) of a request body, or
    ApiError(400/404) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[endpoint])
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    if body.get("model") not in (None, cfg.model_id):
        raise ApiError(404, f"the model '{body.get('model')}' does not exist; this server "
                            f"serves '{cfg.model_id}'", "model", code="model_not_found")
    n = _number(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported", "logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _number(body, name, int, cfg.default_max_tokens, lo=0, lo_open=True)
    sampling = SamplingParams(
        temperature=_number(body, "temperature", float, 1.0, lo=0, hi=2),
        top_k=_number(body, "top_k", int, 0, lo=0),
        top_p=_number(body, "top_p", float, 1.0, lo=0, hi=1, lo_open=True),
        repetition_penalty=_number(body, "repetition_penalty", float, 1.0, lo=0, lo_open=True),
        seed=_number(body, "seed", int, None))
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", "stop")
    stops = tuple(s for s in stops if s)
    ids = _prompt_ids(body, endpoint, cfg)
    if len(ids) >= cfg.context:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server's context holds "
                            f"{cfg.context}", "messages" if endpoint == "chat" else "prompt",
                       code="context_length_exceeded")
    return ids, min(max_tokens, cfg.context - len(ids)), sampling, stops, stream


def _prompt_ids(body: dict, endpoint: str, cfg: ServeConfig) -> list[int]:
    tok = cfg.tok
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role'",
                               "messages")
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                if not all(isinstance(p, dict) and p.get("type") == "text"
                           and isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are "
                                        "supported", "messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string", "messages")
            clean.append({"role": m["role"], "content": content})
        if tok is None:
            raise ApiError(400, "this checkpoint has no tokenizer: use /v1/completions with "
                                "a prompt of token ids", "messages")
        return chat_ids(tok, clean)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tok is None:
            raise ApiError(400, "this checkpoint has no tokenizer: give the prompt as a list "
                                "of token ids", "prompt")
        ids = tok.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < cfg.vocab]
        if bad:
            raise ApiError(400, f"token {bad[0]} is outside the vocabulary [0, {cfg.vocab})",
                           "prompt")
        ids = list(prompt)
    else:
        raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids",
                       "prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    return ids


def chat_ids(tok, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` through the checkpoint's chat template, as transformers'
    ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``: a template
    that writes ``bos_token`` itself is encoded without another BOS."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    writes_bos = bool(tok.bos_token) and "bos_token" in (tok.chat_template or "")
    return tok.encode(text, add_bos=False) if writes_bos else tok.encode(text)


# -- one request's stream ------------------------------------------------------------------

class _Stream:
    """Tokens of one request, handed from the scheduler thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tok, stops: tuple[str, ...],
                 eos: tuple[int, ...]):
        self.loop, self.tok, self.stops, self.eos = loop, tok, stops, set(eos)
        self.q: asyncio.Queue = asyncio.Queue()
        self.decoder = tok.stream() if tok is not None else None
        self.text = ""  # everything decoded so far (without EOS)
        self.sent = 0  # characters already handed to the client
        self.ids: list[int] = []
        self.hold = max((len(s) for s in stops), default=1) - 1

    # scheduler thread
    def on_token(self, tok: int) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ("tok", tok))

    def on_finish(self, reason: str, n: int) -> None:
        self.loop.call_soon_threadsafe(self.q.put_nowait, ("end", reason))

    # event loop
    def add(self, tok: int) -> None:
        if tok in self.eos:
            return
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
        text = self.visible(final)
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out


# -- the app -------------------------------------------------------------------------------

def build_app(cfg: ServeConfig, source: LiveRequests, alive: threading.Event):
    """The Starlette application (server thread)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def err(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def health(_: Request):
        if alive.is_set() and not source.closed:
            return JSONResponse({"status": "ok", "model": cfg.model_id, "load": source.load})
        return JSONResponse({"status": "error", "error": source.error or "not running"},
                            status_code=503)

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model_id, "object": "model", "created": 0, "owned_by": "hpcmac"}]})

    async def endpoint(request: Request, kind: str):
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the body is not valid JSON ({exc})") from None
            ids, max_tokens, sampling, stops, stream = parse(body, kind, cfg)
            loop = asyncio.get_running_loop()
            st = _Stream(loop, cfg.tok, stops, cfg.eos_ids)
            req = LiveRequest(prompt=ids, max_tokens=max_tokens, sampling=sampling,
                              eos_ids=cfg.eos_ids, stops=stops, on_token=st.on_token,
                              on_finish=st.on_finish,
                              decoder=cfg.tok.stream() if stops and cfg.tok else None)
            try:
                key = source.submit(req)
            except Full:
                raise ApiError(429, "the server is at capacity; retry later",
                               kind="rate_limit_error",
                               headers={"Retry-After": str(cfg.retry_after_s)}) from None
            except RuntimeError as exc:
                raise ApiError(503, str(exc), kind="server_error") from None
        except ApiError as e:
            return err(e)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(st.ids),  # noqa: E731
                         "total_tokens": len(ids) + len(st.ids)}

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if kind == "chat":
                delta = {"role": "assistant", "content": text or ""} if first else \
                    ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None,
                          "finish_reason": finish}
                obj = "text_completion"
            return {"id": rid, "object": obj, "created": created, "model": cfg.model_id,
                    "choices": [choice]}

        async def events():
            """(kind, value) until the end; cancels the request if the client leaves."""
            done = False
            try:
                while True:
                    what, value = await st.q.get()
                    if what == "tok":
                        st.add(value)
                        yield "tok", None
                    else:
                        done = True
                        yield "end", value
                        return
            finally:
                if not done:
                    source.cancel(key)

        if stream:
            include_usage = isinstance(body.get("stream_options"), dict) and \
                bool(body["stream_options"].get("include_usage"))

            async def sse():
                yield f"data: {json.dumps(chunk('', None, first=True))}\n\n"
                async for what, reason in events():
                    if what == "tok":
                        piece = st.delta(final=False)
                        if piece:
                            yield f"data: {json.dumps(chunk(piece, None))}\n\n"
                        continue
                    if reason in ("error", "cancelled"):
                        e = ApiError(500, source.error or "generation failed",
                                     kind="server_error")
                        yield f"data: {json.dumps(e.body())}\n\n"
                        return
                    piece = st.delta(final=True)
                    last = chunk(piece, _finish(reason, st))
                    if include_usage:
                        last["usage"] = usage()
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        reason = "cancelled"
        async for what, value in events():
            if what == "end":
                reason = value
        if reason in ("error", "cancelled"):
            return err(ApiError(500, source.error or "generation failed", kind="server_error"))
        text = st.visible(final=True)
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": _finish(reason, st)}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": _finish(reason, st)}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created,
                             "model": cfg.model_id, "choices": [choice], "usage": usage()})

    async def chat(request: Request):
        return await endpoint(request, "chat")

    async def completions(request: Request):
        return await endpoint(request, "completion")

    async def not_found(request: Request, exc):
        return err(ApiError(404, f"no route {request.method} {request.url.path}"))

    async def bad_method(request: Request, exc):
        return err(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    return Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], exception_handlers={404: not_found, 405: bad_method})


def _finish(reason: str, st: _Stream) -> str:
    if st.stops and any(s in st.text for s in st.stops):
        return "stop"
    return FINISH.get(reason, "stop")


# -- the server thread ----------------------------------------------------------------------

class HttpThread:
    """uvicorn on an already-bound socket, in a daemon thread (rank 0)."""

    def __init__(self, app, sock, log_level: str = "warning"):
        import uvicorn

        self.sock = sock
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=False,
                                                    lifespan="off", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self._run, name="hpcmac-http", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


def bind(host: str, port: int):
    """A listening socket on (host, port), or UsageError naming the address in use."""
    import socket

    from hpcmac.errors import UsageError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: cannot resolve ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise UsageError(f"--port {port}: cannot listen on {host}:{port} "
                         f"({exc.strerror}; is another server running there?)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


# -- the command ---------------------------------------------------------------------------

def add_serve_args(s) -> None:
    """``serve``'s own flags (the model and layout flags are generate's)."""
    g = s.add_argument_group("server (rank 0)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--queue", type=int, default=64,
                   help="requests waiting beyond --max-batch running ones before 429 (default 64)")
    g.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the checkpoint's file or folder name)")


def run_serve(args, group=None) -> int:
    """Collective: load the model like ``generate``, then serve until interrupted (rank 0
    listens; every rank runs its stage)."""
    import os
    import sys
    from importlib.util import find_spec
    from pathlib import Path

    from hpcmac import comm
    from hpcmac.comm.local import LocalGroup
    from hpcmac.errors import UsageError, world_size
    from hpcmac.llm.cli import check_arguments, context_length
    from hpcmac.llm.model.config import load_config, resolve_model
    from hpcmac.llm.model.gguf_loader import forget_readers
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.tokenizer import load_tokenizer
    from hpcmac.llm.parallel.pipeline import run_pipeline
    from hpcmac.llm.parallel.plan import agree, plan_stages

    missing = [m for m in ("starlette", "uvicorn") if find_spec(m) is None]
    if missing:
        raise UsageError(f"serve needs the serve extra ({', '.join(missing)} not installed): "
                         "pip install 'hpcmac[serve]'")
    if args.prompt is not None or args.prompt_ids is not None or args.batch is not None:
        raise UsageError("serve takes its prompts over HTTP (--prompt, --prompt-ids and "
                         "--batch are for generate)")
    check_arguments(args)
    if (getattr(args, "tp", None) or 1) > 1 or getattr(args, "tp_split", None):
        raise UsageError("serve runs pipeline layouts (--split, one stage per rank); tensor "
                         "parallelism (--tp, --tp-split) is generate's only, for now")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: expected 1..65535")
    if args.queue < 0:
        raise UsageError(f"--queue {args.queue}: expected >= 0")
    if group is None:
        group = comm.init(args.transport) if world_size() > 1 or args.transport \
            else LocalGroup()
    cfg = agree(group, lambda: load_config(args.model))
    context = agree(group, lambda: context_length(args, cfg))
    slots = args.max_batch or 16
    held = {}

    def listen_first():  # the port is checked before the model loads; it opens after
        held["sock"] = bind(args.host, args.port)

    agree(group, listen_first, ranks="root")
    def tokenizer_first():  # rank 0 only; collective so a failure ends every rank
        held["tok"] = load_tokenizer(args.model)

    agree(group, tokenizer_first, ranks="root")
    tok = held.get("tok")
    hostfile = args.hostfile or os.environ.get("HPCMAC_HOSTFILE") or None
    plan = plan_stages(group, args.model, cfg, args.split, hostfile, slots * context,
                       args.quantize, args.q_group_size)
    spec = plan.stages[group.rank]
    stage = agree(group, lambda: load_stage(args.model, spec.start, spec.end, first=spec.first,
                                            last=spec.last, backend=args.backend,
                                            quantize=args.quantize,
                                            group_size=args.q_group_size,
                                            int8_activations=args.int8_activations))
    forget_readers()  # tokenizer, plan and stage are read: drop the parsed GGUF metadata
    source, http, alive = None, None, threading.Event()
    if group.rank == 0:
        eos = tuple(tok.eos_ids if tok is not None and tok.eos_ids else cfg.eos_token_ids)
        name = args.model_name or Path(str(resolve_model(args.model))).name
        scfg = ServeConfig(name, tok, cfg.vocab, context, eos,
                           default_max_tokens=min(args.max_tokens, context))
        source = LiveRequests(capacity=slots + args.queue)
        http = HttpThread(build_app(scfg, source, alive), held["sock"])
        http.start()
        alive.set()
        layout = f"pipeline {group.size}" if group.size > 1 else "1 rank"
        print(f"serving {name} on http://{args.host}:{args.port}/v1 ({layout}, "
              f"{slots} sequences at once, context {context})", file=sys.stderr, flush=True)
    try:
        res = run_pipeline(group, stage, spec, cfg.hidden, None, source=source,
                           micro_batches=args.micro_batches or None, max_batch=slots,
                           prefill_chunk=args.prefill_chunk or 64, max_len=context,
                           on_token=source.token if source else None,
                           stop_check=source.stop_check if source else None,
                           timeout=args.timeout, hosts=plan.hosts)
    finally:
        if group.rank == 0:
            alive.clear()
            source.fail_all("the server stopped")
            http.stop()
    return 130 if res.interrupted else 0
