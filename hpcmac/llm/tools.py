"""Tool calls, OpenAI style: the request's tools checked, each family's call format parsed
(whole, or as it streams), and the grammar that makes ``tool_choice`` required or named.

Families (detected from the checkpoint's chat template, :func:`family`), as their own
templates write a call:

* ``hermes`` (Qwen2.5, Qwen3, Qwen3.5, and the fallback for a template without tools):
  ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, or Qwen3-Coder's and
  Qwen3.5's ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n
  </tool_call>``;
* ``llama3``: ``{"name": N, "parameters": {...}}`` (after ``<|python_tag|>`` or alone),
  several joined by ``;``; or Llama 3.2's and 3.3's pythonic list, ``[N(k=V, ...), ...]``
  (Meta's prompt-format docs: Python literals, ``'...'`` strings too);
* ``harmony`` (gpt-oss): ``<|channel|>commentary to=functions.N <|constrain|>json<|message|>
  {...}`` ending with ``<|call|>``; the ``analysis`` channel is the reasoning;
* ``deepseek`` (V3.x): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`` (V3's ``function<｜tool▁sep｜>N\\n```json ...```
  too);
* ``dsml`` (DeepSeek V3.2): ``<｜DSML｜function_calls>\\n<｜DSML｜invoke name="N">\\n
  <｜DSML｜parameter name="K" string="true">V</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n
  </｜DSML｜function_calls>`` (``string="false"``: the value is JSON);
* ``kimi`` (K2): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.N:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|><|tool_calls_section_end|>``, or the
  XML form K2 falls back to, ``<tool_call>\n<invoke name="N">\n<parameter name="K">V
  </parameter>\n</invoke>\n</tool_call>``;
* ``glm`` (4.5 to 4.7): ``<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>
  </tool_call>``;
* ``minimax`` (M2): ``<minimax:tool_call>\\n<invoke name="N">\\n<parameter name="K">V
  </parameter>\\n</invoke>\\n</minimax:tool_call>``.

In the XML-like formats a value is its text when the tool's schema says string, else
JSON (``True``/``False``/``None`` too, as Qwen3-Coder's and Qwen3.5's templates write
them). Reasoning (``<think>...</think>``, harmony's analysis channel) is split off as
``reasoning_content``. Everything here takes and returns plain OpenAI-shaped dicts.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
FAMILIES = ("hermes", "llama3", "harmony", "deepseek", "dsml", "kimi", "glm", "minimax")


class ToolError(ValueError):
    """A bad ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (``param`` names it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass
class ToolSpec:
    """What a chat request asked of tools (rank 0, the HTTP side)."""

    tools: list[dict]  # [{"type": "function", "function": {"name", "description", "parameters"}}]
    choice: str = "auto"  # auto | none | required | a function's name (named)
    parallel: bool = True
    family: str = "hermes"
    rendered: bool = True  # the template writes the tools itself (else we add a system text)
    think_open: bool = False  # the prompt ends inside <think> (the answer starts reasoning)
    v3_form: bool = False  # deepseek: the template writes V3's form (deepseek_v3_form)
    names: set = field(default_factory=set)

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")


# -- the request ----------------------------------------------------------------------------

def check(body: dict) -> ToolSpec | None:
    """The request's tools, choice and parallel flag, or None without tools (or with
    ``tool_choice: none``); ToolError naming the field."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise ToolError("'tools' must be a list of at most 128 tools", "tools")
    clean = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(fn, dict)):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                            "{...}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError(f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                            "_ . : or -", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                            "tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"tools[{i}].function.description must be a string", "tools")
        f = {"name": name, "parameters": params}
        if desc is not None:
            f["description"] = desc
        clean.append({"type": "function", "function": f})
    names = [t["function"]["name"] for t in clean]
    if len(set(names)) != len(names):
        raise ToolError("'tools': two tools have the same name", "tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if name not in names:
            raise ToolError("'tool_choice' names no tool of 'tools'", "tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise ToolError("'tool_choice' must be auto, none, required or {\"type\": "
                        "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice == "none":
        return None
    return ToolSpec(clean, choice, parallel, names=set(names))


def family(template: str | None) -> str:
    """The tool-call format a chat template writes (``hermes`` when it shows none)."""
    t = template or ""
    if "<|channel|>" in t:
        return "harmony"
    if _DSML_TAG in t:
        return "dsml"
    if "tool\u2581calls\u2581begin" in t:
        return "deepseek"
    if "tool_calls_section_begin" in t or "tool_call_argument_begin" in t:
        return "kimi"
    if "minimax:tool_call" in t:
        return "minimax"
    if "<arg_key>" in t:
        return "glm"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("ipython" in t and "parameters" in t):
        return "llama3"
    return "hermes"


def reasoning_style(template: str | None) -> str | None:
    """How a template's answers carry reasoning: ``think``, ``harmony`` or None."""
    t = template or ""
    if "<|channel|>" in t:
        return "harmony"
    return "think" if "<think>" in t or "</think>" in t else None


def writes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def deepseek_v3_form(template: str | None) -> bool:
    """Whether a ``deepseek`` template writes V3's (and R1's) call form, ``function``, the
    separator, the name and the arguments in a json fence (else V3.1's: the name, the
    separator, the arguments)."""
    return "```json" in (template or "")


def system_text(tools: list[dict], fam: str = "hermes", template: str | None = None) -> str:
    """The tools as a system message, for a template that shows none: DeepSeek V3.1's
    block (its model card's; its template writes calls but not the tools), with the call
    in the form the template writes (V3's and R1's: ``function`` and a json fence, as
    their templates write a call), else hermes."""
    if fam == "deepseek":
        calls_b, calls_e, b, e, sep = _DS
        call = f"{b}function{sep}tool_call_name\n```json\ntool_call_arguments\n```{e}" \
            if deepseek_v3_form(template) else f"{b}tool_call_name{sep}tool_call_arguments{e}"
        listed = "".join(f"### {t['function']['name']}\nDescription: "
                         f"{t['function'].get('description', '')}\n\nParameters: "
                         f"{json.dumps(t['function']['parameters'], ensure_ascii=False)}\n\n"
                         for t in tools)
        return ("## Tools\nYou have access to the following tools:\n\n" + listed +
                "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                f"{calls_b}{call}{{additional_tool_calls}}{calls_e}\n\nWhere:\n"
                "- `tool_call_name` must be an exact match to one of the available tools\n"
                "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
                "Parameters Schema\n"
                "- For multiple tool calls, chain them directly without separators or spaces")
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
            "</tool_call>")


