"""OpenAI's Responses API, ``POST /v1/responses``: text in, text out, and its event stream.

``input`` (a string, or a list of messages whose content is a string or
``input_text``/``output_text`` parts, and ``function_call`` /
``function_call_output`` items) and ``instructions`` (a system message) become
the chat request :func:`hpcmac.llm.request.parse_request` checks, so the rules
are chat's; function ``tools``, ``tool_choice`` and ``parallel_tool_calls``
become chat's too (:mod:`hpcmac.llm.tools` renders, parses and, for
``required`` or a named function, enforces the calls), and a call comes back as
a ``function_call`` output item; reasoning (``reasoning.effort`` switches the
template's) comes back as a ``reasoning`` item. Nothing is stored (``store`` true is refused;
so is ``previous_response_id``). A stream is the Responses event sequence:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, for reasoning ``response.reasoning_text.delta``...,
for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, for a call
``response.function_call_arguments.delta`` pieces as they are written / ``.done``, then
``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``), each event with its
``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid

from hpcmac.llm import tools
from hpcmac.llm.generation import listed
from hpcmac.llm.request import ApiError, load_body, parse_request

FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
          "stream", "store", "metadata", "user", "text", "truncation", "parallel_tool_calls",
          "tools", "tool_choice", "reasoning"}
REFUSED = {"previous_response_id": "responses are not stored (store: false)",
           "background": "background responses are not supported"}
#: reasoning efforts (``none``: the template's reasoning off)
EFFORTS = ("none", "minimal", "low", "medium", "high")
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
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind in ("function_call", "function_call_output"):
                chat.append(_call_item(i, item, chat))
                continue
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
    chat = [m for m in chat if m is not None]
    out = {"messages": chat, "stream": body.get("stream", False), **_tools(body),
           **_reasoning(body)}
    for k in ("model", "temperature", "top_p", "user", "parallel_tool_calls"):
        if body.get(k) is not None:
            out[k] = body[k]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def _reasoning(body: dict) -> dict:
    """``reasoning.effort`` as the chat template's variables: ``none`` turns reasoning
    off (``enable_thinking``, ``thinking`` false), any other on, and is gpt-oss's
    ``reasoning_effort``; the reasoning comes back as a ``reasoning`` output item."""
    r = body.get("reasoning")
    if r is None:
        return {}
    effort = r.get("effort") if isinstance(r, dict) else None
    if not isinstance(r, dict) or set(r) - {"effort", "summary"} or \
            effort not in (None, *EFFORTS):
        raise ApiError(400, "'reasoning' must be {\"effort\": " + " | ".join(EFFORTS) +
                       "}", "reasoning")
    if effort is None:
        return {}
    on = effort != "none"
    kw = {"enable_thinking": on, "thinking": on}
    if on:
        kw["reasoning_effort"] = "low" if effort == "minimal" else effort
    return {"chat_template_kwargs": kw}


def _call_item(i: int, item: dict, chat: list) -> dict | None:
    """A ``function_call`` item joins the assistant message before it (or starts one); a
    ``function_call_output`` is a ``tool`` message. None: merged into the last one."""
    if not isinstance(item.get("call_id"), str):
        raise ApiError(400, f"input[{i}] needs a 'call_id' string", "input")
    if item["type"] == "function_call_output":
        out = item.get("output")
        text = out if isinstance(out, str) else _content(out, f"input[{i}].output")
        return {"role": "tool", "tool_call_id": item["call_id"], "content": text}
    if not (isinstance(item.get("name"), str) and isinstance(item.get("arguments"), str)):
        raise ApiError(400, f"input[{i}]: a function_call needs 'name' and 'arguments' "
                            "strings", "input")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    last = next((m for m in reversed(chat) if m is not None), None)
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        return None
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _tools(body: dict) -> dict:
    """Function ``tools`` and ``tool_choice`` as chat's."""
    out: dict = {}
    tl = listed(body, "tools")
    if tl is None:
        return out
    fns = []
    for i, t in enumerate(tl):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"tools[{i}]: only function tools are supported (got "
                                f"{str(kind)[:40]})", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        fns.append({"type": "function", "function": fn})
    out["tools"] = fns
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": tc.get("name")}}
    elif tc is not None:
        out["tool_choice"] = tc
    return out


