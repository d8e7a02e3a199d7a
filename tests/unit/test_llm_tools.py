"""hpcmac.llm.tools without a server: each family's parser reads what its template writes
and what its models write; the forced-call grammar and the parser agree.

Oracles: transformers' chat-template renderer (the one behind ``apply_chat_template``)
writing assistant ``tool_calls`` through a template in each family's format; answers in
each family's format (tests/unit/data/tool_calls.json); for the grammar, answers built
from random tokens the mask allows, checked by the parser and the tool's own schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcmac.llm import tools

jsonschema = pytest.importorskip("jsonschema")

DATA = Path(__file__).parent / "data" / "tool_calls.json"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
]
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 2, "b": 40})]

# Each family's assistant turn with tool calls, written as its checkpoint's template
# writes it (minimal templates of ours: the turn's frame and the call format only)
_LOOP = "{% for tc in m.tool_calls %}{% set f = tc.function %}"
TEMPLATES = {
    "hermes": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}" + _LOOP +
              "{% if not loop.first or m.content %}\n{% endif %}<tool_call>\n{\"name\": \""
              "{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}\n</tool_call>"
              "{% endfor %}<|im_end|>\n{% endfor %}{% if tools %}{% endif %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "llama3": "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
              "{{ m.content }}" + _LOOP + "{{ '; ' if not loop.first }}{\"name\": \""
              "{{ f.name }}\", \"parameters\": {{ f.arguments | tojson }}}{% endfor %}"
              "<|eot_id|>{% endfor %}{# tools: <|python_tag|> #}",
    "harmony": "{% for m in messages %}{% if m.tool_calls %}" + _LOOP +
               "<|start|>assistant<|channel|>commentary to=functions.{{ f.name }} "
               "<|constrain|>json<|message|>{{ f.arguments | tojson }}<|call|>{% endfor %}"
               "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
               "{% endfor %}",
    "deepseek": "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
                "<｜Assistant｜></think>{% else %}<｜tool▁calls▁begin｜>" + _LOOP +
                "<｜tool▁call▁begin｜>{{ f.name }}<｜tool▁sep｜>{{ f.arguments | tojson }}"
                "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
                "{% endif %}{% endfor %}",
    "dsml": "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
            "<｜Assistant｜></think>{% else %}{{ m.content }}{% if m.tool_calls %}\n\n"
            "<｜DSML｜function_calls>\n" + _LOOP + "<｜DSML｜invoke name=\"{{ f.name }}\">\n"
            "{% for k, v in f.arguments.items() %}<｜DSML｜parameter name=\"{{ k }}\" "
            "string=\"{{ 'true' if v is string else 'false' }}\">{{ v if v is string else "
            "v | tojson }}</｜DSML｜parameter>\n{% endfor %}</｜DSML｜invoke>\n{% endfor %}"
            "</｜DSML｜function_calls>{% endif %}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
            "{# tools #}",
    "kimi": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>"
            "{{ m.content }}{% if m.tool_calls %}<|tool_calls_section_begin|>" + _LOOP +
            "<|tool_call_begin|>functions.{{ f.name }}:{{ loop.index0 }}"
            "<|tool_call_argument_begin|>{{ f.arguments | tojson }}<|tool_call_end|>"
            "{% endfor %}<|tool_calls_section_end|>{% endif %}<|im_end|>{% endfor %}",
    "glm": "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}" + _LOOP +
           "\n<tool_call>{{ f.name }}{% for k, v in f.arguments.items() %}\n<arg_key>{{ k }}"
           "</arg_key>\n<arg_value>{{ v | tojson if v is not string else v }}</arg_value>"
           "{% endfor %}\n</tool_call>{% endfor %}{% endfor %}",
    "minimax": "{% for m in messages %}]~b]{{ m.role }}\n{{ m.content }}"
               "{% if m.tool_calls %}\n<minimax:tool_call>\n" + _LOOP +
               "<invoke name=\"{{ f.name }}\">\n{% for k, v in f.arguments.items() %}"
               "<parameter name=\"{{ k }}\">{{ v | tojson if v is not string else v }}"
               "</parameter>\n{% endfor %}</invoke>\n{% endfor %}</minimax:tool_call>"
               "{% endif %}[e~[\n{% endfor %}",
}
ENDS = {"hermes": "<|im_end|>\n", "llama3": "<|eot_id|>", "harmony": "<|call|>",
        "deepseek": "<｜end▁of▁sentence｜>", "dsml": "<｜end▁of▁sentence｜>",
        "kimi": "<|im_end|>", "glm": "",
        "minimax": "[e~[\n"}


def _spec(fam: str, choice: str = "auto", parallel: bool = True) -> tools.ToolSpec:
    named = {"type": "function", "function": {"name": choice}}
    spec = tools.check({"tools": TOOLS, "parallel_tool_calls": parallel,
                        "tool_choice": choice if choice in ("auto", "required") else named})
    spec.family = fam
    return spec


def _calls(parsed) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.tool_calls or []]


@pytest.mark.parametrize("fam", sorted(TEMPLATES))
def test_parser_reads_what_the_template_writes(fam):
    from transformers.utils.chat_template_utils import render_jinja_template

    assert tools.family(TEMPLATES[fam]) == fam
    user = {"role": "user", "content": "Weather in Paris, and 2 + 40?"}
    asst = {"role": "assistant", "content": "",
            "tool_calls": [{"id": f"c{i}", "type": "function",
                            "function": {"name": n, "arguments": a}}
                           for i, (n, a) in enumerate(CALLS)]}
    calls = CALLS if fam != "harmony" else CALLS[:1]  # harmony: one call a message
    asst["tool_calls"] = asst["tool_calls"][:len(calls)]

    def render(msgs):
        out, _ = render_jinja_template(conversations=[msgs], tools=TOOLS,
                                       chat_template=TEMPLATES[fam])
        return out[0]

    head, full = render([user]), render([user, asst])
    assert full.startswith(head)
    answer = full[len(head):]
    if fam == "harmony":
        answer = answer.removeprefix("<|start|>assistant")
    elif fam not in ("deepseek", "dsml"):
        answer = answer[answer.index("\n") + 1:] if fam in ("hermes", "glm", "minimax") \
            else answer.split("<|end_header_id|>\n\n", 1)[-1].split("<|im_middle|>", 1)[-1]
    answer = answer.removesuffix(ENDS[fam]) if ENDS[fam] else answer
    got = tools.parse(answer, fam, _spec(fam), tools.reasoning_style(TEMPLATES[fam]))
    assert _calls(got) == [(n, a) for n, a in calls], answer
    assert not got.content, answer


def _cases():
    return json.loads(DATA.read_text())["cases"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c["family"])
def test_parser_reads_each_familys_answers(case):
    fam, style, open_ = case["family"], case["style"], case.get("think_open", False)
    got = tools.parse(case["text"], fam, _spec(fam), style, open_)
    want = [tuple(c) for c in case["calls"]] if case["calls"] else []
    assert _calls(got) == want
    assert (got.reasoning or None) == case["reasoning"]
    assert got.content == case["content"]
    # streamed a few characters at a time: the same reasoning, content and calls, each
    # call's id and name first, then its arguments in pieces as they are written
    sp = tools.StreamParser(fam, _spec(fam), style, open_)
    fed = [d for i in range(0, len(case["text"]), 3) for d in sp.feed(case["text"][i:i + 3])]
    last, called = sp.close()
    deltas = fed + last
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (case["reasoning"] or "")
    assert "".join(d.get("content", "") for d in deltas) == case["content"]
    calls: dict = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:  # a call's first delta: its id and name
                assert c["id"].startswith("call_") and c["function"]["name"], c
                calls[c["index"]] = [c["function"]["name"], "", 0, d in fed]
            else:
                assert "id" not in c and "name" not in c["function"], c
            got = calls[c["index"]]
            got[1] += c["function"].get("arguments", "")
            got[2] += d in fed and bool(c["function"].get("arguments"))
    assert [(n, json.loads(a)) for n, a, _, _ in calls.values()] == want and called == bool(want)
    # every call of two arguments was under way before the answer ended: its name and
    # at least two pieces of its arguments came from feed (the last call may finish in
    # close, when its end arrives with the answer's)
    assert all(early and pieces >= 2 for _, _, pieces, early in calls.values()), calls


def test_malformed_call_under_auto_is_content():
    for fam, text in [("hermes", 'Sure <tool_call>\n{"name": "get_weather", "arguments": {'),
                      ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
                      ("llama3", '{"name": "add", "parameters": [1, 2]}'),
                      # pythonic (Llama 3.2/3.3): literals only, nothing is evaluated
                      ("llama3", '[add(a=__import__("os").getpid(), b=1)]'),
                      ("llama3", "[add(2, 40)]"),  # positional: not a call
                      ("llama3", "[nope(a=1)]"),
                      ("llama3", "[1] is the first source; [2] the second."),
                      ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.add")]:
        got = tools.parse(text, fam, _spec(fam))
        assert got.tool_calls is None and got.content == text
        # streamed: whatever call pieces went out, the text follows as content and the
        # answer is not tool calls (the server's finish_reason stays stop or length)
        sp = tools.StreamParser(fam, _spec(fam), None)
        deltas = [d for i in range(0, len(text), 4) for d in sp.feed(text[i:i + 4])]
        last, called = sp.close()
        assert not called
        assert "".join(d.get("content", "") for d in deltas + last) == text
        if "nope" in text:  # a name that is none of the tools never starts a call
            assert not any("tool_calls" in d for d in deltas + last)


def test_one_call_a_turn_pairs_each_call_with_its_reply():
    """A turn of two calls as Llama 3.x's templates take it: one turn a call, each
    followed by its reply found by tool_call_id (here sent in the other order); the
    text stays with the first call; other messages are untouched."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
             for i, n in enumerate(("get_weather", "add"))]
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "Both.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
            {"role": "user", "content": "thanks"}]
    got = tools.one_call_a_turn(msgs)
    assert [(m["role"], m.get("content"), [c["id"] for c in m.get("tool_calls", [])])
            for m in got] == [("user", "q", []), ("assistant", "Both.", ["c0"]),
                              ("tool", "sunny", []), ("assistant", "", ["c1"]),
                              ("tool", "42", []), ("user", "thanks", [])]


