"""Each family's tool-call parser against its checkpoints' OWN chat templates (Qwen2.5,
Qwen3, Qwen3-Coder, Qwen3.5, Llama 3.1/3.2/3.3, gpt-oss, DeepSeek V3.1 and V3's form, V3.2,
Kimi K2, GLM-4.6/4.7, MiniMax M2), as llama.cpp keeps copies of them;
tools/chat-templates fetches them (tests/unit/data/chat_templates.json pins each file's
sha256) and keeps them outside the repository.

Oracle: transformers' ``apply_chat_template(tools=...)`` on a tokenizer carrying the real
template renders a conversation with an assistant turn of tool calls and the tools'
replies; the assistant's part of it (what the model would have generated after the
generation prompt) must parse, whole and streamed, to exactly those calls. Our own
renderer (hpcmac's Tokenizer, behind the server's prompts) must write the same text,
and the server's whole prompt path (parse_request's tokens, on SmolLM2's vocabulary)
must decode to it. Also: the models' published answers (data/tool_outputs.json)."""

from __future__ import annotations

import json
import os
import runpy
from pathlib import Path

import pytest

from hpcmac.llm import tools
from tests.unit.test_llm_tools import CALLS, TOOLS, _calls

_FETCH = runpy.run_path(str(Path(__file__).parents[2] / "tools" / "chat-templates"))
MANIFEST = _FETCH["manifest"]()
MISSING = set(_FETCH["missing"](MANIFEST))
REASONING = "The user wants the weather and a sum: two tools."
# a third tool whose arguments take each JSON type: the XML-like formats write a value as
# text and the parser must give it back typed by the schema (Qwen3-Coder's and Qwen3.5's
# templates write a boolean as Python's True); its name has the '.' and ':' a name may
# (Kimi's call id is functions.NAME:INDEX)
PLAN = {"type": "function", "function": {"name": "trip.plan:v2", "description": "Plan a trip",
                                         "parameters": {"type": "object", "properties": {
        "title": {"type": "string"}, "code": {"type": "string"}, "ratio": {"type": "number"},
        "dry": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
        "opts": {"type": "object"}}}}}
TOOLS = TOOLS + [PLAN]
CALLS = CALLS + [("trip.plan:v2", {"title": "Rome <3 days>\nthen Naples", "code": "42",
                                   "ratio": 0.5, "dry": True, "tags": ["a", "b c"],
                                   "opts": {"k": [1, 2], "x": None}})]


def _spec(fam: str) -> tools.ToolSpec:
    spec = tools.check({"tools": TOOLS})
    spec.family = fam
    return spec


def _template(name: str) -> str:
    if name in MISSING:
        pytest.skip(f"{name} is not fetched: run python tools/chat-templates")
    return (_FETCH["cache_dir"](MANIFEST) / name).read_text(encoding="utf-8")


def _request(n: int) -> dict:
    """A chat request with TOOLS, a user turn and the turn after it as a client sends it
    back: the assistant's reasoning and its first ``n`` calls of CALLS (content null,
    arguments as JSON text), and each tool's reply."""
    user, turn = {"role": "user", "content": "Weather in Paris, and 2 + 40?"}, []
    turn.append({"role": "assistant", "content": None, "reasoning_content": REASONING,
                 "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                     "name": name, "arguments": json.dumps(args)}}
                     for i, (name, args) in enumerate(CALLS[:n])]})
    turn += [{"role": "tool", "tool_call_id": f"call_{i}", "name": CALLS[i][0],
              "content": '{"ok": true}'} for i in range(n)]
    return {"tools": TOOLS, "messages": [user] + turn}


def _conversation(n: int, template: str, spec) -> tuple[list[dict], list[dict], list | None]:
    """:func:`_request`'s messages as the template gets them from the server's own message
    path (request's cleaning, then :func:`request.template_input`): those before the
    assistant's turn, the turn (its calls and the tools' replies), and the ``tools=``."""
    from hpcmac.llm.request import _clean_message, template_input

    clean = [_clean_message(i, m) for i, m in enumerate(_request(n)["messages"])]
    msgs, shown = template_input(clean, spec, template)
    return msgs[:-len(clean) + 1], msgs[-len(clean) + 1:], shown


