"""Anthropic's Messages API, ``POST /v1/messages``: the same generation, Anthropic's shapes.

A request is checked for what is Anthropic's own (the block types, ``system``,
``stop_sequences``, ``temperature`` in [0, 1], the required ``max_tokens``), then
turned into the chat request :func:`hpcmac.llm.request.parse_request` checks for
everything else (lengths, the context, sampling bounds, tools), so one set of
rules holds for both APIs. Blocks: ``text``, an assistant's ``tool_use`` and a
user's ``tool_result``; any other (an image, a document) is a 400 naming the
block. ``thinking`` switches the template's reasoning on or off (:func:`_thinking`);
reasoning comes back as ``thinking`` blocks. ``tools`` (``name``, ``description``,
``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``) become OpenAI's, so
calls are rendered, parsed and (``any``, ``tool``) enforced by
:mod:`hpcmac.llm.tools`; a call comes back as a ``tool_use`` block with
``stop_reason: tool_use``. Errors are Anthropic's
``{"type": "error", "error": {"type", "message"}}``; a stream is Anthropic's
event sequence (``message_start``, then per block ``content_block_start``,
``content_block_delta`` (``thinking_delta``, ``text_delta``, ``input_json_delta`` as
a call's arguments are written)...,
``content_block_stop``, then ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import json
import uuid

from hpcmac.llm import tools
from hpcmac.llm.generation import listed
from hpcmac.llm.request import _STOP_CHARS, ApiError, load_body, parse_request

#: fields honoured; others Anthropic defines are refused by name
FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
          "temperature", "top_p", "top_k", "metadata", "tools", "tool_choice", "thinking"}
#: why a known field is refused
REFUSED: dict[str, str] = {}
#: error types by HTTP status (Anthropic's names)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
_STOPS = 16


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": e.message}}


def _blocks(content, where: str, allowed: tuple[str, ...] = ("text",)) -> list[dict]:
    """A message's (or ``system``'s) blocks: a string is one text block; each block's
    type must be one of ``allowed``."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of content blocks",
                       where.split("[")[0].split(".")[0])
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise ApiError(400, f"{at} must be a content block with a 'type'", "messages")
        kind = block["type"]
        if kind not in allowed:
            why = f"here: {', '.join(allowed)}" if kind.startswith("tool_") else \
                "text and tool blocks only"
            raise ApiError(400, f"{at}: a '{kind[:40]}' block is not supported ({why})",
                           "messages")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise ApiError(400, f"{at}.text must be a string", "messages")
        if kind == "tool_use" and not (isinstance(block.get("id"), str) and
                                       isinstance(block.get("name"), str) and
                                       isinstance(block.get("input", {}), dict)):
            raise ApiError(400, f"{at}: a tool_use block needs 'id', 'name' and an "
                                "object 'input'", "messages")
        if kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
            raise ApiError(400, f"{at}: a tool_result block needs 'tool_use_id'", "messages")
    return content


def _text(blocks: list[dict]) -> str:
    return "".join(b["text"] for b in blocks if b["type"] == "text")


def _message(i: int, m: dict) -> list[dict]:
    """messages[i] as chat messages: an assistant's tool_use blocks become its
    ``tool_calls``; a user's tool_result blocks become ``tool`` messages before its text."""
    where = f"messages[{i}].content"
    if m["role"] == "assistant":
        blocks = _blocks(m.get("content"), where, ("text", "tool_use"))
        out = {"role": "assistant", "content": _text(blocks)}
        calls = [{"id": b["id"], "type": "function", "function": {
            "name": b["name"], "arguments": json.dumps(b.get("input", {}))}}
            for b in blocks if b["type"] == "tool_use"]
        if calls:
            out["tool_calls"] = calls
        return [out]
    blocks = _blocks(m.get("content"), where, ("text", "tool_result"))
    out = []
    for j, b in enumerate(blocks):
        if b["type"] == "tool_result":
            body = b.get("content", "")
            text = body if isinstance(body, str) else \
                _text(_blocks(body, f"{where}[{j}].content"))
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
    text = _text(blocks)
    if text or not out:
        out.append({"role": "user", "content": text})
    return out