def _parse(raw: bytes, cfg):
    body = load_body(raw)
    chat = to_chat(body)
    try:
        return body, parse_request(chat, "chat", cfg)
    except ApiError as e:
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", e.message.replace(
                "'max_tokens'", "'max_output_tokens'")
        raise


def message_item(mid: str, text: str, done: bool) -> dict:
    return {"type": "message", "id": mid, "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [{"type": "output_text", "text": text, "annotations": []}]
            if done else []}


def reasoning_item(rid: str, text: str, done: bool) -> dict:
    return {"type": "reasoning", "id": rid, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "status": "completed" if done else "in_progress"}


def call_item(call: dict, done: bool = True) -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if done else "",
            "status": "completed" if done else "in_progress"}


class Items:
    """A stream's chat deltas (:class:`hpcmac.llm.tools.StreamParser`'s) as Responses
    output items, each added as its first piece comes and done when another begins:
    reasoning as a ``reasoning`` item (``response.reasoning_text.delta``), content as
    a ``message`` (``response.output_text.delta``), each tool call as a
    ``function_call`` item, added with its name and call id, its arguments in
    ``response.function_call_arguments.delta`` pieces as they are written. ``done``:
    the finished items, for the last event's response."""

    def __init__(self, event, mid: str):
        self.event, self.mid = event, mid
        self.done: list[dict] = []
        self.kind, self.text, self.call = None, "", None

    def _where(self) -> dict:
        return {"item_id": self._id(), "output_index": len(self.done)}

    def _id(self) -> str:
        if self.kind == "reasoning":
            return "rs_" + self.mid.removeprefix("msg_")
        if self.kind == "message":
            return self.mid
        return call_item(self.call)["id"]

    def _start(self, kind, call: dict | None = None) -> list[str]:
        out = self._finish()
        self.kind, self.text, self.call = kind, "", call
        i = len(self.done)
        if kind == "reasoning":
            out.append(self.event("response.output_item.added", {
                "output_index": i, "item": reasoning_item(self._id(), "", False)}))
            out.append(self.event("response.content_part.added", {
                **self._where(), "content_index": 0,
                "part": {"type": "reasoning_text", "text": ""}}))
        elif kind == "message":
            out.append(self.event("response.output_item.added", {
                "output_index": i, "item": message_item(self.mid, "", False)}))
            out.append(self.event("response.content_part.added", {
                **self._where(), "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []}}))
        else:
            out.append(self.event("response.output_item.added", {
                "output_index": i, "item": call_item(call, False)}))
        return out

    def _finish(self) -> list[str]:
        if self.kind is None:
            return []
        where, t, out = self._where(), self.text, []
        if self.kind == "reasoning":
            part = {"type": "reasoning_text", "text": t}
            out.append(self.event("response.reasoning_text.done", {
                **where, "content_index": 0, "text": t}))
            out.append(self.event("response.content_part.done", {
                **where, "content_index": 0, "part": part}))
            item = reasoning_item(where["item_id"], t, True)
        elif self.kind == "message":
            out.append(self.event("response.output_text.done", {
                **where, "content_index": 0, "text": t, "logprobs": []}))
            out.append(self.event("response.content_part.done", {
                **where, "content_index": 0,
                "part": {"type": "output_text", "text": t, "annotations": []}}))
            item = message_item(self.mid, t, True)
        else:
            call = dict(self.call, function=dict(self.call["function"], arguments=t))
            out.append(self.event("response.function_call_arguments.done", {
                **where, "name": call["function"]["name"], "arguments": t}))
            item = call_item(call)
        out.append(self.event("response.output_item.done", {
            "output_index": len(self.done), "item": item}))
        self.done.append(item)
        self.kind = None
        return out

    def _piece(self, kind, name: str, piece: str, **extra) -> list[str]:
        out = self._start(kind) if self.kind != kind else []
        self.text += piece
        return out + [self.event(name, {**self._where(), **extra, "delta": piece})]

    def delta(self, d: dict) -> list[str]:
        out = []
        if d.get("reasoning_content"):
            out += self._piece("reasoning", "response.reasoning_text.delta",
                               d["reasoning_content"], content_index=0)
        if d.get("content"):
            out += self._piece("message", "response.output_text.delta", d["content"],
                               content_index=0, logprobs=[])
        for c in d.get("tool_calls", ()):
            kind, fn = ("call", c["index"]), c["function"]
            if "id" in c:
                out += self._start(kind, {"id": c["id"], "type": "function",
                                          "function": {"name": fn["name"], "arguments": ""}})
            if fn.get("arguments") and self.kind == kind:
                out += self._piece(kind, "response.function_call_arguments.delta",
                                   fn["arguments"])
        return out

    def close(self) -> list[str]:
        """The last item done (an answer of nothing is one empty message)."""
        out = self._start("message") if not self.done and self.kind is None else []
        return out + self._finish()


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
            body, p = await gw.parse(_parse, raw, cfg)
            run = gw.start(p.ids, p.max_tokens, p.sampling, p.stops)
        except ApiError as e:
            return err(e)
        sampling = p.sampling
        # an answer with tool calls (or reasoning) to split off
        reader = p.reader() if p.tools or p.reasoning else None
        rid, mid = "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24]
        created = int(time.time())

        def answer() -> tuple[str, list[dict], str | None]:
            text = run.visible(final=True)
            if not reader:
                return text, [], None
            a = tools.parse(text, **reader)
            return a.content, a.tool_calls or [], a.reasoning

        def output(text: str, calls: list[dict], thought: str | None) -> list[dict]:
            return ([reasoning_item("rs_" + mid.removeprefix("msg_"), thought, True)]
                    if thought else []) + \
                ([message_item(mid, text, True)] if text or not (calls or thought)
                 else []) + \
                [call_item(c) for c in calls]

        def response(status: str, output: list) -> dict:
            usage = None
            if status != "in_progress":
                u = run.usage()
                usage = {"input_tokens": u["prompt_tokens"],
                         "input_tokens_details": {"cached_tokens": run.cached_tokens},
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
                    "parallel_tool_calls": body.get("parallel_tool_calls", True),
                    "tool_choice": body.get("tool_choice", "auto" if body.get("tools")
                                            else "none"),
                    "tools": body.get("tools") or [],
                    "text": {"format": {"type": "text"}}, "truncation": "disabled",
                    "store": False, "metadata": body.get("metadata") or {},
                    "usage": usage}

        def status(calls: list) -> str:
            return "incomplete" if run.finish_reason() == "length" and not calls \
                else "completed"

        if p.stream:
            seq = [0]

            def event(kind: str, data: dict) -> str:
                data = {"type": kind, "sequence_number": seq[0], **data}
                seq[0] += 1
                return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

            sp = tools.StreamParser(**reader) if reader else None
            items = Items(event, mid)

            def deltas(piece: str) -> list[dict]:
                if sp is None:
                    return [{"content": piece}] if piece else []
                return sp.feed(piece)

            async def sse():
                yield event("response.created", {"response": response("in_progress", [])})
                yield event("response.in_progress", {"response": response("in_progress",
                                                                          [])})
                async for what in run.events():
                    for d in deltas(run.delta(final=what == "end")):
                        for e in items.delta(d):
                            yield e
                if run.failed:
                    e = run.error()
                    yield event("error", {"code": "server_error", "message": e.message,
                                          "param": None})
                    return
                called = False
                if sp is not None:
                    rest, called = sp.close()
                    for d in rest:
                        for e in items.delta(d):
                            yield e
                for e in items.close():
                    yield e
                st = status([True] if called else [])
                yield event(f"response.{st}", {"response": response(st, items.done)})

            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        await run.whole(request)
        if run.failed:
            return err(run.error())
        text, calls, thought = answer()
        return JSONResponse(response(status(calls), output(text, calls, thought)))

    return [Route("/v1/responses", responses, methods=["POST"])]
