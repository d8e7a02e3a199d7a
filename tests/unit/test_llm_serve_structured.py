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
    """20 prompts of 20 (4 on the pipeline layout) answer JSON valid under the schema,
    batched together, greedy and sampled; finish_reason stop (the grammar ends, EOS)."""
    c, model = server.client(), server.model()
    n = 4 if server.layout == () and server.np == 2 else 20

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