def test_bad_tools_fields_name_the_field():
    bad = [({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
           ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zz"}}},
            "tool_choice"),
           ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": TOOLS + TOOLS[:1]}, "tools")]
    for body, param in bad:
        with pytest.raises(tools.ToolError) as e:
            tools.check(body)
        assert e.value.param == param
    assert tools.check({"tools": TOOLS, "tool_choice": "none"}) is None


@pytest.fixture(scope="module")
def tok():
    from hpcmac.llm.model.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


def test_tool_round_trip_renders_the_call_and_the_result(tok):
    """SmolLM2's template shows no tools: the request's tools go into a system message,
    an assistant's calls into its content (hermes style) and the tool's answer follows."""
    from hpcmac.llm.request import ServeConfig, parse_request

    cfg = ServeConfig("m", tok, 49152, 4096, tuple(tok.eos_ids))
    body = {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]}
    p = parse_request(body, "chat", cfg)
    text = tok.decode(p.ids)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert text.index('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                      '"unit": "c"}}\n</tool_call>') < text.index("<|im_start|>tool\n18 C, sunny")
    assert p.sampling.grammar is None and p.tools.family == "hermes"
    forced = parse_request(dict(body, tool_choice="required"), "chat", cfg)
    assert forced.sampling.grammar and forced.ids == p.ids