def hermes_call_text(calls: list[dict]) -> str:
    """Assistant ``tool_calls`` written into its content (a template that shows none)."""
    out = []
    for c in calls:
        f = c.get("function") or {}
        out.append("<tool_call>\n" + json.dumps({"name": f.get("name"),
                                                 "arguments": _args_obj(f.get("arguments"))},
                                                ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(out)


def _args_obj(a):
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def one_call_a_turn(messages: list[dict]) -> list[dict]:
    """An assistant turn of several calls as one turn per call, each followed by its
    tool's reply (matched by ``tool_call_id``, else in order), for a template that
    takes one call a turn (Llama 3.x's raise otherwise): the model's own parallel
    answer under ``auto`` can then be sent back. The turn's text stays with its first
    call; replies that match no call follow the last."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        if m.get("role") != "assistant" or len(calls) < 2:
            out.append(m)
            i += 1
            continue
        j = i + 1
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        replies = list(messages[i + 1:j])
        for k, c in enumerate(calls):
            out.append(dict(m, tool_calls=[c]) if k == 0 else
                       {"role": "assistant", "content": "", "tool_calls": [c]})
            got = next((r for r in replies if r.get("tool_call_id") == c.get("id")), None)
            if got is None and replies and replies[0].get("tool_call_id") not in \
                    {x.get("id") for x in calls}:
                got = replies[0]
            if got is not None:
                replies.remove(got)
                out.append(got)
        out += replies
        i = j
    return out


def template_messages(messages: list[dict], one_call: bool = False) -> list[dict]:
    """Messages as transformers hands them to a template: assistant ``tool_calls`` whose
    ``arguments`` are JSON text get them as objects (templates write them with tojson),
    and an assistant's ``reasoning_content`` is also its ``thinking`` (gpt-oss's name);
    with ``one_call``, one call a turn (:func:`one_call_a_turn`)."""
    out = []
    if one_call:
        messages = one_call_a_turn(messages)
    for m in messages:
        if m.get("reasoning_content") is not None:
            m = {"thinking": m["reasoning_content"], **m}
        calls = m.get("tool_calls")
        if calls:
            m = dict(m, tool_calls=[dict(c, function=dict(c.get("function") or {},
                                                          arguments=_args_obj(
                                                              (c.get("function") or {}).get(
                                                                  "arguments"))))
                                    for c in calls])
        out.append(m)
    return out


# -- parsing ---------------------------------------------------------------------------------

def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: str, args, spec: ToolSpec | None) -> dict | None:
    """An OpenAI tool call, or None when it is not one (unknown name, args not an object)."""
    if spec is not None and name not in spec.names:
        return None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _props(spec: ToolSpec | None, name: str) -> dict:
    if spec is None:
        return {}
    for t in spec.tools:
        if t["function"]["name"] == name:
            return (t["function"].get("parameters") or {}).get("properties") or {}
    return {}


#: how Python writes the JSON constants (Qwen3-Coder's and Qwen3.5's templates write a
#: non-container value with ``| string``: ``True``, ``None``), read back by the schema
_PY_CONST = {"True": True, "False": False, "None": None}


def _value(text: str, schema) -> object:
    """An XML-like parameter's value: its text for a string parameter, else JSON (a
    boolean or null also as Python writes it; the text when it is neither)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if "string" in kinds:
        return text
    try:
        return json.loads(text)
    except ValueError:
        if text.strip() in _PY_CONST and kinds & {"boolean", "null", None}:
            return _PY_CONST[text.strip()]
        return text


_JSON_DEC = json.JSONDecoder()


def _json_objects(text: str, sep: str) -> list | None:
    """Consecutive JSON objects in ``text`` separated by ``sep`` or whitespace; None if any
    other text is there."""
    out, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == sep):
            i += 1
        if i == len(text):
            return out
        try:
            obj, i = _JSON_DEC.raw_decode(text, i)
        except ValueError:
            return None
        out.append(obj)


def _blocks(pattern: str, text: str, one) -> list | None:
    """The calls of ``text`` when it is nothing but matches of ``pattern`` (whitespace
    apart): each match's groups read by ``one`` into a call or a list of calls; None
    when one of them is not a call, when there is none, or when anything else is left."""
    calls = []
    for groups in re.findall(pattern, text, re.S):
        got = one(*groups) if isinstance(groups, tuple) else one(groups)
        if got is None:
            return None
        calls += got if isinstance(got, list) else [got]
    left = re.sub(pattern, "", text, flags=re.S)
    return calls if calls and not left.strip() else None


