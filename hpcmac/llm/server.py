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

import json
import os
import sys
import threading
import time
import uuid

from hpcmac.llm import logprobs, tools
from hpcmac.llm.generation import Gateway
from hpcmac.llm.ops import Ops
from hpcmac.llm.parallel.live import LiveRequests
from hpcmac.llm.request import (
    ApiError,
    ServeConfig,
    chat_ids,
    draft_k_of,
    load_body,
    parse,
    parse_request,
)

__all__ = ["ApiError", "ServeConfig", "build_app", "chat_ids", "parse", "run_serve"]


# -- the app -------------------------------------------------------------------------------

def build_app(cfg: ServeConfig, source: LiveRequests, alive: threading.Event,
              ops: Ops | None = None):
    """The Starlette application (server thread). ``source`` is rank 0's
    :class:`LiveRequests`, or anything with its HTTP side (``submit``, ``cancel``,
    ``closed``, ``error``, ``load``) and a ``health()``: the survive front's
    :class:`~hpcmac.llm.survive.front.FrontSource`. ``ops``: the key, CORS, the
    metrics, the cluster's placement (:mod:`hpcmac.llm.ops`)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from hpcmac.llm import api_anthropic, api_responses

    ops = ops or Ops()
    gw = Gateway(cfg, source, ops.new_metrics(cfg, source))

    def err(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def decode(raw: bytes, kind: str):
        body = load_body(raw)
        return body, parse_request(body, kind, cfg)

    async def health(_: Request):
        if hasattr(source, "health"):  # the survive front: ok, degraded (why), error
            body, code = source.health()
            return JSONResponse({**body, "model": cfg.model_id}, status_code=code)
        if alive.is_set() and not source.closed:
            return JSONResponse({"status": "ok", "model": cfg.model_id, "load": source.load})
        return JSONResponse({"status": "error", "error": source.error or "not running"},
                            status_code=503)

    async def models(_: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model_id, "object": "model", "created": 0, "owned_by": "hpcmac"}]})

    async def endpoint(request: Request, kind: str):
        try:
            raw = await gw.read_body(request)
            if raw is None:
                return Response(status_code=400)  # nobody reads it
            body, p = await gw.parse(decode, raw, kind)
            # chat whose answer has tool calls or reasoning to split off
            reader = p.reader() if kind == "chat" and (p.tools or p.reasoning) else None
            run = gw.start(p.ids, p.max_tokens, p.sampling, p.stops,
                           draft_k=draft_k_of(body, cfg))
        except ApiError as e:
            return err(e)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        want_lp = p.sampling.logprobs >= 0

        def lp_of(items) -> dict | None:
            if not want_lp:
                return None
            return logprobs.chat(cfg.tok, items) if kind == "chat" else \
                logprobs.completion(cfg.tok, items)

        def new_lps():  # streaming: the logprobs of the tokens since the last chunk
            items = run.new_lps()
            return lp_of(items) if items else None

        def chunk(text: str | None, finish: str | None, first: bool = False,
                  delta: dict | None = None) -> dict:
            if kind == "chat":
                if delta is None:
                    delta = {"role": "assistant", "content": text or ""} if first else \
                        ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": new_lps() if not first else None,
                          "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "logprobs": new_lps(),
                          "finish_reason": finish}
                obj = "text_completion"
            return {"id": rid, "object": obj, "created": created, "model": cfg.model_id,
                    "choices": [choice]}

        if p.stream:
            include_usage = isinstance(body.get("stream_options"), dict) and \
                bool(body["stream_options"].get("include_usage"))

            sp = tools.StreamParser(**reader) if reader else None

            def pieces(piece: str) -> list[dict]:  # a chat delta per piece of the answer
                if sp is None:
                    return [chunk(piece, None)] if piece else []
                return [chunk(None, None, delta=d) for d in sp.feed(piece)]

            async def sse():
                yield f"data: {json.dumps(chunk('', None, first=True))}\n\n"
                async for what in run.events():
                    if what == "tok":
                        for c in pieces(run.delta(final=False)):
                            yield f"data: {json.dumps(c)}\n\n"
                        continue
                    if run.failed:
                        yield f"data: {json.dumps(run.error().body())}\n\n"
                        return
                    piece, finish = run.delta(final=True), run.finish_reason()
                    if sp is not None:
                        for c in pieces(piece):
                            yield f"data: {json.dumps(c)}\n\n"
                        rest, called = sp.close()
                        for d in rest:
                            yield f"data: {json.dumps(chunk(None, None, delta=d))}\n\n"
                        piece, finish = "", "tool_calls" if called else finish
                    last = chunk(piece, finish)
                    if include_usage:
                        last["usage"] = run.usage()
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await run.whole(request)
        if run.failed:
            return err(run.error())
        text = run.visible(final=True)
        if kind == "chat":
            message, finish = {"role": "assistant", "content": text}, run.finish_reason()
            if reader:
                answer = tools.parse(text, **reader)
                message = answer.message()
                finish = "tool_calls" if answer.tool_calls else finish
            choice = {"index": 0, "message": message, "logprobs": lp_of(run.lps),
                      "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp_of(run.lps),
                      "finish_reason": run.finish_reason()}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created,
                             "model": cfg.model_id, "choices": [choice],
                             "usage": run.usage()})

    async def chat(request: Request):
        return await endpoint(request, "chat")

    async def completions(request: Request):
        return await endpoint(request, "completion")

    async def not_found(request: Request, exc):
        return err(ApiError(404, f"no route {request.method} {request.url.path}"))

    async def bad_method(request: Request, exc):
        return err(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    async def readmit(request: Request):  # the survive front: a lost host back in
        import ipaddress

        client = request.client.host if request.client else ""
        try:
            local = ipaddress.ip_address(client).is_loopback
        except ValueError:
            local = False
        if not local and not ops.api_key:  # with a key, the key (checked by the guard)
            return err(ApiError(403, "/admin answers this machine's clients only (or any "
                                "client with the key, under --api-key)"))
        body, code = source.readmit(request.path_params["host"])
        return JSONResponse(body, status_code=code)

    admin = [Route("/admin/hosts/{host}/readmit", readmit, methods=["POST"])] \
        if hasattr(source, "readmit") else []
    return Starlette(routes=[*admin,
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        *api_anthropic.routes(gw), *api_responses.routes(gw), *ops.routes(gw),
    ], exception_handlers={404: not_found, 405: bad_method}, middleware=ops.middleware())


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
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on a connection whose socket says
    # so (its proto, inherited from this one at accept). With proto 0, Nagle held each
    # stream's first chunk behind the unacknowledged headers until the client's delayed
    # ACK (~40 ms): every TTFT carried it
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def is_loopback(sock) -> bool:
    """Whether ``sock`` listens on a loopback address only (127.0.0.0/8, ::1)."""
    import ipaddress

    try:
        return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback
    except ValueError:
        return False


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
    g.add_argument("--max-body-mb", type=float, default=8.0,
                   help="largest request body in MiB; larger ones get 413 (default 8)")
    g.add_argument("--special-tokens-in-prompts", action="store_true",
                   help="read special-token strings (<|im_start|>) in /v1/completions prompts "
                        "as control tokens (default: as text; chat messages are always text)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="require this key (Authorization: Bearer KEY, or x-api-key: KEY) on "
                        "every route but /health and the page (default: $HPCMAC_API_KEY; "
                        "none: open)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the checkpoint's own "
                        "(as transformers renders it; default: the checkpoint's)")
    g.add_argument("--cors", default=None, metavar="ORIGINS",
                   help="comma-separated origins browsers may call from (* for any; "
                        "default: none)")


def check_serve_args(args) -> None:
    """serve's own checks (the serve extra, its flags; then generate's), before anything
    loads: plain ``serve`` on every rank, ``--survive``'s front once."""
    from importlib.util import find_spec

    from hpcmac.errors import UsageError
    from hpcmac.llm.args import check_arguments

    missing = [m for m in ("starlette", "uvicorn", "prometheus_client")
               if find_spec(m) is None]
    if missing:
        raise UsageError(f"serve needs the serve extra ({', '.join(missing)} not installed): "
                         "pip install 'hpcmac[serve]'")
    if args.prompt is not None or args.prompt_ids is not None or args.batch is not None:
        raise UsageError("serve takes its prompts over HTTP (--prompt, --prompt-ids and "
                         "--batch are for generate)")
    check_arguments(args)
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: expected 1..65535")
    if args.queue < 0:
        raise UsageError(f"--queue {args.queue}: expected >= 0")
    if not 0 < args.max_body_mb <= 4096:
        raise UsageError(f"--max-body-mb {args.max_body_mb}: expected a size in MiB, "
                         "above 0 and at most 4096")
    api_key_of(args)
    cors_of(args)
    chat_template_of(args)