@pytest.fixture(scope="module")
def smol():
    """SmolLM2's tokenizer (ours, its template set per test) and transformers' on it."""
    from transformers import PreTrainedTokenizerFast

    from hpcmac.llm.model.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2")
    return tok, PreTrainedTokenizerFast(tokenizer_object=tok.tk, bos_token=tok.bos_token,
                                        eos_token=tok.eos_token)


def _render(smol, template: str, msgs: list[dict], shown) -> tuple[str | None, str]:
    """(transformers' text, ours) of ``msgs`` with the generation prompt through
    ``template``; transformers' is None where its sandbox refuses the template."""
    import jinja2

    tok, hf = smol
    tok.chat_template = hf.chat_template = template
    mine = tok.apply_chat_template(msgs, add_generation_prompt=True, tools=shown)
    try:
        theirs = hf.apply_chat_template(msgs, tools=shown, tokenize=False,
                                        add_generation_prompt=True)
    except jinja2.exceptions.SecurityError:
        # Kimi K2's newer templates call list.append, which transformers' immutable
        # sandbox refuses; ours (plain jinja2) renders them
        theirs = None
    return theirs, mine


def _streamed(fam, spec, style, think_open, text, step=3):
    """The reasoning, content and calls the stream parser sends for ``text`` fed
    ``step`` characters at a time; each call's name and argument pieces put together
    as an OpenAI client does."""
    sp = tools.StreamParser(fam, spec, style, think_open)
    deltas = [d for i in range(0, len(text), step) for d in sp.feed(text[i:i + step])]
    last, called = sp.close()
    deltas += last
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            got = calls.setdefault(c["index"], ["", ""])
            got[0] += c.get("function", {}).get("name") or ""
            got[1] += c.get("function", {}).get("arguments") or ""
    return ("".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content", "") for d in deltas),
            [(n, json.loads(a)) for _, (n, a) in sorted(calls.items())], called)


@pytest.mark.parametrize("name", sorted(MANIFEST["templates"]))
def test_parser_reads_what_the_checkpoints_template_writes(name, smol):
    meta = MANIFEST["templates"][name]
    template = _template(name)
    fam, style = meta["family"], tools.reasoning_style(template)
    assert tools.family(template) == fam
    spec = _spec(fam)
    spec.rendered = tools.writes_tools(template)  # as the server sets it
    head_msgs, turn, shown = _conversation(meta["calls"], template, spec)
    head_hf, head = _render(smol, template, head_msgs, shown)
    full_hf, full = _render(smol, template, head_msgs + turn, shown)
    assert head_hf == head  # our renderer writes what transformers does
    assert full_hf in (full, None) and (full_hf is not None or name.startswith("Kimi-K2-"))
    assert all(t["function"]["name"] in head for t in TOOLS)  # the tools reach the prompt
    if not spec.rendered:  # DeepSeek's templates: our system text, in the family's format
        assert tools.STARTS[fam] in head
    user = head_msgs[-1]
    # the assistant's turn: after the user's message and what of the generation prompt the
    # turn repeats (a template may drop, in history, a "<think>" it opens in the prompt),
    # up to the family's end of turn
    u = user["content"]
    gen, after = head[head.index(u) + len(u):], full[full.index(u) + len(u):]
    same = os.path.commonprefix([gen, after])
    if same.rfind("<") > same.rfind(">"):  # not inside a marker both begin alike
        same = same[:same.rfind("<")]
    answer = after[len(same):]
    if gen.endswith("</think>") and answer.startswith("</think>"):
        # DeepSeek V3.2's prompt closes an empty reasoning (<think></think>) that its
        # history writes as "</think>" alone: the model writes neither
        answer = answer[len("</think>"):]
    assert meta["end"] in answer, answer
    answer = answer[:answer.index(meta["end"])]
    think_open = style == "think" and gen.rstrip().endswith("<think>")
    want = [(n, a) for n, a in CALLS[:meta["calls"]]]

    got = tools.parse(answer, fam, spec, style, think_open)
    assert _calls(got) == want, answer
    assert not got.content, answer
    assert (got.reasoning or "").strip() in ("", REASONING), answer
    if REASONING in answer:
        assert got.reasoning.strip() == REASONING
    for step in (1, 3, 7):
        r, c, calls, called = _streamed(fam, spec, style, think_open, answer, step)
        assert calls == want and called, (step, answer)
        assert (r, c) == (got.reasoning or "", got.content), (step, answer)