@pytest.mark.parametrize("fam", [*tools.FAMILIES, "deepseek-v3"])
def test_forced_call_grammar_and_parser_agree(fam, tok):
    """Random tokens the grammar of a required call allows (SmolLM2's vocabulary) make an
    answer that the family's parser reads as calls of the tools, with arguments valid
    under each tool's schema (``deepseek-v3``: V3's and R1's form, as their templates
    write it)."""
    pytest.importorskip("llguidance")
    from hpcmac.llm import grammar

    v3, fam = fam == "deepseek-v3", fam.removesuffix("-v3")
    lt = grammar.ll_tokenizer(tok, tok.vocab_size)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed, (choice, parallel) in enumerate([("required", False), ("add", True)]):
        spec = _spec(fam, choice, parallel)
        spec.v3_form = v3
        c = grammar.Constraint(grammar.lark(tools.call_lark(spec, tok), "tools", lt), lt)
        rng = np.random.default_rng(seed)
        row = np.empty(grammar.mask_words(tok.vocab_size), dtype=np.int32)
        out = []
        for _ in range(400):
            c.fill(row)
            if c.done:
                break
            ok = np.flatnonzero(grammar.allowed(row, 0, tok.vocab_size)[0])
            eos = [t for t in ok if t in tok.eos_ids]
            t = int(eos[0] if eos and len(out) > 60 else rng.choice(ok))
            if t in tok.eos_ids:
                break
            out.append(t)
            c.accept(t)
        text = tok.decode(out)
        got = tools.parse(text, fam, spec, "harmony" if fam == "harmony" else None)
        assert got.tool_calls, (fam, text)
        assert (tools._DS[4] + "function" in text or "function" + tools._DS[4] in text) == v3
        for call in got.tool_calls:
            name = call["function"]["name"]
            assert choice == "required" or name == choice
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])


def test_kimis_xml_form_with_text_before_and_two_invokes():
    """Kimi K2's fallback form (data/tool_outputs.json has the published one): values typed
    by the schema, the text before it content, whole and streamed alike."""
    text = ('I will add.\n<tool_call>\n<invoke name="add">\n<parameter name="a">2</parameter>\n'
            '<parameter name="b">40</parameter>\n</invoke>\n<invoke name="get_weather">\n'
            '<parameter name="city">Paris</parameter>\n<parameter name="unit">c</parameter>\n'
            '</invoke>\n</tool_call>')
    want = [("add", {"a": 2, "b": 40}), ("get_weather", {"city": "Paris", "unit": "c"})]
    got = tools.parse(text, "kimi", _spec("kimi"))
    assert (_calls(got), got.content) == (want, "I will add.")
    for step in (1, 5):
        sp = tools.StreamParser("kimi", _spec("kimi"), None)
        deltas = [d for i in range(0, len(text), step) for d in sp.feed(text[i:i + step])]
        last, called = sp.close()
        args: dict = {}
        for d in deltas + last:
            for c in d.get("tool_calls", []):
                n = args.setdefault(c["index"], [c["function"].get("name"), ""])
                n[1] += c["function"].get("arguments", "")
        assert called and [(n, json.loads(a)) for n, a in args.values()] == want
        assert "".join(d.get("content", "") for d in deltas + last) == "I will add."