def chat_template_of(args) -> str | None:
    """``--chat-template``'s text (checked to compile), or None; UsageError naming the
    file otherwise."""
    from hpcmac.errors import UsageError

    path = getattr(args, "chat_template", None)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read((1 << 20) + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--chat-template {path}: cannot read it "
                         f"({getattr(exc, 'strerror', None) or exc})") from None
    if len(text) > 1 << 20 or not text.strip():
        raise UsageError(f"--chat-template {path}: expected a Jinja template of at most "
                         "1 MiB")
    import jinja2
    import jinja2.sandbox

    try:
        jinja2.sandbox.SandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UsageError(f"--chat-template {path}: line {exc.lineno}: {exc.message}") \
            from None
    return text


def api_key_of(args) -> str | None:
    """``--api-key``, else ``HPCMAC_API_KEY``, else None (open); UsageError for a bad one."""
    from hpcmac.errors import UsageError

    key = args.api_key if getattr(args, "api_key", None) is not None else \
        os.environ.get("HPCMAC_API_KEY") or None
    if key is not None and (not key.strip() or not key.isascii()
                            or any(c.isspace() for c in key)):
        raise UsageError("--api-key / HPCMAC_API_KEY: expected a non-empty key of printable "
                         "ASCII without spaces")
    return key


