"""What an OpenAI request to ``serve`` may hold: the body's bytes, its JSON, every field.

Everything a client sends is checked here, on the HTTP side, before anything
reaches the scheduler: a bad value is a 400 (413 for a body over the cap)
naming the field, never a failure inside the pipeline. Pure functions of the
bytes and a :class:`ServeConfig`; nothing here knows HTTP or MPI.

Bounds (docs/serve.md): integers within int64 or tighter (``seed`` in
[0, 2**63 - 1], ``max_tokens`` and ``top_k`` below 2**31); floats finite;
strings valid Unicode (no lone surrogates); the JSON nested at most
:data:`MAX_DEPTH` deep; a prompt no longer than the context (refused before
tokenizing when its bytes alone prove it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm import grammar
from hpcmac.llm import tools as tools_mod
from hpcmac.llm.model.sampling import SamplingParams

#: fields we honour, per endpoint; others OpenAI defines but we do not implement are
#: refused by name (400) rather than silently ignored
_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "seed", "stop", "n", "stream", "stream_options", "user", "logprobs",
           "repetition_penalty", "draft_k"}
FIELDS = {"chat": _COMMON | {"messages", "response_format", "tools", "tool_choice",
                             "parallel_tool_calls", "top_logprobs", "chat_template_kwargs"},
          "completion": _COMMON | {"prompt", "response_format"}}
#: deepest JSON nesting a body may have (a chat request needs 4)
MAX_DEPTH = 32
I32_MAX, I64_MAX = 2**31 - 1, 2**63 - 1
#: a role is a plain word (it is written into the chat template as it is)
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")
_STOPS, _STOP_CHARS, _USER_CHARS = 4, 1024, 256
#: a JSON string (an unrolled loop: linear, no backtracking)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SURROGATE = re.compile("[\ud800-\udfff]")


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
    max_body: int = 8 * 2**20  # bytes (--max-body-mb)
    special_in_prompts: bool = False  # --special-tokens-in-prompts
    draft_k: int = 0  # --draft-k with a drafter (speculative decoding), else 0

    def __post_init__(self):
        if self.tok is not None:  # build the text-only tokenizer now, not in a request
            self.tok.encode("", special=False)


# -- the body ------------------------------------------------------------------------------

def json_depth(raw: bytes) -> int:
    """The deepest ``[``/``{`` nesting of the JSON text ``raw``, counted on the bytes
    (strings skipped) before any parser recurses into it."""
    a = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    step = np.zeros(a.size, dtype=np.int8)
    step[(a == ord("[")) | (a == ord("{"))] = 1
    step[(a == ord("]")) | (a == ord("}"))] = -1
    nz = step[step != 0]
    return int(np.cumsum(nz, dtype=np.int64).max()) if nz.size else 0


def load_body(raw: bytes):
    """The JSON value of a request body, or ApiError(400) saying why not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 (byte {exc.start})") from None
    depth = json_depth(raw)
    if depth > MAX_DEPTH:
        raise ApiError(400, f"the body is nested {depth} deep; at most {MAX_DEPTH} is allowed")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: also over-long integers
        raise ApiError(400, f"the body is not valid JSON ({str(exc)[:120]})") from None


def _bad_strings(obj, path: str):
    """Paths of strings (values and keys) in ``obj`` that hold a lone surrogate, which no
    text encoding can carry (JSON lets ``\\ud800`` through)."""
    if isinstance(obj, str):
        if _SURROGATE.search(obj):
            yield path
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _bad_strings(v, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            sub = f"{path}.{k}" if path else str(k)
            if _SURROGATE.search(k):
                yield (path or "body") + " (a key)"
            else:
                yield from _bad_strings(v, sub)


# -- fields --------------------------------------------------------------------------------

def _number(body: dict, name: str, kind, default, lo=None, hi=None, lo_open=False):
    """``body[name]`` as ``kind`` within [lo, hi] (``(lo, hi]`` with ``lo_open``), or its
    default when absent or null; ApiError(400) naming the field otherwise (a bool, a
    string, NaN, an infinity, a fraction for an integer, a value out of range)."""
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok and isinstance(v, float):
        ok = math.isfinite(v) and (kind is float or v.is_integer())
    if ok and lo is not None and (v <= lo if lo_open else v < lo):
        ok = False
    if ok and hi is not None and v > hi:
        ok = False
    if not ok:
        rng = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
        rng += f"{' and ' if rng else ''}<= {hi}" if hi is not None else ""
        what = "an integer" if kind is int else "a finite number"
        raise ApiError(400, f"'{name}' must be {what}{' ' + rng if rng else ''}; "
                            f"got {_show(v)}", name)
    return kind(v)


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, int) or abs(v) < 10**30 else \
        f"an integer of {len(str(abs(v)))} digits"
    return text[:40]


@dataclass
class Parsed:
    """A checked request: what the scheduler needs, and how to read its answer back."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    tools: tools_mod.ToolSpec | None = None  # chat with tools (not tool_choice none)
    reasoning: str | None = None  # chat: the template's reasoning style (tools.reasoning_style)
    think_open: bool = False  # chat: the prompt ends inside <think>

    def reader(self, family: str = "hermes") -> dict:
        """The keyword arguments of :func:`hpcmac.llm.tools.parse` / ``StreamParser``."""
        return {"fam": self.tools.family if self.tools else family, "spec": self.tools,
                "style": self.reasoning, "think_open": self.think_open}


def parse(body, endpoint: str, cfg: ServeConfig) -> tuple[list[int], int, SamplingParams,
                                                          tuple[str, ...], bool]:
    """(prompt ids, max_tokens, sampling, stop strings, stream) of a request body, or
    ApiError(400/404) naming the field (:func:`parse_request` has the rest)."""
    p = parse_request(body, endpoint, cfg)
    return p.ids, p.max_tokens, p.sampling, p.stops, p.stream


def parse_request(body, endpoint: str, cfg: ServeConfig) -> Parsed:
    """The checked request, or ApiError(400/404) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for path in _bad_strings(body, ""):
        raise ApiError(400, f"'{path}' holds a lone surrogate code point (not valid "
                            "Unicode text)", path.split(" ")[0])
    unknown = sorted(set(body) - FIELDS[endpoint])
    if unknown:
        raise ApiError(400, f"unsupported field(s): {', '.join(unknown)[:200]}", unknown[0])
    if body.get("model") not in (None, cfg.model_id):
        raise ApiError(404, f"the model '{str(body.get('model'))[:80]}' does not exist; "
                            f"this server serves '{cfg.model_id}'", "model",
                       code="model_not_found")
    n = _number(body, "n", int, 1, lo=1, hi=I32_MAX)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", "n")
    want = _logprobs(body, endpoint)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and set(opts) <= {"include_usage"}
                                 and isinstance(opts.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be {\"include_usage\": true or false}",
                       "stream_options")
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and len(user) <= _USER_CHARS):
        raise ApiError(400, f"'user' must be a string of at most {_USER_CHARS} characters",
                       "user")
    # both given: max_completion_tokens wins (OpenAI's newer name); each is checked
    try:
        spec = tools_mod.check(body) if endpoint == "chat" else None
    except tools_mod.ToolError as exc:
        raise ApiError(400, exc.message, exc.param) from None
    if spec is not None and cfg.tok is not None:
        spec.family = tools_mod.family(cfg.tok.chat_template)
        spec.rendered = tools_mod.writes_tools(cfg.tok.chat_template)
        spec.v3_form = tools_mod.deepseek_v3_form(cfg.tok.chat_template)
    if spec is not None and spec.forced and body.get("response_format") is not None:
        raise ApiError(400, "'response_format' cannot be combined with a required or named "
                            "'tool_choice'", "response_format")
    limits = [_number(body, k, int, None, lo=1, hi=I32_MAX)
              for k in ("max_tokens", "max_completion_tokens")]
    max_tokens = limits[1] or limits[0] or cfg.default_max_tokens
    sampling = SamplingParams(
        temperature=_number(body, "temperature", float, 1.0, lo=0, hi=2),
        top_k=_number(body, "top_k", int, 0, lo=0, hi=I32_MAX),
        top_p=_number(body, "top_p", float, 1.0, lo=0, hi=1, lo_open=True),
        repetition_penalty=_number(body, "repetition_penalty", float, 1.0, lo=0,
                                   lo_open=True),
        seed=_number(body, "seed", int, None, lo=0, hi=I64_MAX),
        logprobs=want,
        grammar=compile_grammar(lambda t: grammar.lark(tools_mod.call_lark(spec, cfg.tok),
                                                       "tools", t), cfg)
        if spec is not None and spec.forced else response_format(body, cfg))
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= _STOPS and all(isinstance(s, str)
                                                                for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, f"'stop' must be a string or a list of at most {_STOPS} strings",
                       "stop")
    if any(len(s) > _STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop': each string may have at most {_STOP_CHARS} characters",
                       "stop")
    stops = tuple(s for s in stops if s)
    ids = _prompt_ids(body, endpoint, cfg, spec)
    if len(ids) >= cfg.context:
        raise _too_long(len(ids), endpoint, cfg)
    out = Parsed(ids, min(max_tokens, cfg.context - len(ids)), sampling, stops, stream, spec)
    if endpoint == "chat" and cfg.tok is not None:
        out.reasoning = tools_mod.reasoning_style(cfg.tok.chat_template)
        out.think_open = out.reasoning == "think" and \
            cfg.tok.decode(ids[-4:]).rstrip().endswith("<think>")
    return out


#: most likely tokens a request may ask for with each token (OpenAI's bound)
MAX_TOP_LOGPROBS = 20


def _logprobs(body: dict, endpoint: str) -> int:
    """How many top logprobs to return with each token, -1 for none: chat's ``logprobs``
    (true/false) and ``top_logprobs``; the completions' ``logprobs`` (an integer)."""
    if endpoint == "completion":
        return _number(body, "logprobs", int, -1, lo=0, hi=MAX_TOP_LOGPROBS)
    on = body.get("logprobs", False)
    if on is None:
        on = False
    if not isinstance(on, bool):
        raise ApiError(400, "'logprobs' must be true or false", "logprobs")
    top = _number(body, "top_logprobs", int, None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not on:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else -1


def response_format(body: dict, cfg: ServeConfig) -> str | None:
    """The grammar of ``response_format`` (hpcmac.llm.grammar; None for plain text), or
    ApiError(400) naming the field, or the schema path the engine cannot compile."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, "
                            "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", "
                            "\"json_schema\": {...}}", "response_format")
    if kind == "text":
        return None
    schema = True
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise ApiError(400, "'response_format.json_schema' must be an object whose "
                                "'schema' is a JSON schema object", "response_format")
        schema = js.get("schema", True)
    return compile_grammar(lambda t: grammar.json_schema(
        schema, "response_format.json_schema.schema" if kind == "json_schema"
        else "response_format", t), cfg)


def writes_tools(template) -> bool:
    return tools_mod.writes_tools(template)


def compile_grammar(build, cfg: ServeConfig) -> str:
    """``build(llguidance tokenizer)``'s grammar, or ApiError(400) naming its path."""
    if cfg.tok is None:
        raise ApiError(400, "constrained decoding needs the checkpoint's tokenizer",
                       "response_format")
    try:
        return build(grammar.ll_tokenizer(cfg.tok, cfg.vocab, cfg.eos_ids))
    except grammar.GrammarError as exc:
        raise ApiError(400, exc.message, exc.path) from None


def draft_k_of(body: dict, cfg: ServeConfig) -> int:
    """The request's draft tokens per speculative step: hpcmac's own field ``draft_k``
    (0 turns speculation off for it; at most the server's ``--draft-k``, its default),
    or ApiError(400) naming the field."""
    if cfg.draft_k == 0 and body.get("draft_k") not in (None, 0):
        raise ApiError(400, "'draft_k': this server has no draft (start it with "
                            "--draft-model or --draft ngram)", "draft_k")
    return _number(body, "draft_k", int, cfg.draft_k, lo=0, hi=cfg.draft_k)


def _too_long(n_tokens: int | None, endpoint: str, cfg: ServeConfig,
              n_bytes: int = 0) -> ApiError:
    has = f"{n_tokens} tokens" if n_tokens is not None else \
        f"{n_bytes} bytes of text, more tokens than that"
    return ApiError(400, f"the prompt has {has}; this server's context holds {cfg.context}",
                    "messages" if endpoint == "chat" else "prompt",
                    code="context_length_exceeded")


def _check_length(texts: list[str], endpoint: str, cfg: ServeConfig,
                  special: bool = False) -> None:
    """Refuse text longer than the context before tokenizing it whole: by its bytes alone
    (a token covers at most ``max_token_bytes`` bytes; twice that, for normalizers), then
    by counting its tokens piece by piece, stopping once past the context. The
    tokenizer holds the GIL while it encodes (1.2 s for 1.3 MB here), which would stall
    the scheduler's thread; a piece holds it a few milliseconds."""
    n = sum(len(t.encode("utf-8")) for t in texts)
    if n > 2 * cfg.tok.max_token_bytes * cfg.context:
        raise _too_long(None, endpoint, cfg, n)
    for text in texts:
        if _surely_over(cfg.tok, text, cfg.context, special):
            raise _too_long(None, endpoint, cfg, len(text.encode("utf-8")))


#: characters of text tokenized at once while counting; tokens a cut may add
_PIECE, _CUT_SLACK = 16384, 16


def _surely_over(tok, text: str, limit: int, special: bool) -> bool:
    """Whether ``text`` has more than ``limit`` tokens, counted on pieces cut before a
    space (so words stay whole; each cut is allowed ``_CUT_SLACK`` extra tokens)."""
    if len(text) <= _PIECE:
        return False  # the exact encode is cheap
    count = pieces = i = 0
    while i < len(text):
        j = min(len(text), i + _PIECE)
        if j < len(text):
            k = text.rfind(" ", i + _PIECE // 2, j)
            j = k if k > i else j
        count += len(tok.encode(text[i:j], add_bos=False, special=special))
        pieces += 1
        i = j
        if count > limit + _CUT_SLACK * pieces:
            return True
    return False


def _clean_message(i: int, m) -> dict:
    """messages[i] as the template gets it: role, text content, and an assistant's
    ``tool_calls`` or a tool's ``tool_call_id`` / ``name``; ApiError(400) otherwise."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(400, f"messages[{i}] must be an object with a 'role'", "messages")
    if not _ROLE.fullmatch(m["role"]):
        raise ApiError(400, f"messages[{i}].role must be a word (letters, digits, _ "
                            f"or -, at most 32); got {json.dumps(m['role'])[:40]}",
                       "messages")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are "
                                "supported", "messages")
        content = "".join(p["text"] for p in content)
    calls = m.get("tool_calls")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string", "messages")
    out = {"role": m["role"], "content": content}
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str)
                and isinstance(c["function"].get("arguments", ""), (str, dict))
                for c in calls):
            raise ApiError(400, f"messages[{i}].tool_calls must be an assistant's list of "
                                "{\"id\", \"type\": \"function\", \"function\": {\"name\", "
                                "\"arguments\"}}", "messages")
        out["tool_calls"] = [{"id": str(c.get("id", "")), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": c["function"].get("arguments", "")}}
                             for c in calls]
    for k in ("tool_call_id", "name"):
        if m.get(k) is not None:
            if not isinstance(m[k], str) or len(m[k]) > 256:
                raise ApiError(400, f"messages[{i}].{k} must be a string of at most 256 "
                                    "characters", "messages")
            out[k] = m[k]
    # an assistant's reasoning sent back (as the server returned it): the templates of
    # reasoning models show it again in a tool-call loop (Qwen3, GLM, MiniMax, gpt-oss)
    reasoning = m.get("reasoning_content")
    if reasoning is not None and m["role"] == "assistant":
        if not isinstance(reasoning, str):
            raise ApiError(400, f"messages[{i}].reasoning_content must be a string",
                           "messages")
        out["reasoning_content"] = reasoning
    return out


#: a message key marking text the server wrote (its special-token strings stay special)
SERVER_TEXT = "_hpcmac_server_text"


def _with_tools(msgs: list[dict], spec, template: str | None) -> list[dict]:
    """Messages for a template that shows no tools: the tools in a system message, in
    the family's words; an assistant's calls written into its content (hermes style, which
    we then parse) unless the template writes calls itself (DeepSeek V3.1's does)."""
    out = [dict(m) for m in msgs]
    for m in out:
        if m.get("tool_calls") and "tool_calls" not in (template or ""):
            call_text = tools_mod.hermes_call_text(m.pop("tool_calls"))
            m["content"] = (m["content"] + "\n" if m["content"] else "") + call_text
    if spec is not None:
        text = tools_mod.system_text(spec.tools, spec.family, template)
        if spec.family == "deepseek":  # its markers are the vocabulary's: our own message,
            # which chat_ids encodes with them (a client's text it encodes as text); the
            # template joins system messages as the card's layout has them
            out.insert(1 if out and out[0]["role"] == "system" else 0,
                       {"role": "system", "content": text, SERVER_TEXT: True})
        elif out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def template_input(clean: list[dict], spec, template: str | None
                   ) -> tuple[list[dict], list[dict] | None]:
    """The messages and the ``tools=`` a chat template gets for a request's cleaned
    messages and tools (``spec``, or None): the tools go to the template when it shows
    them, else into a system message."""
    shown = spec.rendered if spec is not None else writes_tools(template)
    if not shown:
        clean = _with_tools(clean, spec, template)
    given = spec.tools if spec is not None and shown else None
    if given and spec.family == "harmony":  # gpt-oss's template reads every description
        given = [dict(t, function={"description": "", **t["function"]}) for t in given]
    # Llama 3.x's templates take one call a turn: a turn of several is sent back as
    # several turns
    return tools_mod.template_messages(clean, one_call=tools_mod.family(template) ==
                                       "llama3"), given


#: what a chat template is handed itself: a chat_template_kwargs key may not be one
_TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
_KWARGS = 16


def template_kwargs(body: dict) -> dict:
    """``chat_template_kwargs``: more variables for the chat template (``enable_thinking``
    for Qwen3's, ``thinking`` for DeepSeek V3.1's, ``reasoning_effort`` for gpt-oss's),
    at most 16, each a name and a JSON value; 400 naming the field otherwise."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict) or len(kw) > _KWARGS or not all(
            isinstance(k, str) and k.isidentifier() for k in kw):
        raise ApiError(400, f"'chat_template_kwargs' must be an object of at most {_KWARGS} "
                            "variables, each named like an identifier", "chat_template_kwargs")
    clash = sorted(set(kw) & _TEMPLATE_OWN)
    if clash:
        raise ApiError(400, f"'chat_template_kwargs': '{clash[0]}' is the template's own "
                            "variable", "chat_template_kwargs")
    return kw


def _prompt_ids(body: dict, endpoint: str, cfg: ServeConfig, spec=None) -> list[int]:
    tok = cfg.tok
    if endpoint == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", "messages")
        if len(msgs) >= cfg.context:  # each takes a token at least
            raise ApiError(400, f"{len(msgs)} messages do not fit this server's context of "
                                f"{cfg.context} tokens", "messages",
                           code="context_length_exceeded")
        clean = [_clean_message(i, m) for i, m in enumerate(msgs)]
        if tok is None:
            raise ApiError(400, "this checkpoint has no tokenizer: use /v1/completions with "
                                "a prompt of token ids", "messages")
        _check_length([m["content"] + m.get("reasoning_content", "") for m in clean],
                      endpoint, cfg)
        calls_text = json.dumps([[m.get("tool_calls"), m.get("reasoning_content")]
                                 for m in clean] + [spec.tools if spec else None],
                                ensure_ascii=False)
        if any(t in calls_text for t in tok.specials):
            raise ApiError(400, "a tool call, a tool or a reasoning_content holds a "
                                "special-token string; refused",
                           "tools" if spec and any(t in json.dumps(spec.tools,
                                                                   ensure_ascii=False)
                                                   for t in tok.specials) else "messages")
        messages, shown_tools = template_input(clean, spec, tok.chat_template)
        kwargs = template_kwargs(body)
        try:
            return chat_ids(tok, messages, limit=cfg.context, tools=shown_tools,
                            variables=kwargs)
        except TooLong as exc:
            raise _too_long(None, endpoint, cfg, exc.args[0]) from None
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None
        except UsageError as exc:  # the template refused them (its raise_exception)
            raise ApiError(400, f"{exc} (the checkpoint's chat template refused these "
                                "messages)", "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tok is None:
            raise ApiError(400, "this checkpoint has no tokenizer: give the prompt as a list "
                                "of token ids", "prompt")
        _check_length([prompt], endpoint, cfg, cfg.special_in_prompts)
        ids = tok.encode(prompt, special=cfg.special_in_prompts)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < cfg.vocab]
        if bad:
            raise ApiError(400, f"token {_show(bad[0])} is outside the vocabulary "
                                f"[0, {cfg.vocab})", "prompt")
        ids = list(prompt)
    else:
        raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids",
                       "prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    return ids


# -- chat ----------------------------------------------------------------------------------

class TooLong(ValueError):
    """The rendered prompt has more tokens than the limit (args: its bytes)."""


def chat_ids(tok, messages: list[dict], limit: int | None = None,
             tools: list[dict] | None = None, variables: dict | None = None) -> list[int]:
    """Token ids of ``messages`` through the checkpoint's chat template, as transformers'
    ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)``: a template
    that writes ``bos_token`` itself is encoded without another BOS.

    The template's own control tokens are special; the messages' text is text: a
    special-token string a user writes (``<|im_start|>``) becomes ordinary tokens, so
    it cannot open a role. (Each content is rendered as a marker, and the pieces
    between markers are encoded with special tokens, the contents without, but for
    the server's own text, a message marked :data:`SERVER_TEXT`.)
    With ``limit``, a rendered prompt of more tokens is :class:`TooLong`, found before
    it is tokenized whole. ``variables``: more variables for the template
    (``chat_template_kwargs``).
    """
    writes_bos = bool(tok.bos_token) and "bos_token" in (tok.chat_template or "")
    kwargs = variables or {}
    specials = tok.specials
    ours = [bool(m.get(SERVER_TEXT)) for m in messages]  # the server's own text: special
    if not any(s in m["content"] for m, o in zip(messages, ours) if not o for s in specials):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                       **kwargs)
        if limit is not None and _surely_over(tok, text, limit, True):
            raise TooLong(len(text.encode("utf-8")))
        return tok.encode(text, add_bos=False) if writes_bos else tok.encode(text)
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    if any("\ue000" in m["content"] for m in messages):
        raise ValueError("a message holds a special-token string and the character "
                         "U+E000; refused")
    text = tok.apply_chat_template([dict(m, content=k) for m, k in zip(messages, marks)],
                                   add_generation_prompt=True, tools=tools, **kwargs)
    if limit is not None and _surely_over(tok, text, limit, True):
        raise TooLong(len(text.encode("utf-8")))
    pos = [text.find(k) for k in marks]
    if any(text.count(k) != 1 for k in marks) or pos != sorted(pos):
        raise ValueError("a message holds a special-token string, and this chat template "
                         "does not keep message text as it is; refused")
    ids: list[int] = []
    rest = text
    for m, k, o in zip(messages, marks, ours):
        head, rest = rest.split(k, 1)
        ids += tok.encode(head, add_bos=False if writes_bos or ids else None)
        ids += tok.encode(m["content"], add_bos=False, special=o)
    ids += tok.encode(rest, add_bos=False)
    return ids
