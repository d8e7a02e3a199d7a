"""What an operator plugs into ``serve``: the API key, CORS, metrics, slots, the cluster view.

* ``--api-key`` (or ``HPCMAC_API_KEY``): every route but ``/health`` and the page's
  static files needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``; anything
  else is a 401 JSON error before the body is read (no work is done).
* ``--cors ORIGINS``: the browsers' cross-origin headers for those origins
  (Starlette's CORSMiddleware; preflights pass without a key, as browsers send none).
* ``GET /metrics`` (Prometheus text, :mod:`hpcmac.llm.metrics`), ``GET /metrics.json``
  (the same live figures as JSON, for the page), ``GET /v1/slots`` (the requests
  running and waiting), ``GET /v1/cluster`` (hosts, ranks, links and placement),
  ``GET /`` (the live cluster page, :mod:`hpcmac.llm.web`).
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

#: routes a request may reach without the key
OPEN = ("/health", "/", "/favicon.ico")
OPEN_PREFIX = "/static/"
#: endpoints counted by name in hpcmac_requests_total (others are "other")
ENDPOINTS = ("/health", "/v1/models", "/v1/chat/completions", "/v1/completions",
             "/v1/messages", "/v1/responses", "/metrics", "/metrics.json", "/v1/slots",
             "/v1/cluster", "/")


@dataclass
class Ops:
    """The operator's settings and the job's shape (rank 0; global values)."""

    api_key: str | None = None
    cors: tuple[str, ...] = ()
    placement: object = None  # hpcmac.llm.parallel.placement.Placement (None: one rank)
    hosts: tuple[str, ...] = ()  # host of each world rank
    transport: str = ""  # the comm backend's name
    slots: int = 0  # --max-batch
    busy: object = None  # hpcmac.llm.parallel.busy.BusyBoard
    metrics: object = field(default=None, repr=False)

    def new_metrics(self, cfg, source):
        from hpcmac.llm.metrics import ServeMetrics

        self.metrics = ServeMetrics(cfg, source, self)
        return self.metrics

    # -- the job -----------------------------------------------------------------------
    def rank_rows(self) -> list[dict]:
        """Each rank: its host and busy figures (None where it has not reported)."""
        hosts = self.hosts or ("localhost",)
        rows = self.busy.ranks() if self.busy is not None else \
            [{"rank": r, "busy": None, "busy_s": None, "cpu_s": None, "age_s": None}
             for r in range(len(hosts))]
        for row in rows:
            row["host"] = hosts[row["rank"]] if row["rank"] < len(hosts) else "?"
        return rows

    def cluster(self, cfg) -> dict:
        """The job's shape for the page: hosts and their ranks, the links between ranks
        (pipeline hops, the return of tokens, tensor-group pairs) and each link's
        transport, the placement of layers, heads, experts and bytes."""
        pl = self.placement
        hosts = list(self.hosts or ("localhost",))
        n = len(hosts)
        by_host: dict[str, list[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(h, []).append(r)
        links = []
        if pl is not None and n > 1:
            tp, pp = pl.tp, pl.pp
            for s in range(pp):
                members = pl.members(s)
                for i, a in enumerate(members):
                    for b in members[i + 1:]:
                        links.append(self._link(a, b, "tensor", hosts, tp))
                if s + 1 < pp:
                    links.append(self._link(s * tp, (s + 1) * tp, "pipeline", hosts, tp))
            if pp > 1:
                links.append(self._link((pp - 1) * tp, 0, "tokens back", hosts, tp))
        ranks = pl.json()["ranks"] if pl is not None else [
            {"rank": 0, "stage": 0, "tp_rank": 0, "host": hosts[0]}]
        return {"model": cfg.model_id, "context": cfg.context, "slots": self.slots,
                "transport": self.transport or "local", "auth": bool(self.api_key),
                "layout": ({"tp": pl.tp, "pp": pl.pp, "why": pl.why,
                            "describe": pl.describe()} if pl is not None else
                           {"tp": 1, "pp": 1, "why": "one rank", "describe": "1 rank"}),
                "hosts": [{"name": h, "ranks": rs} for h, rs in by_host.items()],
                "ranks": ranks, "links": links}

    def _link(self, a: int, b: int, kind: str, hosts: list[str], tp: int) -> dict:
        from hpcmac.llm.parallel import shmsum

        t = self.transport or "local"
        if hosts[a] == hosts[b]:
            how = ("shared memory (shmsum) + " + t if kind == "tensor"
                   and shmsum.eligible([hosts[a], hosts[b]]) else t) + ", same host"
        else:
            how = t
        return {"from": a, "to": b, "kind": kind, "transport": how}

    # -- the app -------------------------------------------------------------------------
    def middleware(self) -> list:
        from starlette.middleware import Middleware

        out = []
        if self.cors:
            from starlette.middleware.cors import CORSMiddleware

            out.append(Middleware(CORSMiddleware, allow_origins=list(self.cors),
                                  allow_methods=["GET", "POST", "OPTIONS"],
                                  allow_headers=["*"], expose_headers=["Retry-After"]))
        out.append(Middleware(_Guard, key=self.api_key, metrics=self.metrics))
        return out

    def routes(self, gw) -> list:
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        from hpcmac.llm import web

        m, cfg, source = self.metrics, gw.cfg, gw.source

        async def metrics(_):
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(m.text(), media_type=CONTENT_TYPE_LATEST)

        async def metrics_json(_):
            return JSONResponse(m.json())

        async def slots(_):
            snap = getattr(source, "snapshot", None)  # the survive front has none
            return JSONResponse({"object": "list", "slots": self.slots,
                                 "data": snap() if snap is not None else []})

        async def cluster(_):
            return JSONResponse(self.cluster(cfg))

        return [Route("/metrics", metrics, methods=["GET"]),
                Route("/metrics.json", metrics_json, methods=["GET"]),
                Route("/v1/slots", slots, methods=["GET"]),
                Route("/v1/cluster", cluster, methods=["GET"]),
                *web.routes()]


def unauthorized(path: str) -> tuple[dict, str]:
    """The 401 body, shaped as the API at ``path`` shapes its errors."""
    msg = ("a valid API key is required: send 'Authorization: Bearer KEY' or "
           "'x-api-key: KEY' (--api-key)")
    if path.startswith("/v1/messages"):
        return {"type": "error", "error": {"type": "authentication_error",
                                           "message": msg}}, msg
    return {"error": {"message": msg, "type": "authentication_error", "param": None,
                      "code": "invalid_api_key"}}, msg


class _Guard:
    """ASGI middleware: counts every answer by endpoint and status, and refuses requests
    without the key (401 before the app reads anything)."""

    def __init__(self, app, key: str | None, metrics):
        self.app, self.metrics = app, metrics
        self.key = key.encode() if key else None

    def _allowed(self, scope) -> bool:
        path = scope["path"]
        if self.key is None or path in OPEN or path.startswith(OPEN_PREFIX) or \
                scope.get("method") == "OPTIONS":
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                if hmac.compare_digest(value[7:].strip(), self.key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self.key):
                return True
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "other"
        seen = {}

        async def counted(message):
            if message["type"] == "http.response.start" and "status" not in seen:
                seen["status"] = message["status"]
                if self.metrics is not None:
                    self.metrics.answered(endpoint, message["status"])
            await send(message)

        if not self._allowed(scope):
            body, _ = unauthorized(path)
            data = json.dumps(body).encode()
            await counted({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": data})
            return
        await self.app(scope, receive, counted)