def cors_of(args) -> tuple[str, ...]:
    """``--cors``'s origins; UsageError when given empty."""
    from hpcmac.errors import UsageError

    given = getattr(args, "cors", None)
    cors = tuple(o.strip() for o in (given or "").split(",") if o.strip())
    if given is not None and not cors:
        raise UsageError(f"--cors {given!r}: expected comma-separated origins "
                         "(https://host:port) or *")
    return cors


def serve_config(args, cfg, tok, context: int) -> ServeConfig:
    """What the HTTP side needs, from serve's flags, the model's config and tokenizer."""
    from pathlib import Path

    from hpcmac.llm.args import draft_of
    from hpcmac.llm.model.config import resolve_model

    template = chat_template_of(args)
    if template is not None and tok is not None:
        tok.chat_template = template
    eos = tuple(tok.eos_ids if tok is not None and tok.eos_ids else cfg.eos_token_ids)
    name = args.model_name or Path(str(resolve_model(args.model))).name
    return ServeConfig(name, tok, cfg.vocab, context, eos,
                       default_max_tokens=min(args.max_tokens, context),
                       max_body=int(args.max_body_mb * 2**20),
                       special_in_prompts=args.special_tokens_in_prompts,
                       draft_k=args.draft_k if draft_of(args) else 0)