def _hermes(region: str, spec) -> list | None:
    def one(body: str) -> dict | None:
        b = body.strip()
        m = re.fullmatch(r"<function=([^>\n]+)>(.*?)</function>", b, re.S)
        if m:
            name, props = m.group(1).strip(), _props(spec, m.group(1).strip())
            args = {k: _value(v.strip("\n"), props.get(k)) for k, v in
                    re.findall(r"<parameter=([^>\n]+)>(.*?)</parameter>", m.group(2), re.S)}
            return _call(name, args, spec)
        try:
            obj = json.loads(b)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        return _call(obj["name"], obj.get("arguments", obj.get("parameters", {})), spec)

    return _blocks(r"<tool_call>(.*?)</tool_call>", region, one)


#: JSON's constants as a pythonic call may write them (the rest is Python literals)
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _py_value(node):
    """A pythonic call's argument value: a Python literal (or JSON's true/false/null);
    ValueError for anything else (a name, a call, an expression)."""
    import ast

    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_py_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_py_value(k): _py_value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _pythonic(region: str, spec) -> list | None:
    """Llama 3.2's and 3.3's ``[N(k=V, ...), ...]``: each call's name and keyword
    arguments (literals only: nothing is evaluated); None when it is not that."""
    import ast

    text = region.replace("<|python_tag|>", "").strip()
    if not text.startswith("["):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args and all(k.arg for k in node.keywords)):
            return None
        try:
            args = {k.arg: _py_value(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError):
            return None
        c = _call(node.func.id, args, spec)
        if c is None:
            return None
        calls.append(c)
    return calls


def _py_end(text: str, i: int) -> int | None:
    """Where a pythonic value that starts at ``text[i]`` ends (at the ``,`` or ``)``
    after it, outside strings and brackets), or None while it is still arriving."""
    depth, quote, esc = 0, "", False
    for j in range(i, len(text)):
        ch = text[j]
        if quote:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return j if ch == ")" else None
            depth -= 1
        elif ch == "," and depth == 0:
            return j
    return None


#: a pythonic call's ``name(``, and a keyword argument's ``k=`` (each after a comma but
#: the first)
_PY_CALL = re.compile(r"\s*,?\s*([A-Za-z_][A-Za-z0-9_]*)\(")
_PY_KEY = re.compile(r"\s*,?\s*(?:([A-Za-z_][A-Za-z0-9_]*)\s*=\s*)?")


def _pythonic_partial(region: str, spec) -> list[tuple[str, str, bool]]:
    """The pythonic calls so far, as :func:`_partial_calls` gives them: a call once its
    ``name(`` is written, its arguments one whole parameter at a time."""
    import ast

    out: list[tuple[str, str, bool]] = []
    r = region.replace("<|python_tag|>", "")
    i = len(r) - len(r.lstrip())
    if r[i:i + 1] != "[":
        return out
    i += 1
    while True:
        m = _PY_CALL.match(r, i)
        if m is None:
            return out
        name, i, pairs = m.group(1), m.end(), []
        while True:
            k = _PY_KEY.match(r, i)
            i = k.end()
            if r[i:i + 1] == ")":  # the call is whole
                out.append((name, _xml_args(pairs, None, True), True))
                i += 1
                break
            end = _py_end(r, i) if k.group(1) else None
            if end is None:
                out.append((name, _xml_args(pairs, None, False), False))
                return out
            try:
                v = _py_value(ast.parse(r[i:end].strip(), mode="eval").body)
            except (SyntaxError, ValueError, TypeError):
                out.append((name, _xml_args(pairs, None, False), False))
                return out
            pairs.append((k.group(1), v))
            i = end


def _llama3(region: str, spec) -> list | None:
    if region.replace("<|python_tag|>", "").lstrip().startswith("["):
        return _pythonic(region, spec)
    objs = _json_objects(region.replace("<|python_tag|>", ""), ";")
    if not objs:
        return None
    calls = []
    for o in objs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            return None
        c = _call(o["name"], o.get("parameters", o.get("arguments", {})), spec)
        if c is None:
            return None
        calls.append(c)
    return calls


_DS = ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>",
       "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>",
       "<\uff5ctool\u2581sep\uff5c>")


def _deepseek(region: str, spec) -> list | None:
    calls_b, calls_e, b, e, sep = _DS
    body = region.strip()
    if not body.startswith(calls_b):
        return None

    def one(item: str) -> dict | None:
        if sep not in item:
            return None
        head, tail = item.split(sep, 1)
        if head.strip() == "function" and "```" in tail:  # V3: function<sep>name\n```json
            name, _, rest = tail.partition("\n")
            m = re.search(r"```(?:json)?\s*(.*?)\s*```", rest, re.S)
            return _call(name.strip(), m.group(1) if m else "", spec)
        return _call(head.strip(), tail.strip(), spec)

    body = body[len(calls_b):].rstrip().removesuffix(calls_e)
    return _blocks(re.escape(b) + "(.*?)" + re.escape(e), body, one)