def _function(i: int, t) -> dict:
    """tools[i], a client tool, as an OpenAI function tool."""
    if not isinstance(t, dict) or t.get("type", "custom") != "custom":
        raise ApiError(400, f"tools[{i}]: only client tools ({{name, description, "
                            "input_schema}}) are supported", "tools")
    fn = {"name": t.get("name"), "parameters": t.get("input_schema", {"type": "object"})}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _tools(body: dict) -> dict:
    """``tools`` and ``tool_choice`` as OpenAI's (what :func:`hpcmac.llm.tools.check`
    reads)."""
    listed_tools = listed(body, "tools")
    if listed_tools is None:
        return {}
    out: dict = {"tools": [_function(i, t) for i, t in enumerate(listed_tools)]}
    tc = body.get("tool_choice")
    if tc is not None:
        kind = tc.get("type") if isinstance(tc, dict) else None
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = {"any": "required"}.get(kind, kind)
        else:
            raise ApiError(400, "'tool_choice' must be {\"type\": \"auto\" | \"any\" | "
                                "\"none\"} or {\"type\": \"tool\", \"name\": ...}",
                           "tool_choice")
        if tc.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def _thinking(body: dict) -> dict:
    """``thinking`` as the chat template's switch: ``enabled`` sets ``enable_thinking``
    (Qwen3's name) and ``thinking`` (DeepSeek V3.1's) true, ``disabled`` false; the
    reasoning comes back as thinking blocks. ``budget_tokens`` is checked, not enforced
    (the model ends its reasoning itself; ``max_tokens`` bounds the whole answer)."""
    t = body.get("thinking")
    if t is None:
        return {}
    kind = t.get("type") if isinstance(t, dict) else None
    budget = t.get("budget_tokens") if isinstance(t, dict) else None
    if kind == "enabled" and isinstance(budget, int) and not isinstance(budget, bool) \
            and budget > 0:
        on = True
    elif kind == "disabled":
        on = False
    else:
        raise ApiError(400, "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": "
                            "N > 0} or {\"type\": \"disabled\"}", "thinking")
    return {"chat_template_kwargs": {"enable_thinking": on, "thinking": on}}


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
        chat.append({"role": "system", "content": _text(_blocks(body["system"], "system"))})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' user or "
                                "assistant", "messages")
        chat += _message(i, m)
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and len(stops) <= _STOPS
                                  and all(isinstance(s, str) and len(s) <= _STOP_CHARS
                                          for s in stops)):
        raise ApiError(400, f"'stop_sequences' must be a list of at most {_STOPS} strings "
                            f"of at most {_STOP_CHARS} characters", "stop_sequences")
    out = {"messages": chat, "max_tokens": body["max_tokens"],
           "stream": body.get("stream", False), **_tools(body), **_thinking(body)}
    for k in ("model", "temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            out[k] = body[k]
    return out, tuple(s for s in stops or () if s)


def _parse(raw: bytes, cfg):
    chat, stops = to_chat(load_body(raw))
    p = parse_request(chat, "chat", cfg)
    p.stops = stops
    return p


def stop_of(run, called: bool = False) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence met or None)."""
    hits = [(run.text.find(s), s) for s in run.stops if s in run.text]
    if hits:
        return "stop_sequence", min(hits)[1]
    if called:
        return "tool_use", None
    return ("max_tokens" if run.reason == "length" else "end_turn"), None


def tool_block(call: dict) -> dict:
    """An OpenAI tool call as a tool_use block."""
    fn = call["function"]
    try:
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) \
            else fn["arguments"]
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": fn["name"], "input": args if isinstance(args, dict) else {}}


def thinking_block(text: str) -> dict:
    """Reasoning as a thinking block (no signature: nothing here signs it)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


