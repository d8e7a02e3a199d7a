"""OpenAI's Responses API, ``POST /v1/responses``: text in, text out, and its event stream.

``input`` (a string, or a list of messages whose content is a string or
``input_text``/``output_text`` parts) and ``instructions`` (a system message)
become the chat request :func:`hpcmac.llm.request.parse` checks, so the rules
are chat's. Nothing is stored (``store`` true is refused; so is
``previous_response_id``), and tools are not implemented yet (400 naming the
field). A stream is the Responses event sequence: ``response.created``,
``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``), each with its
``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid

from hpcmac.llm.request import ApiError, load_body, parse

FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
          "stream", "store", "metadata", "user", "text", "truncation", "parallel_tool_calls"}
REFUSED = {"tools": "tools are not supported yet", "tool_choice": "tools are not supported "
           "yet", "previous_response_id": "responses are not stored (store: false)",
           "background": "background responses are not supported",
           "reasoning": "reasoning options are not supported"}
_ROLES = ("user", "assistant", "system", "developer")
_PARTS = ("input_text", "output_text", "text")


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of parts", "input")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PARTS:
            raise ApiError(400, f"{where}[{j}]: a '{str(kind)[:40]}' part is not supported "
                                "(text parts only)", "input")
        if not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}].text must be a string", "input")
        out.append(part["text"])
    return "".join(out)


def to_chat(body) -> dict:
    """The OpenAI chat body of a Responses body (400 naming the field)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name in REFUSED and body[name] not in (None, [], False):
            raise ApiError(400, f"'{name}': {REFUSED[name]}", name)
    unknown = sorted(set(body) - FIELDS - set(REFUSED))
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)[:200]}", unknown[0])
    if body.get("store"):
        raise ApiError(400, "'store': responses are not stored here; send store: false",
                       "store")
    fmt = body.get("text")
    if fmt is not None and fmt != {} and fmt != {"format": {"type": "text"}}:
        raise ApiError(400, "'text': only {\"format\": {\"type\": \"text\"}} is supported",
                       "text")
    if body.get("truncation") not in (None, "disabled"):
        raise ApiError(400, "'truncation': only 'disabled' is supported", "truncation")
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise ApiError(400, "'metadata' must be an object", "metadata")
    chat = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "'instructions' must be a string", "instructions")
        chat.append({"role": "system", "content": body["instructions"]})
    inp = body.get("input")
    if isinstance(inp, str):
        chat.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            if not isinstance(item, dict) or item.get("type", "message") != "message" \
                    or item.get("role") not in _ROLES:
                kind = item.get("type") if isinstance(item, dict) else None
                raise ApiError(400, f"input[{i}] must be a message with a role of "
                                    f"{', '.join(_ROLES)}" + (f" (a '{str(kind)[:40]}' "
                                                              "item is not supported)"
                                                              if kind else ""), "input")
            role = "system" if item["role"] == "developer" else item["role"]
            chat.append({"role": role, "content": _content(item.get("content"),
                                                           f"input[{i}].content")})
    else:
        raise ApiError(400, "'input' must be a string or a non-empty list of messages",
                       "input")
    out = {"messages": chat, "stream": body.get("stream", False)}
    for k in ("model", "temperature", "top_p", "user"):
        if body.get(k) is not None:
            out[k] = body[k]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def _parse(raw: bytes, cfg):
    body = load_body(raw)
    chat = to_chat(body)
    try:
        return body, parse(chat, "chat", cfg)
    except ApiError as e:
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", e.message.replace(
                "'max_tokens'", "'max_output_tokens'")
        raise


def routes(gw) -> list:
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    cfg = gw.cfg

    def err(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def responses(request):
        try:
            raw = await gw.read_body(request)
            if raw is None:
                return Response(status_code=400)
            body, (ids, max_tokens, sampling, stops, stream) = \
                await gw.parse(_parse, raw, cfg)
            run = gw.start(ids, max_tokens, sampling, stops)
        except ApiError as e:
            return err(e)
        rid, mid = "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24]
        created = int(time.time())

        def item(text: str, done: bool) -> dict:
            return {"type": "message", "id": mid, "role": "assistant",
                    "status": "completed" if done else "in_progress",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]
                    if done else []}

        def response(status: str, output: list) -> dict:
            usage = None
            if status != "in_progress":
                u = run.usage()
                usage = {"input_tokens": u["prompt_tokens"],
                         "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": u["completion_tokens"],
                         "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": u["total_tokens"]}
            return {"id": rid, "object": "response", "created_at": created,
                    "status": status, "model": cfg.model_id, "output": output,
                    "error": None, "incomplete_details": {"reason": "max_output_tokens"}
                    if status == "incomplete" else None,
                    "instructions": body.get("instructions"),
                    "max_output_tokens": body.get("max_output_tokens"),
                    "temperature": sampling.temperature, "top_p": sampling.top_p,
                    "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                    "text": {"format": {"type": "text"}}, "truncation": "disabled",
                    "store": False, "metadata": body.get("metadata") or {},
                    "usage": usage}

        def status() -> str:
            return "incomplete" if run.finish_reason() == "length" else "completed"

        if stream:
            seq = [0]

            def event(kind: str, data: dict) -> str:
                data = {"type": kind, "sequence_number": seq[0], **data}
                seq[0] += 1
                return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

            where = {"item_id": mid, "output_index": 0, "content_index": 0}

            async def sse():
                yield event("response.created", {"response": response("in_progress", [])})
                yield event("response.in_progress", {"response": response("in_progress",
                                                                          [])})
                yield event("response.output_item.added", {"output_index": 0,
                                                           "item": item("", False)})
                yield event("response.content_part.added", {**where, "part": {
                    "type": "output_text", "text": "", "annotations": []}})
                async for what in run.events():
                    piece = run.delta(final=what == "end")
                    if piece:
                        yield event("response.output_text.delta", {**where, "delta": piece,
                                                                   "logprobs": []})
                if run.failed:
                    e = run.error()
                    yield event("error", {"code": "server_error", "message": e.message,
                                          "param": None})
                    return
                text = run.visible(final=True)
                yield event("response.output_text.done", {**where, "text": text,
                                                          "logprobs": []})
                yield event("response.content_part.done", {**where, "part": {
                    "type": "output_text", "text": text, "annotations": []}})
                yield event("response.output_item.done", {"output_index": 0,
                                                          "item": item(text, True)})
                st = status()
                yield event(f"response.{st}", {"response": response(st, [item(text, True)])})

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await run.whole(request)
        if run.failed:
            return err(run.error())
        return JSONResponse(response(status(), [item(run.visible(final=True), True)]))

    return [Route("/v1/responses", responses, methods=["POST"])]