def run_serve(args, group=None) -> int:
    """Collective: load the model like ``generate``, then serve until interrupted (rank 0
    listens; every rank runs its stage)."""
    from importlib.util import find_spec

    from hpcmac import comm
    from hpcmac.llm import grammar
    from hpcmac.llm.args import check_threads, context_length, draft_of
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.gguf_loader import forget_readers
    from hpcmac.llm.model.tokenizer import load_tokenizer
    from hpcmac.llm.parallel.busy import BusyBoard
    from hpcmac.llm.parallel.placement import LayoutFlags
    from hpcmac.llm.parallel.plan import agree
    from hpcmac.llm.parallel.runtime import (
        agree_draft,
        agree_placement,
        agree_prefix_cache,
        bring_up,
        gather_cluster,
        hostfile_path,
        read_job_hostfile,
    )
    from hpcmac.plan import job as plan_job

    check_serve_args(args)
    if group is None:
        from hpcmac.launch.hostfile import job_hostfile

        group = comm.job_group(args.transport, hostfile=lambda: job_hostfile(args.hostfile))
    agree(group, lambda: check_threads(args.threads))
    cfg = agree(group, lambda: load_config(args.model))
    context = agree(group, lambda: context_length(args, cfg))
    agree_draft(group, draft_of(args), args.model, cfg)
    slots = args.max_batch or 16
    held = {}

    def listen_first():  # the port is checked before the model loads; it opens after
        held["sock"] = bind(args.host, args.port)

    channel = getattr(args, "channel", None)  # under --survive: the front listens
    if not channel:
        agree(group, listen_first, ranks="root")
    def tokenizer_first():  # rank 0 only; collective so a failure ends every rank
        held["tok"] = load_tokenizer(args.model)

    agree(group, tokenizer_first, ranks="root")
    tok = held.get("tok")
    # the job's hostfile, read once (rank 0) and handed down
    hostfile = agree(group, lambda: read_job_hostfile(hostfile_path(args.hostfile)),
                     ranks="root")
    cluster = gather_cluster(group, hostfile)
    # a server decodes up to --max-batch sequences at once: the default layout is
    # generate's for that many (hpcmac.plan's fastest when it has the node's figures,
    # else a pipeline on several ranks), unless a flag says otherwise
    preds, _ = agree(group, lambda: plan_job.for_generate(
        args.model, list(cluster.hosts), hostfile=hostfile, transport=cluster.transport,
        sequences=slots, prompt=min(128, context), context=context, backend=args.backend,
        quantize=args.quantize, group_size=args.q_group_size), ranks="root")
    best = preds[0] if preds and preds[0].fits else None
    placement = agree_placement(
        group, cfg, args.model, cluster, LayoutFlags.of(args), kv_tokens=slots * context,
        sequences=slots, quantize=args.quantize, group_size=args.q_group_size,
        draft=draft_of(args),
        predicted=(best.tp, best.pp, plan_job.why_chosen(preds)) if best else None)
    blocks, block_bytes, state_cost, cache_line = agree_prefix_cache(
        group, cfg, placement, args.prefix_cache_gb)
    if channel and group.rank == 0:  # the survive front's /health: "reloading" from here
        from hpcmac.llm.survive.channel import LOADING

        print(f"{LOADING} ({group.size} ranks)", file=sys.stderr, flush=True)
    t_load = time.perf_counter()
    rt = bring_up(group, placement, args.model, cfg, backend=args.backend,
                  quantize=args.quantize, group_size=args.q_group_size,
                  int8_activations=args.int8_activations, timeout=args.timeout,
                  draft=draft_of(args))
    t_load = time.perf_counter() - t_load
    weights = group.allgather_obj(int(rt.stage.nbytes)) if channel else None
    forget_readers()  # tokenizer, plan and stage are read: drop the parsed GGUF metadata
    # constrained decoding: the rank that samples (the last stage's leader) reads the
    # tokenizer too, now rather than in the first request that has a grammar
    grammar.configure(lambda: tok if group.rank == 0 else load_tokenizer(args.model),
                      cfg.vocab, cfg.eos_token_ids)
    samples = rt.groups.stage == rt.groups.pp - 1 and rt.groups.tp_rank == 0
    agree(group, lambda: grammar.warm() if samples and find_spec("llguidance") else None)
    source, http, alive = None, None, threading.Event()
    busy = BusyBoard(group.size)  # every rank: each one's busy time reaches rank 0's
    if group.rank == 0:
        scfg = serve_config(args, cfg, tok, context)
        name = scfg.model_id
        source = LiveRequests(capacity=slots + args.queue)
        if channel:
            from hpcmac.llm.survive.worker import ChannelFront

            http = ChannelFront(channel, source, tok, {
                "placement": placement.describe(why=True) if group.size > 1 else "1 rank",
                "hosts": list(dict.fromkeys(placement.hosts)), "ranks": group.size,
                "load_s": t_load, "bytes": sum(weights)})
        else:
            ops = Ops(api_key=api_key_of(args), cors=cors_of(args), placement=placement,
                      hosts=cluster.hosts, transport=cluster.transport, slots=slots,
                      busy=busy)
            http = HttpThread(build_app(scfg, source, alive, ops), held["sock"])
        http.start()
        layout = placement.layout.describe() if group.size > 1 else "1 rank"
        if group.size > 1:
            print(placement.describe(why=True), file=sys.stderr, flush=True)
        print(cache_line, file=sys.stderr, flush=True)
        where = f"the survive front at {channel}" if channel else \
            f"http://{args.host}:{args.port}/v1"
        print(f"serving {name} on {where} ({layout}, {slots} sequences at once, context "
              f"{context})", file=sys.stderr, flush=True)
        if not channel and not is_loopback(held["sock"]) and api_key_of(args) is None:
            print(f"warning: --host {args.host}: anyone who can reach port {args.port} can "
                  "use this server (no authentication: give it --api-key)", file=sys.stderr,
                  flush=True)
        alive.set()  # /health says ok once the lines above are out
    try:
        res = rt.run(None, threads=args.threads, source=source,
                     micro_batches=args.micro_batches or None,
                     max_batch=slots, prefill_chunk=args.prefill_chunk or None,
                     max_len=context,
                     on_token=source.token if source else None,
                     stop_check=source.stop_check if source else None,
                     prefix_blocks=blocks, prefix_bytes=block_bytes,
                     prefix_state=state_cost, busy=busy)
    finally:
        if group.rank == 0:
            alive.clear()
            source.fail_all("the server stopped")
            http.stop()
    if group.rank == 0 and res.speculative:
        sp = res.speculative
        print(f"speculative decoding: {sp['accepted']} of {sp['drafted']} draft tokens "
              f"accepted ({res.acceptance():.0%})", file=sys.stderr, flush=True)
    return 130 if res.interrupted else 0