#: DeepSeek V3.2's markup: its tag, then the calls' block, a call and a parameter as its
#: template writes them (the tag after each "<" and "</"). The model also writes them
#: without the tag (as deepseek-ai/DeepSeek-V3.2's discussion #29 records): the parser
#: reads an answer with the tag taken out (:func:`_untag`), the grammar writes it.
_DSML_TAG = "\uff5cDSML\uff5c"
_DSML_PLAIN = ("<function_calls>", "</function_calls>", '<invoke name="', "</invoke>",
               '<parameter name="', "</parameter>")
_DSML = tuple(m.replace("<", "<" + _DSML_TAG).replace("<" + _DSML_TAG + "/",
                                                      "</" + _DSML_TAG) for m in _DSML_PLAIN)
_DSML_PARAM = re.compile(re.escape(_DSML_PLAIN[4]) + r'([^"]+)"\s+string="(true|false)"\s*>'
                         r"(.*?)" + re.escape(_DSML_PLAIN[5]), re.S)


def _untag(text: str, fam: str) -> str:
    """DeepSeek V3.2's answer with its markup's tag taken out (other families': as is)."""
    return text.replace(_DSML_TAG, "") if fam == "dsml" else text


def _dsml_args(inner: str, props: dict) -> dict:
    """A V3.2 call's parameters: ``string="true"`` ones as their text, the others JSON
    (read by the schema when they are not)."""
    out = {}
    for k, is_text, v in _DSML_PARAM.findall(inner):
        if is_text == "true":
            out[k] = v
            continue
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = _value(v, props.get(k))
    return out


def _dsml(region: str, spec) -> list | None:
    body = region.strip()
    if not body.startswith(_DSML_PLAIN[0]):
        return None
    body = body[len(_DSML_PLAIN[0]):].rstrip().removesuffix(_DSML_PLAIN[1])
    pat = re.escape(_DSML_PLAIN[2]) + r'([^"]+)">(.*?)' + re.escape(_DSML_PLAIN[3])
    return _blocks(pat, body, lambda name, inner: _call(
        name, _dsml_args(inner, _props(spec, name)), spec))


_KIMI = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_argument_begin|>", "<|tool_call_end|>")


#: the XML form Kimi K2 also writes a call in (its blocks hold MiniMax's invokes)
_KIMI_XML = ("<tool_call>", "</tool_call>")


def _kimi(region: str, spec) -> list | None:
    sb, se, b, a, e = _KIMI
    body = region.strip()
    if body.startswith(_KIMI_XML[0]):
        return _blocks(re.escape(_KIMI_XML[0]) + "(.*?)" + re.escape(_KIMI_XML[1]), body,
                       lambda inner: _invokes(inner, spec))
    if not body.startswith(sb):
        return None
    body = body[len(sb):].rstrip().removesuffix(se)
    pat = re.escape(b) + r"\s*(.*?)\s*" + re.escape(a) + "(.*?)" + re.escape(e)
    return _blocks(pat, body, lambda ident, args: _call(
        ident.rsplit(":", 1)[0].removeprefix("functions."), args.strip(), spec))


def _glm(region: str, spec) -> list | None:
    def one(body: str) -> dict | None:
        name, _, rest = body.partition("<arg_key>")
        name = name.strip()
        props = _props(spec, name)
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>",
                           "<arg_key>" + rest if rest else "", re.S)
        return _call(name, {k.strip(): _value(v, props.get(k.strip())) for k, v in pairs}, spec)

    return _blocks(r"<tool_call>(.*?)</tool_call>", region, one)


def _invokes(text: str, spec) -> list | None:
    """The ``<invoke name="N"><parameter name="K">V</parameter>...</invoke>`` calls of a
    block (MiniMax's; Kimi's XML form): several, or none; None when one is no call."""
    calls = []
    for name, inner in re.findall(r'<invoke name="([^"]+)">(.*?)</invoke>', text, re.S):
        props = _props(spec, name)
        args = {k: _value(v.strip("\n"), props.get(k)) for k, v in
                re.findall(r'<parameter name="([^"]+)">(.*?)</parameter>', inner, re.S)}
        c = _call(name, args, spec)
        if c is None:
            return None
        calls.append(c)
    return calls


def _minimax(region: str, spec) -> list | None:
    return _blocks(r"<minimax:tool_call>(.*?)</minimax:tool_call>", region,
                   lambda block: _invokes(block, spec))


#: each family's first marker of a call region, and its parser of the region
STARTS = {"hermes": "<tool_call>", "llama3": None, "harmony": None, "deepseek": _DS[0],
          "kimi": _KIMI[0], "glm": "<tool_call>", "minimax": "<minimax:tool_call>",
          "dsml": _DSML_PLAIN[0]}
#: what else may begin a call region as it streams (held back from content until known)
_ALSO_STARTS = {"dsml": (_DSML[0],), "kimi": (_KIMI_XML[0],)}
_PARSERS = {"hermes": _hermes, "llama3": _llama3, "deepseek": _deepseek, "kimi": _kimi,
            "glm": _glm, "minimax": _minimax, "dsml": _dsml}


def _harmony(text: str) -> tuple[str, str, list[tuple[str, str]], bool]:
    """(reasoning, content, [(recipient, body)], complete?) of harmony messages."""
    reasoning, content, calls = [], [], []
    for i, msg in enumerate(re.split(r"<\|start\|>", text)):
        if not msg.strip():
            continue
        head, sep, body = msg.partition("<|message|>")
        if not sep:  # a header still arriving; or no harmony at all: text
            if i == 0 and "<|" not in head:
                content.append(head)
            return "".join(reasoning), "".join(content), calls, False
        body = re.split(r"<\|end\|>|<\|call\|>|<\|return\|>", body)[0]
        ch = re.search(r"<\|channel\|>\s*(\w+)", head)
        to = re.search(r"to=([^\s<]+)", head)
        channel = ch.group(1) if ch else "final"
        if to is not None:
            calls.append((to.group(1), body))
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return "".join(reasoning), "".join(content), calls, True


