"""Structured output, tool calls and logprobs through a real ``serve`` (mpirun at 1 and 2
ranks: one rank; a tensor group of 2, whose vocabulary-parallel head masks each rank's
slice before its max-loc; a pipeline of 2, whose last stage samples on rank 1) and the
official ``openai`` client. Oracles: ``jsonschema`` on every answer; the tool's own
parameter schema on every call's arguments."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
import test_llm_serve as serve  # noqa: E402  (its Server, one place)

CITY = {"type": "object", "additionalProperties": False,
        "required": ["city", "country", "population_millions"],
        "properties": {"city": {"type": "string", "maxLength": 16},
                       "country": {"type": "string", "maxLength": 16},
                       "population_millions": {"type": "integer", "minimum": 0,
                                               "maximum": 100}}}
LAYOUTS = [(1, ()), (2, ("--tp", "2")), (2, ())]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["np1", "np2-tp2", "np2-pp2"])
def server(request):
    np_, flags = request.param
    s = serve.Server(np_, *flags)
    s.np, s.layout = np_, flags
    yield s
    s.stop()


def _concurrently(fn, n: int) -> list:
    out = [None] * n

    def run(i):
        try:
            out[i] = fn(i)
        except Exception as exc:  # reported by the assertion on its slot
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


def test_json_schema_answers_validate(server):
    """20 prompts of 20 (4 on a pipeline layout) answer JSON valid under the schema,
    batched together, greedy and sampled; finish_reason stop (the grammar ends, EOS)."""
    c, model = server.client(), server.model()
    tp = int(server.layout[server.layout.index("--tp") + 1]) if "--tp" in server.layout else 1
    n = 4 if server.np > tp else 20

    def ask(i):
        r = c.chat.completions.create(
            model=model, max_tokens=48, temperature=0 if i % 2 else 0.8, seed=i,
            messages=[{"role": "user", "content": f"Describe city number {i} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": CITY}})
        return r.choices[0].message.content, r.choices[0].finish_reason

    for got in _concurrently(ask, n):
        assert not isinstance(got, Exception), got
        text, finish = got
        jsonschema.validate(json.loads(text), CITY)
        assert finish == "stop", got


def test_json_object_and_uncompilable_schema(server):
    """json_object gives a JSON object; a schema the engine cannot compile is a 400 naming
    the schema path; the server goes on."""
    c, model = server.client(), server.model()
    r = c.chat.completions.create(model=model, max_tokens=32, temperature=0, messages=[
        {"role": "user", "content": 'Answer with the JSON {"answer": "yes"}. Is 2 > 1?'}],
                                  response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    bad = {"type": "object", "properties": {"a": {"type": "object",
                                                  "properties": {"b": {"type": "foo"}}}}}
    with pytest.raises(serve.openai.BadRequestError) as e:
        c.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": "x"}], response_format={
                "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    path = "response_format.json_schema.schema.properties.a.properties.b"
    assert e.value.body["param"] == path and path in e.value.body["message"]


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 16},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 999}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_required_tool_call_streaming_and_not(server):
    """tool_choice required with two tools: a valid call with schema-valid arguments,
    finish_reason tool_calls; streamed as tool_calls deltas; a named choice calls that
    tool; then a role:tool round trip completes."""
    if server.np == 2 and not server.layout:
        pytest.skip("a pipeline's grammar path is test_json_schema_answers_validate's")
    c, model = server.client(), server.model()
    r = c.chat.completions.create(model=model, temperature=0, max_tokens=48, messages=ASK,
                                  tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
    call = ch.message.tool_calls[0]
    _valid(call.function.name, call.function.arguments)
    calls, finish = {}, None
    for chunk in c.chat.completions.create(
            model=model, temperature=0, max_tokens=40, messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}}, stream=True):
        d = chunk.choices[0].delta
        assert not d.content, d
        for tc in d.tool_calls or []:
            if tc.index not in calls:  # OpenAI's order: id and name first, no arguments yet
                assert tc.id and tc.function.name == "add" and not tc.function.arguments, tc
            else:
                assert not tc.id and not tc.function.name, tc
            got = calls.setdefault(tc.index, {"name": "", "arguments": "", "pieces": 0})
            got["name"] += tc.function.name or ""
            got["arguments"] += tc.function.arguments or ""
            got["pieces"] += bool(tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls, calls
    # the arguments came as the model wrote them, not in one chunk at the end
    assert all(got["pieces"] >= 3 for got in calls.values()), calls
    for got in calls.values():
        assert got["name"] == "add"
        _valid("add", got["arguments"])
    back = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = c.chat.completions.create(model=model, temperature=0, max_tokens=2, messages=back,
                                  tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 60  # the tools, the call and its result are in the prompt


def test_logprobs_chat_and_completion(server):
    """Greedy logprobs (under --tp a max-loc whose slices give the log-sum-exp and top-k)
    equal a sampled request's (the logits gathered whole) on the same first token (to
    float32 rounding); the
    chosen greedy token is the top one; streamed chunks carry their tokens' logprobs;
    the completions endpoint's shape; bad values are 400 naming the field."""
    c, model = server.client(), server.model()

    def ask(**kw):
        return c.chat.completions.create(model=model, max_tokens=3, messages=ASK,
                                         logprobs=True, top_logprobs=4, **kw).choices[0]

    greedy, sampled = ask(temperature=0), ask(temperature=1.0, seed=3)
    g, s0 = greedy.logprobs.content, sampled.logprobs.content
    assert len(g) == 3 and len(g[0].top_logprobs) == 4
    for e in g:
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob
        assert all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:]))
    assert [t.token for t in g[0].top_logprobs] == [t.token for t in s0[0].top_logprobs]
    for a, b in zip(g[0].top_logprobs, s0[0].top_logprobs):
        # float32 logits: the second request reads its prompt's KV from the prefix cache
        # (another summation order), 6e-6 apart seen; a wrong combine is off by far more
        assert abs(a.logprob - b.logprob) < 1e-4 and a.logprob < 0
    assert "".join(e.token for e in g) == greedy.message.content
    streamed = [e.token for ch in c.chat.completions.create(
        model=model, max_tokens=3, messages=ASK, temperature=0, logprobs=True, stream=True)
        if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == [e.token for e in g]
    r = c.completions.create(model=model, prompt="The capital of France is", max_tokens=2,
                             temperature=0, logprobs=2).choices[0]
    assert len(r.logprobs.tokens) == 2 and "".join(r.logprobs.tokens) == r.text
    assert r.logprobs.text_offset[0] == 0 and len(r.logprobs.top_logprobs[0]) == 2
    for bad, param in [({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
                       ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        with pytest.raises(serve.openai.BadRequestError) as e:
            c.chat.completions.create(model=model, max_tokens=2, messages=ASK,
                                      extra_body=bad)
        assert e.value.body["param"] == param