class Blocks:
    """A stream's chat deltas (:class:`hpcmac.llm.tools.StreamParser`'s) as Anthropic's
    content blocks, each opened as its first piece comes and stopped when another kind
    begins: reasoning as a ``thinking`` block (``thinking_delta``), content as a ``text``
    block (``text_delta``), each tool call as a ``tool_use`` block, started with its id
    and name, its arguments in ``input_json_delta`` pieces as they are written."""

    def __init__(self, event):
        self.event, self.n, self.kind = event, -1, None

    def _start(self, kind, block: dict) -> list[str]:
        out = self._stop()
        self.n, self.kind = self.n + 1, kind
        return out + [self.event("content_block_start", {"index": self.n,
                                                         "content_block": block})]

    def _stop(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [self.event("content_block_stop", {"index": self.n})]

    def _piece(self, kind, block: dict, delta: dict) -> list[str]:
        out = self._start(kind, block) if self.kind != kind else []
        return out + [self.event("content_block_delta", {"index": self.n, "delta": delta})]

    def delta(self, d: dict) -> list[str]:
        out = []
        if d.get("reasoning_content"):
            out += self._piece("thinking", thinking_block(""), {
                "type": "thinking_delta", "thinking": d["reasoning_content"]})
        if d.get("content"):
            out += self._piece("text", {"type": "text", "text": ""},
                               {"type": "text_delta", "text": d["content"]})
        for c in d.get("tool_calls", ()):
            kind, fn = ("tool_use", c["index"]), c["function"]
            if "id" in c:
                out += self._start(kind, {"type": "tool_use", "id": "toolu_" + c["id"]
                                          .removeprefix("call_"), "name": fn["name"],
                                          "input": {}})
            if fn.get("arguments") and self.kind == kind:
                out.append(self.event("content_block_delta", {"index": self.n, "delta": {
                    "type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return out

    def close(self) -> list[str]:
        """The last block stopped (an answer of nothing is one empty text block)."""
        out = self._start("text", {"type": "text", "text": ""}) if self.n < 0 else []
        return out + self._stop()


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
            p = await gw.parse(_parse, raw, cfg)
            run = gw.start(p.ids, p.max_tokens, p.sampling, p.stops)
        except ApiError as e:
            return err(e)
        ids = p.ids
        # an answer with tool calls (or reasoning) to split off
        reader = p.reader() if p.tools or p.reasoning else None
        mid = "msg_" + uuid.uuid4().hex[:24]

        def message(content: list, reason, seq, out_tokens: int) -> dict:
            return {"id": mid, "type": "message", "role": "assistant", "model": cfg.model_id,
                    "content": content, "stop_reason": reason, "stop_sequence": seq,
                    "usage": {"input_tokens": len(ids), "output_tokens": out_tokens,
                              "cache_read_input_tokens": run.cached_tokens}}

        if p.stream:
            def event(kind: str, data: dict) -> str:
                return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

            sp = tools.StreamParser(**reader) if reader else None
            blocks = Blocks(event)

            def deltas(piece: str) -> list[dict]:
                if sp is None:
                    return [{"content": piece}] if piece else []
                return sp.feed(piece)

            async def sse():
                yield event("message_start", {"message": message([], None, None, 0)})
                yield event("ping", {})
                async for what in run.events():
                    for d in deltas(run.delta(final=what == "end")):
                        for e in blocks.delta(d):
                            yield e
                if run.failed:
                    yield event("error", {"error": error_body(run.error())["error"]})
                    return
                called = False
                if sp is not None:
                    rest, called = sp.close()
                    for d in rest:
                        for e in blocks.delta(d):
                            yield e
                for e in blocks.close():
                    yield e
                reason, seq = stop_of(run, called)
                yield event("message_delta", {"delta": {"stop_reason": reason,
                                                        "stop_sequence": seq},
                                              "usage": {"output_tokens": len(run.ids)}})
                yield event("message_stop", {})

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await run.whole(request)
        if run.failed:
            return err(run.error())
        text, calls, thought = run.visible(final=True), [], None
        if reader:
            answer = tools.parse(text, **reader)
            text, calls, thought = answer.content, answer.tool_calls or [], answer.reasoning
        content = ([thinking_block(thought)] if thought else []) + \
            ([{"type": "text", "text": text}] if text or not (calls or thought) else []) + \
            [tool_block(c) for c in calls]
        reason, seq = stop_of(run, bool(calls))
        return JSONResponse(message(content, reason, seq, len(run.ids)))

    return [Route("/v1/messages", messages, methods=["POST"])]