@dataclass
class Parsed:
    """One answer, split: what the message shows (OpenAI's assistant message fields)."""

    content: str
    reasoning: str | None = None
    tool_calls: list[dict] | None = None

    def message(self) -> dict:
        m: dict = {"role": "assistant", "content": self.content if self.content or
                   not self.tool_calls else None}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


def split_reasoning(text: str, style: str | None, think_open: bool) -> tuple[str | None, str, bool]:
    """(reasoning, the rest, reasoning finished?) of ``text`` (``think`` style)."""
    if style != "think":
        return None, text, True
    body = text
    if not think_open:
        stripped = body.lstrip()
        if not stripped.startswith("<think>"):
            return None, text, True
        body = stripped[len("<think>"):]
    if "</think>" not in body:
        return body.lstrip("\n"), "", False
    r, rest = body.split("</think>", 1)
    return r.strip("\n"), rest.lstrip("\n"), True


def parse(text: str, fam: str, spec: ToolSpec | None, style: str | None = None,
          think_open: bool = False) -> Parsed:
    """A whole answer: its reasoning, its content and its tool calls. Under ``auto`` a call
    that does not parse (or names no tool) stays content."""
    text = _untag(text, fam)
    if style == "harmony" or fam == "harmony":
        r, content, raw, _ = _harmony(text)
        calls = [_call(to.removeprefix("functions."), body.strip(), spec) for to, body in raw]
        if spec is None or not calls or None in calls:  # not a call: its text is content
            return Parsed(content + "".join(b for _, b in raw), r or None)
        return Parsed(content, r or None, calls if spec.parallel else calls[:1])
    reasoning, rest, _ = split_reasoning(text, style, think_open)
    if spec is None:
        return Parsed(rest, reasoning)
    head, region = _region(rest, fam)
    if region is None:
        return Parsed(rest, reasoning)
    calls = _PARSERS[fam](region, spec) or (_truncated(region, fam, spec) if spec.forced
                                             else None)
    if not calls:
        return Parsed(rest, reasoning)
    if not spec.parallel:
        calls = calls[:1]
    return Parsed(head.rstrip(), reasoning, calls)


#: where a call ends, and what closes the calls' section, per family
_ENDS = {"hermes": ("</tool_call>", ""), "glm": ("</tool_call>", ""), "llama3": ("}", ""),
         "deepseek": (_DS[3], _DS[1]), "kimi": (_KIMI[4], _KIMI[1]),
         "minimax": ("</invoke>\n", "</minimax:tool_call>"),
         "dsml": (_DSML_PLAIN[3] + "\n", _DSML_PLAIN[1])}


def _truncated(region: str, fam: str, spec) -> list | None:
    """The complete calls of a region cut short (max_tokens in a later call): a forced
    choice's grammar has kept every call before the cut valid."""
    end, close = _ENDS[fam]
    pos = len(region)
    while (pos := region.rfind(end, 0, pos)) > 0:
        calls = _PARSERS[fam](region[:pos + len(end)] + close, spec)
        if calls:
            return calls
    return None


def _region(text: str, fam: str) -> tuple[str, str | None]:
    """(text before the call region, the region or None)."""
    start = STARTS.get(fam)
    if start is None:  # llama3: the whole answer is the call, when it is one
        s = text.lstrip()
        return ("", text) if s[:1] in ("{", "[") or s.startswith("<|python_tag|>") \
            else (text, None)
    found = [i for m in (start, *_ALSO_STARTS.get(fam, ())) if (i := text.find(m)) >= 0]
    i = min(found, default=-1)
    return (text, None) if i < 0 else (text[:i], text[i:])


def _cut_open(text: str) -> str:
    """``text`` less a tail that may be the start of a special token (``<|...``)."""
    i = text.rfind("<")
    return text[:i] if i >= 0 and "|>" not in text[i:] and len(text) - i < 16 else text