OUTPUTS = json.loads((Path(__file__).parent / "data" / "tool_outputs.json").read_text(
    encoding="utf-8"))["cases"]


@pytest.mark.parametrize("case", OUTPUTS, ids=lambda c: c["family"])
def test_parser_reads_the_models_published_answers(case):
    """Answers the real models wrote (tests/unit/data/tool_outputs.json, each with its
    source), whole and streamed, give the calls, reasoning and content they show."""
    fam, style = case["family"], case["style"]
    spec = tools.check({"tools": [{"type": "function", "function": {
        "name": t["name"], "parameters": {"type": "object", "properties": t["properties"]}}}
        for t in case["tools"]]})
    spec.family = fam
    text = case["text"].removesuffix(case.get("stop", ""))
    want = [tuple(c) for c in case["calls"]]
    got = tools.parse(text, fam, spec, style)
    assert _calls(got) == want
    assert (got.reasoning, got.content) == (case["reasoning"], case["content"])
    for step in (1, 3, 7):
        r, c, calls, called = _streamed(fam, spec, style, False, text, step)
        assert (r, c, calls, called) == (case["reasoning"] or "", case["content"], want,
                                         bool(want)), step


@pytest.mark.parametrize("name", sorted(MANIFEST["templates"]))
def test_the_servers_prompt_is_the_checkpoints_template(name, smol):
    """The server's whole prompt path (parse_request: the family, the tools, the messages
    cleaned, chat_ids' tokens) with the real template on SmolLM2's vocabulary: its tokens
    decode to what transformers renders, with the family the parser reads. A turn of
    two calls that Llama 3.x's templates refuse is sent as one turn a call."""
    from hpcmac.llm.request import ServeConfig, parse_request

    meta, template = MANIFEST["templates"][name], _template(name)
    tok = smol[0]
    tok.chat_template = template
    cfg = ServeConfig("m", tok, tok.vocab_size, 8192, tuple(tok.eos_ids))
    p = parse_request(_request(meta["calls"]), "chat", cfg)
    assert p.tools.family == meta["family"]
    head, turn, shown = _conversation(meta["calls"], template, p.tools)
    hf_text, ours = _render(smol, template, head + turn, shown)
    assert tok.decode(p.ids) == (hf_text or ours)
    # a forced parallel answer may hold several calls only where the template takes them
    forced = tools.check({"tools": TOOLS, "tool_choice": "required"})
    forced.family = meta["family"]
    assert ("*" in tools.call_lark(forced, tok).splitlines()[0]) == (meta["calls"] > 1)
    # a tool without a description (OpenAI's is optional; gpt-oss's template reads it)
    bare = dict(_request(1), tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}}])
    assert parse_request(bare, "chat", cfg).ids
    if meta["calls"] == 1 and meta["family"] == "llama3":
        # the model's own answer of two calls (under auto), sent back: one turn a call,
        # each followed by its reply, in order (the template refuses a turn of two)
        text = tok.decode(parse_request(_request(2), "chat", cfg).ids)
        at = [text.find(f'{{"name": "{n}", "parameters": ') for n, _ in CALLS[:2]]
        mark = "<|start_header_id|>ipython<|end_header_id|>"  # a tool's reply
        replies = [i for i in range(len(text)) if text.startswith(mark, i)]
        assert -1 < at[0] < replies[0] < at[1] < replies[1], text[-600:]


