"""Anthropic's Messages API, ``POST /v1/messages``: the same generation, Anthropic's shapes.

A request is checked for what is Anthropic's own (the block types, ``system``,
``stop_sequences``, ``temperature`` in [0, 1], the required ``max_tokens``), then
turned into the chat request :func:`hpcmac.llm.request.parse` checks for
everything else (lengths, the context, sampling bounds), so one set of rules
holds for both APIs. Text blocks only: an image, a document or a tool block is a
400 naming the block (tool use is not implemented yet). Errors are Anthropic's
``{"type": "error", "error": {"type", "message"}}``; a stream is Anthropic's
event sequence (``message_start``, ``content_block_start``, ``ping``,
``content_block_delta``..., ``content_block_stop``, ``message_delta``,
``message_stop``).
"""

from __future__ import annotations

import json
import uuid

from hpcmac.llm.request import _STOP_CHARS, ApiError, load_body, parse

#: fields honoured; others Anthropic defines are refused by name
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
          "temperature", "top_p", "top_k", "metadata"}
#: why a known field is refused
REFUSED = {"tools": "tool use is not supported yet", "tool_choice": "tool use is not "
           "supported yet", "thinking": "extended thinking is not supported"}
#: error types by HTTP status (Anthropic's names)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
_STOPS = 16


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def _text(content, where: str) -> str:
    """A message's (or ``system``'s) text: a string, or a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks",
                       where.split("[")[0].split(".")[0])
    parts = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, f"{at} must be a content block with a 'type'", "messages")
        kind = block["type"]
        if kind != "text":
            why = "tool use is not supported yet" if kind.startswith("tool_") else \
                "only text blocks are supported"
            raise ApiError(400, f"{at}: a '{kind[:40]}' block is not supported ({why})",
                           "messages")
        if not isinstance(block.get("text"), str):
            raise ApiError(400, f"{at}.text must be a string", "messages")
        parts.append(block["text"])
    return "".join(parts)


def to_chat(body) -> tuple[dict, tuple[str, ...]]:
    """The OpenAI chat body of an Anthropic Messages body, and its stop sequences (400
    naming the field)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name in REFUSED:
            raise ApiError(400, f"'{name}': {REFUSED[name]}", name)
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)[:200]}", unknown[0])
    if body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required", "max_tokens")
    t = body.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and not 0 <= t <= 1:
        raise ApiError(400, f"'temperature' must be between 0 and 1; got {t}", "temperature")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and set(meta) <= {"user_id"}):
        raise ApiError(400, "'metadata' may hold 'user_id' only", "metadata")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    chat = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' user or "
                                "assistant", "messages")
        chat.append({"role": m["role"], "content": _text(m.get("content"),
                                                          f"messages[{i}].content")})
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and len(stops) <= _STOPS
                                  and all(isinstance(s, str) and len(s) <= _STOP_CHARS
                                          for s in stops)):
        raise ApiError(400, f"'stop_sequences' must be a list of at most {_STOPS} strings "
                            f"of at most {_STOP_CHARS} characters", "stop_sequences")
    out = {"messages": chat, "max_tokens": body["max_tokens"],
           "stream": body.get("stream", False)}
    for k in ("model", "temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            out[k] = body[k]
    return out, tuple(s for s in stops or () if s)


def _parse(raw: bytes, cfg):
    chat, stops = to_chat(load_body(raw))
    ids, max_tokens, sampling, _, stream = parse(chat, "chat", cfg)
    return ids, max_tokens, sampling, stops, stream


def stop_of(run) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence met or None)."""
    hits = [(run.text.find(s), s) for s in run.stops if s in run.text]
    if hits:
        return "stop_sequence", min(hits)[1]
    return ("max_tokens" if run.reason == "length" else "end_turn"), None


def routes(gw) -> list:
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    cfg = gw.cfg

    def err(e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

    async def messages(request):
        try:
            raw = await gw.read_body(request)
            if raw is None:
                return Response(status_code=400)
            ids, max_tokens, sampling, stops, stream = await gw.parse(_parse, raw, cfg)
            run = gw.start(ids, max_tokens, sampling, stops)
        except ApiError as e:
            return err(e)
        mid = "msg_" + uuid.uuid4().hex[:24]

        def message(content: list, reason, seq, out_tokens: int) -> dict:
            return {"id": mid, "type": "message", "role": "assistant", "model": cfg.model_id,
                    "content": content, "stop_reason": reason, "stop_sequence": seq,
                    "usage": {"input_tokens": len(ids), "output_tokens": out_tokens}}

        if stream:
            def event(kind: str, data: dict) -> str:
                return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

            async def sse():
                yield event("message_start", {"message": message([], None, None, 0)})
                yield event("content_block_start", {"index": 0, "content_block": {
                    "type": "text", "text": ""}})
                yield event("ping", {})
                async for what in run.events():
                    piece = run.delta(final=what == "end")
                    if piece:
                        yield event("content_block_delta", {"index": 0, "delta": {
                            "type": "text_delta", "text": piece}})
                if run.failed:
                    yield event("error", {"error": error_body(run.error())["error"]})
                    return
                reason, seq = stop_of(run)
                yield event("content_block_stop", {"index": 0})
                yield event("message_delta", {"delta": {"stop_reason": reason,
                                                        "stop_sequence": seq},
                                              "usage": {"output_tokens": len(run.ids)}})
                yield event("message_stop", {})

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await run.whole(request)
        if run.failed:
            return err(run.error())
        reason, seq = stop_of(run)
        return JSONResponse(message([{"type": "text", "text": run.visible(final=True)}],
                                    reason, seq, len(run.ids)))

    return [Route("/v1/messages", messages, methods=["POST"])]