def _object_end(text: str, i: int) -> int | None:
    """The end of the JSON object or array that opens at ``text[i]``, or None while it
    is still open (brackets counted outside strings; no parsing: the whole answer's
    parser judges it)."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _json_args(text: str, i: int = 0) -> tuple[str, bool, int] | None:
    """(the arguments object's text so far, whole?, where it ends) from ``text[i:]``,
    or None when they are not an object (then only the whole answer's parser reads them)."""
    while i < len(text) and text[i].isspace():
        i += 1
    if i == len(text):
        return "", False, i
    if text[i] != "{":
        return None
    end = _object_end(text, i)
    return (text[i:], False, len(text)) if end is None else (text[i:end], True, end)


def _xml_args(pairs: list[tuple[str, object]], props: dict | None, whole: bool) -> str:
    """The arguments of an XML-like call as JSON text, one whole parameter at a time (as
    :func:`_call` writes them, so the pieces join to the whole answer's arguments);
    ``props`` None: the values are already typed (a pythonic call's literals)."""
    items = [f"{json.dumps(k, ensure_ascii=False)}: "
             f"{json.dumps(v if props is None else _value(v, props.get(k)), ensure_ascii=False)}"
             for k, v in pairs]
    return "{" + ", ".join(items) + ("}" if whole else "")


#: a JSON call's head: its name, then its arguments' key (Hermes' and Llama 3.x's; Llama
#: 3.1 may write "type": "function" first)
_JSON_HEAD = re.compile(r'\s*\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:\s*'
                        r'"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')


def _json_head(text: str, i: int) -> tuple[str, int] | None:
    m = _JSON_HEAD.match(text, i)
    if m is None:
        return None
    try:
        return json.loads('"' + m.group(1) + '"'), m.end()
    except ValueError:
        return None


def _partial_calls(text: str, fam: str, spec) -> list[tuple[str, str, bool]]:
    """The calls of an answer so far, in order, as (name, arguments' text so far, whole?),
    up to the first whose name is not yet known (``text``: the answer after its
    reasoning; the whole text for harmony)."""
    out: list[tuple[str, str, bool]] = []
    if fam == "harmony":
        for to, body in _harmony(text)[2]:
            got = _json_args(body)
            if got is None:
                break
            out.append((to.removeprefix("functions."), got[0], got[1]))
            if not got[1]:
                break
        return out
    head, region = _region(text, fam)
    if region is None:
        return out
    if fam == "llama3" and region.replace("<|python_tag|>", "").lstrip().startswith("["):
        return _pythonic_partial(region, spec)
    if fam == "llama3":
        r, i = region.replace("<|python_tag|>", ""), 0
        while True:
            while i < len(r) and (r[i].isspace() or r[i] == ";"):
                i += 1
            h = _json_head(r, i)
            got = _json_args(r, h[1]) if h else None
            if got is None:
                return out
            out.append((h[0], got[0], got[1]))
            end = r.find("}", got[2]) if got[1] else -1
            if end < 0 or r[got[2]:end].strip():
                return out
            i = end + 1
    if fam in ("hermes", "glm"):
        for block in region.split("<tool_call>")[1:]:
            body, closed = block.partition("</tool_call>")[0], "</tool_call>" in block
            if fam == "glm":
                lead = body.lstrip()
                if not ("\n" in lead or "<arg_key>" in lead or closed):
                    return out  # the name is still arriving
                name = re.split(r"\n|<arg_key>", lead, maxsplit=1)[0].strip()
                pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>",
                                   body, re.S)
                out.append((name, _xml_args([(k.strip(), v) for k, v in pairs],
                                            _props(spec, name), closed), closed))
            elif body.lstrip().startswith("<function="):
                m = re.match(r"\s*<function=([^>\n]+)>", body)
                if m is None:
                    return out
                name, rest = m.group(1).strip(), body[m.end():]
                pairs = [(k, v.strip("\n")) for k, v in
                         re.findall(r"<parameter=([^>\n]+)>(.*?)</parameter>", rest, re.S)]
                whole = "</function>" in rest
                out.append((name, _xml_args(pairs, _props(spec, name), whole), whole))
            else:
                h = _json_head(body, 0)
                got = _json_args(body, h[1]) if h else None
                if got is None:
                    return out
                out.append((h[0], got[0], got[1]))
            if not out[-1][2]:
                return out
        return out
    if fam == "kimi" and region.startswith(_KIMI_XML[0]):
        return _invoke_partial(region, spec)
    if fam in ("deepseek", "kimi"):
        begin, mid = (_DS[2], _DS[4]) if fam == "deepseek" else (_KIMI[2], _KIMI[3])
        for item in region.split(begin)[1:]:
            if mid not in item:
                return out
            ident, tail = item.split(mid, 1)
            if fam == "kimi":
                name = ident.strip().rsplit(":", 1)[0].removeprefix("functions.")
            elif ident.strip() == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
                name, nl, rest = tail.partition("\n")
                m = re.match(r"\s*```(?:json)?", rest)
                if not nl or m is None:
                    return out
                name, tail = name.strip(), rest[m.end():]
            else:
                name = ident.strip()
            got = _json_args(tail)
            if got is None:
                return out
            out.append((name, got[0], got[1]))
            if not got[1]:
                return out
        return out
    if fam == "dsml":
        for item in region.split(_DSML_PLAIN[2])[1:]:
            name, q, rest = item.partition('">')
            if not q:
                return out
            props = _props(spec, name)
            args = json.dumps(_dsml_args(rest, props), ensure_ascii=False)
            whole = _DSML_PLAIN[3] in rest
            out.append((name, args if whole else args[:-1], whole))
            if not whole:
                return out
        return out
    if fam == "minimax":
        return _invoke_partial(region, spec)
    return out


def _invoke_partial(region: str, spec) -> list[tuple[str, str, bool]]:
    """:func:`_partial_calls` of ``<invoke name="N">`` calls (MiniMax's, Kimi's XML form)."""
    out: list[tuple[str, str, bool]] = []
    for item in region.split('<invoke name="')[1:]:
        name, q, rest = item.partition('">')
        if not q:
            return out
        pairs = [(k, v.strip("\n")) for k, v in
                 re.findall(r'<parameter name="([^"]+)">(.*?)</parameter>', rest, re.S)]
        whole = "</invoke>" in rest
        out.append((name, _xml_args(pairs, _props(spec, name), whole), whole))
        if not whole:
            return out
    return out


class StreamParser:
    """An answer as it streams: OpenAI delta dicts for each piece of text (rank 0).

    A tool call streams as OpenAI's do: a ``tool_calls`` delta with its index, id and
    name once the name is known (and is one of the request's tools), then its
    ``arguments`` text in pieces as the model writes them (a JSON family's object as
    written, an XML-like family's one whole parameter at a time); :meth:`close` sends
    what is left and the calls the pieces could not show (arguments that are not an
    object)."""

    def __init__(self, fam: str, spec: ToolSpec | None, style: str | None,
                 think_open: bool = False):
        self.fam, self.spec, self.style, self.think_open = fam, spec, style, think_open
        self.harmony = style == "harmony" or fam == "harmony"
        self.text = ""
        self.sent_r = self.sent_c = 0
        self.sent: list[dict] = []  # each call streamed: its id, name, arguments sent
        self.stuck = False  # a call's name is none of the tools: the rest waits for close

    def _hold(self, content: str) -> str:
        """Content safe to show: before a call region, less a tail that may begin one."""
        if self.spec is None:
            return content
        if self.fam == "llama3":
            return "" if not content.strip() or content.lstrip()[:1] in "{[<" else content
        head, region = _region(content, self.fam)
        if region is not None:
            return head.rstrip()
        cut = 0
        for start in (STARTS[self.fam], *_ALSO_STARTS.get(self.fam, ())):
            for k in range(min(len(start) - 1, len(head)), 0, -1):
                if start.startswith(head[-k:]):
                    cut = max(cut, k)
                    break
        # the whole answer's content loses what precedes a call
        return head[:len(head) - cut].rstrip()

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        text = _untag(self.text, self.fam)
        if self.harmony:
            r, content, _, _ = _harmony(text)
            # a special token may be arriving: hold a tail from its "<|" (or "<")
            return self._out(_cut_open(r), _cut_open(content)) + self._calls(text)
        if self.style == "think" and not self.think_open and \
                "<think>".startswith(text.lstrip()[:7]) and len(text.lstrip()) < 7:
            return []  # "<think>" may be arriving
        r, rest, done = split_reasoning(text, self.style, self.think_open)
        if r is not None and not done:
            lead = r
            # "</think>" may be arriving: hold a tail that begins it, and the newlines
            # the whole answer's reasoning would lose
            for k in range(min(7, len(lead)), 0, -1):
                if "</think>".startswith(lead[-k:]):
                    lead = lead[:-k]
                    break
            return self._out(lead.rstrip("\n"), "")
        return self._out(r or "", self._hold(rest)) + self._calls(rest)

    def _calls(self, text: str) -> list[dict]:
        """tool_calls deltas for what the calls have grown by."""
        if self.spec is None or self.stuck:
            return []
        out = []
        fam = "harmony" if self.harmony else self.fam
        for i, (name, args, _) in enumerate(_partial_calls(text, fam, self.spec)):
            if i and not self.spec.parallel:
                break
            if i == len(self.sent):
                if name not in self.spec.names:
                    self.stuck = True
                    break
                self.sent.append({"id": new_call_id(), "name": name, "args": ""})
                out.append({"index": i, "id": self.sent[i]["id"], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            sent = self.sent[i]
            if len(args) > len(sent["args"]) and args.startswith(sent["args"]):
                out.append({"index": i, "function": {"arguments": args[len(sent["args"]):]}})
                sent["args"] = args
        return [{"tool_calls": [d]} for d in out]

    def _out(self, r: str, c: str) -> list[dict]:
        out = []
        if len(r) > self.sent_r:
            out.append({"reasoning_content": r[self.sent_r:]})
            self.sent_r = len(r)
        if len(c) > self.sent_c:
            out.append({"content": c[self.sent_c:]})
            self.sent_c = len(c)
        return out

    def close(self) -> tuple[list[dict], bool]:
        """The last deltas, and whether the answer was tool calls (the whole answer's
        parse decides: a call streamed that it does not read stays sent, and the text
        follows as content)."""
        p = parse(self.text, self.fam, self.spec, self.style, self.think_open)
        out = self._out(p.reasoning or "", p.content)
        if not p.tool_calls:
            return out, False
        if self.harmony:
            raw = _partial_calls(self.text, "harmony", self.spec)
        else:
            raw = _partial_calls(split_reasoning(_untag(self.text, self.fam), self.style,
                                                 self.think_open)[1],
                                 self.fam, self.spec)
        for i, c in enumerate(p.tool_calls):
            fn = c["function"]
            if i >= len(self.sent):
                out.append({"tool_calls": [dict(c, index=i)]})
                self.sent.append({"id": c["id"], "name": fn["name"], "args": fn["arguments"]})
                continue
            sent = self.sent[i]
            whole = raw[i][1] if i < len(raw) and raw[i][2] else fn["arguments"]
            if not whole.startswith(sent["args"]):
                whole = fn["arguments"] if not sent["args"] else sent["args"]
            if len(whole) > len(sent["args"]):
                out.append({"tool_calls": [{"index": i, "function": {
                    "arguments": whole[len(sent["args"]):]}}]})
                sent["args"] = whole
        return out, True


# -- the grammar of a forced call ---------------------------------------------------------

def _lit(s: str, tok) -> str:
    """A Lark terminal for ``s``: its special token when it is one, else the text."""
    if tok is not None and s in set(tok.specials):
        ids = tok.encode(s, add_bos=False)
        if len(ids) == 1:
            return f"<[{ids[0]}]>"
    return json.dumps(s)


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


def _xml_params(params: dict, key: str, mid: str, end: str, tok) -> str:
    """Required parameters, in order, as ``key K mid V end`` (a string's value is text
    without '<'; any other is JSON)."""
    props = params.get("properties") or {}
    parts = []
    for k in params.get("required") or []:
        sub = props.get(k, {})
        v = '/[^<]*/' if isinstance(sub, dict) and sub.get("type") == "string" else \
            _json(sub if isinstance(sub, dict) else {})
        parts.append(f"{_lit(key.format(k=k), tok)} {v} {_lit(end, tok)}")
    return " ".join(parts) if parts else '""'


def _dsml_params(params: dict, tok) -> str:
    """DeepSeek V3.2's required parameters, in order: a string's as text without '<'
    (``string="true"``), any other as JSON (``string="false"``)."""
    props = params.get("properties") or {}
    parts = []
    for k in params.get("required") or []:
        sub = props.get(k, {})
        text = isinstance(sub, dict) and sub.get("type") == "string"
        head = f'{_DSML[4]}{k}" string="{"true" if text else "false"}">'
        v = '/[^<]*/' if text else _json(sub if isinstance(sub, dict) else {})
        parts.append(f"{_lit(head, tok)} {v} {_lit(_DSML[5] + chr(10), tok)}")
    return " ".join(parts) if parts else '""'


def call_lark(spec: ToolSpec, tok) -> str:
    """A Lark grammar (llguidance's dialect) of the answers that are only calls of
    ``spec``'s tools (the named one, or any for ``required``), one or, when parallel,
    several; the family's own format, its markers as special tokens where they are."""
    tools = [t["function"] for t in spec.tools
             if spec.choice == "required" or t["function"]["name"] == spec.choice]
    fam = spec.family
    # harmony: one call a message; Llama 3.x's templates render one call a turn back
    multi = spec.parallel and fam not in ("harmony", "llama3")
    rules = []
    for i, f in enumerate(tools):
        n, params = f["name"], f.get("parameters") or {"type": "object"}
        if fam == "hermes":
            obj = {"type": "object", "required": ["name", "arguments"],
                   "additionalProperties": False,
                   "properties": {"name": {"const": n}, "arguments": params}}
            body = (f'{_lit("<tool_call>", tok)} "\\n" {_json(obj)} "\\n" '
                    f'{_lit("</tool_call>", tok)}')
        elif fam == "llama3":
            obj = {"type": "object", "required": ["name", "parameters"],
                   "additionalProperties": False,
                   "properties": {"name": {"const": n}, "parameters": params}}
            body = _json(obj)
        elif fam == "harmony":
            body = (f'{_lit("<|channel|>", tok)} "commentary to=functions.{n} " '
                    f'{_lit("<|constrain|>", tok)} "json" {_lit("<|message|>", tok)} '
                    f'{_json(params)}')
        elif fam == "deepseek" and spec.v3_form:  # function<sep>N, the arguments fenced
            body = (f'{_lit(_DS[2], tok)} "function" {_lit(_DS[4], tok)} '
                    f'{json.dumps(n + chr(10) + "```json" + chr(10))} {_json(params)} '
                    f'"\\n```" {_lit(_DS[3], tok)}')
        elif fam == "deepseek":
            body = f'{_lit(_DS[2], tok)} {json.dumps(n)} {_lit(_DS[4], tok)} {_json(params)} ' \
                   f'{_lit(_DS[3], tok)}'
        elif fam == "dsml":
            body = (f'{_lit(_DSML[2] + n + chr(34) + ">" + chr(10), tok)} '
                    f'{_dsml_params(params, tok)} {_lit(_DSML[3] + chr(10), tok)}')
        elif fam == "kimi":
            body = (f'{_lit(_KIMI[2], tok)} "functions.{n}:" /[0-9]/ {_lit(_KIMI[3], tok)} '
                    f'{_json(params)} {_lit(_KIMI[4], tok)}')
        elif fam == "glm":
            body = (f'{_lit("<tool_call>", tok)} {json.dumps(n + chr(10))} '
                    + _xml_params(params, "<arg_key>{k}</arg_key>\n<arg_value>", "",
                                  "</arg_value>\n", tok) + f' {_lit("</tool_call>", tok)}')
        else:  # minimax
            body = (f'"<invoke name=\\"{n}\\">\\n" '
                    + _xml_params(params, '<parameter name="{k}">', "", "</parameter>\n", tok)
                    + ' "</invoke>\\n"')
        rules.append(f"t{i}: {body}")
    one = " | ".join(f"t{i}" for i in range(len(tools)))
    sep = {"llama3": '"; "', "hermes": '"\\n"', "glm": '"\\n"'}.get(fam, '""')
    calls = f"({one}) ({sep} ({one}))*" if multi else f"({one})"
    if fam == "deepseek":
        calls = f"{_lit(_DS[0], tok)} {calls} {_lit(_DS[1], tok)}"
    elif fam == "kimi":
        calls = f"{_lit(_KIMI[0], tok)} {calls} {_lit(_KIMI[1], tok)}"
    elif fam == "dsml":
        calls = f"{_lit(_DSML[0] + chr(10), tok)} {calls} {_lit(_DSML[1], tok)}"
    elif fam == "minimax":
        calls = f'{_lit("<minimax:tool_call>", tok)} "\\n" {calls} ' \
                f'{_lit("</minimax:tool_call>", tok)}'
    return "start: " + calls + "\n" + "\n".join(rules) + "\n"