def test_deepseeks_tool_block_keeps_its_markers_special(smol):
    """DeepSeek V3.1's template shows no tools: the server's system text (its model card's
    block) names the call markers, which are the vocabulary's tokens there, while the same
    string in a client's message stays text."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as TK

    from hpcmac.llm.model.tokenizer import Tokenizer
    from hpcmac.llm.request import ServeConfig, parse_request

    base = smol[0]
    tk = TK.from_str(base.tk.to_str())
    tk.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in tools._DS])
    tok = Tokenizer(tk, base.bos_id, base.eos_ids, base.add_bos,
                    _template("deepseek-ai-DeepSeek-V3.1.jinja"), base.bos_token, base.eos_token)
    cfg = ServeConfig("m", tok, tok.vocab_size, 8192, tuple(tok.eos_ids))
    begin = tk.token_to_id(tools._DS[0])
    for user in ("Weather in Paris?", f"What does {tools._DS[0]} mean?"):
        p = parse_request({"tools": TOOLS, "messages": [{"role": "user", "content": user}]},
                          "chat", cfg)
        assert p.ids.count(begin) == 1  # the block's, not the client's
        assert tools._DS[0] in tok.decode(p.ids).split(user)[0]


def test_a_checkpoints_template_cannot_reach_python():
    """A chat template comes with the checkpoint, from whoever published it: rendered in
    jinja's sandbox, one that reaches for Python's internals (here: to run a shell
    command) is one clear UsageError, never run."""
    from hpcmac.errors import UsageError
    from hpcmac.llm.model.tokenizer import Tokenizer

    evil = "{{ cycler.__init__.__globals__.os.popen('echo owned').read() }}"
    with pytest.raises(UsageError, match="unsafe"):
        Tokenizer(None, None, [], False, evil).apply_chat_template(
            [{"role": "user", "content": "x"}])


def test_the_chat_template_compiles_once_per_text():
    """The template is compiled once, not per request (2.8 ms of CPU each, holding the
    GIL on the serving rank); a new template text is compiled anew, and the sandbox and
    one-line refusals hold for the cached one."""
    from hpcmac.errors import UsageError
    from hpcmac.llm.model.tokenizer import Tokenizer

    msgs = [{"role": "user", "content": "x"}]
    t = Tokenizer(None, None, [], False, "A{{ messages[0]['content'] }}")
    assert t.apply_chat_template(msgs) == "Ax"
    first = t._compiled()
    assert t._compiled() is first
    t.chat_template = "B{{ messages[0]['content'] }}{{ raise_exception('no') }}"
    with pytest.raises(UsageError, match="chat template: no"):
        t.apply_chat_template(msgs)
    assert t._compiled() is not first
    t.chat_template = "{{ cycler.__init__.__globals__.os.popen('echo owned').read() }}"
    with pytest.raises(UsageError, match="unsafe"):
        t.apply_chat_template(msgs)


@pytest.mark.parametrize("name", ["deepseek-ai-DeepSeek-V3.1.jinja",
                                  "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"])
def test_deepseeks_system_text_shows_the_form_its_template_writes(name, smol):
    """DeepSeek's templates show no tools, so the server's system text tells the call
    format: V3.1's for V3.1, V3's and R1's (``function``, a json fence) for theirs, the
    form each template writes the calls back in."""
    import re

    template = _template(name)
    spec = _spec("deepseek")
    spec.rendered = tools.writes_tools(template)
    told = tools.system_text(TOOLS, "deepseek", template)
    example = told.split("tool use:\n", 1)[1].split("{additional_tool_calls}")[0]
    pat = re.escape(example).replace("tool_call_name", re.escape(CALLS[0][0]))
    pat = pat.replace("tool_call_arguments", r"\{[^{}]*\}")
    head, turn, shown = _conversation(1, template, spec)
    _, text = _render(smol, template, head + turn, shown)
    assert re.search(pat, text.split("Weather in Paris", 1)[1]), (example, text[-400:])
    assert ("```json" in example) == ("R1" in name)
