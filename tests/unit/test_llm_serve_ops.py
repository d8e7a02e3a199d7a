"""serve for operators and other clients: the API key, /metrics, /v1/slots, Anthropic
Messages, OpenAI Responses, and the live page in headless Chromium.

One keyed server per layout (np 1, and np 2 ``--tp 2``), shared by the module. Oracles:
the official ``anthropic`` and ``openai`` clients; the chat endpoint's greedy text for
the same messages (every API shape runs the same generation); ``prometheus_client``'s
own parser for /metrics, whose counters must move by exactly what was sent.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.unit.test_llm_serve import QUESTION, ROOT, Server

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
anthropic = pytest.importorskip("anthropic")
parser = pytest.importorskip("prometheus_client.parser")

KEY = "test-key-7f3a"
MESSAGES = [{"role": "user", "content": QUESTION}]
#: sampling fields the anthropic client no longer has as arguments (2.x) go in extra_body
GREEDY = {"temperature": 0}


#: SmolLM2's own chat template (the one its GGUF carries) with one clause added: with
#: ``chat_template_kwargs: {"enable_thinking": true}`` the generation prompt opens
#: ``<think>``, as Qwen3's does, so the answer up to ``</think>`` is reasoning. Without
#: it, prompts are SmolLM2's own, token for token.
THINK_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking %}{{ '<think>\n' }}{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="module", params=[(1, ()), (2, ("--tp", "2"))], ids=["np1", "np2-tp2"])
def keyed(request, tmp_path_factory):
    np_, flags = request.param
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(THINK_TEMPLATE, encoding="utf-8")
    s = Server(np_, *flags, "--chat-template", str(template), key=KEY)
    s.np, s.tp, s.pp = np_, np_, 1
    yield s
    s.stop()


def scrape(server) -> dict[tuple[str, tuple], float]:
    """/metrics through prometheus_client's parser: (sample name, sorted labels) -> value."""
    r = httpx.get(server.url + "/metrics", headers=server.headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in parser.text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(after: dict, before: dict, name: str, **labels) -> float:
    k = (name, tuple(sorted(labels.items())))
    return after.get(k, 0.0) - before.get(k, 0.0)


def greedy_chat(server, max_tokens: int = 12):
    return server.client().chat.completions.create(
        model=server.model(), messages=MESSAGES, temperature=0, max_tokens=max_tokens)


def test_cors_origins_and_preflight_without_the_key():
    """--cors, on the app alone (no model): an allowed origin gets the CORS headers, a
    preflight passes without the key (browsers send none), another origin gets none."""
    import threading

    from starlette.testclient import TestClient

    from hpcmac.llm.ops import Ops
    from hpcmac.llm.parallel.live import LiveRequests
    from hpcmac.llm.request import ServeConfig
    from hpcmac.llm.server import build_app

    alive = threading.Event()
    alive.set()
    app = build_app(ServeConfig("m", None, 10, 64, (0,)), LiveRequests(4), alive,
                    Ops(api_key=KEY, cors=("http://ui.example:3000",)))
    c = TestClient(app)
    ok = {"Origin": "http://ui.example:3000"}
    r = c.get("/health", headers=ok)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://ui.example:3000"
    pre = c.options("/v1/chat/completions", headers={
        **ok, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and "POST" in pre.headers["access-control-allow-methods"]
    denied = c.get("/v1/models", headers=ok)  # CORS passes; the key still counts
    assert denied.status_code == 401
    assert denied.headers["access-control-allow-origin"] == "http://ui.example:3000"
    assert c.get("/v1/models", headers={**ok, "x-api-key": KEY}).status_code == 200
    other = c.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_bad_key_cors_and_template_flags_are_one_line(tmp_path):
    import subprocess
    import sys

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}", encoding="utf-8")
    for flag, value in (("--api-key", "a b"), ("--cors", " , "),
                        ("--chat-template", str(tmp_path / "none.jinja")),
                        ("--chat-template", str(broken))):
        r = subprocess.run([sys.executable, "-m", "hpcmac.llm", "serve", "--model", "smollm2",
                            flag, value], capture_output=True, text=True, timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag}")


def test_wrong_key_is_401_and_no_work_is_done(keyed):
    before = scrape(keyed)
    body = {"messages": MESSAGES, "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
                    {"Authorization": KEY}):
        r = httpx.post(keyed.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="x", messages=MESSAGES, max_tokens=4)
    a = anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        a.messages.create(model="x", max_tokens=4, messages=MESSAGES)
    for path in ("/v1/models", "/metrics", "/v1/slots", "/v1/cluster"):
        assert httpx.get(keyed.url + path).status_code == 401, path
    # open without the key: health and the page (it asks for the key itself)
    assert httpx.get(keyed.url + "/health").json()["status"] == "ok"
    assert httpx.get(keyed.url + "/").status_code == 200
    after = scrape(keyed)
    assert delta(after, before, "hpcmac_requests_total", endpoint="/v1/chat/completions",
                 status="401") == 5
    assert delta(after, before, "hpcmac_requests_total", endpoint="/v1/messages",
                 status="401") == 1
    for name in ("hpcmac_prompt_tokens_total", "hpcmac_completion_tokens_total",
                 "hpcmac_time_to_first_token_seconds_count"):
        assert delta(after, before, name) == 0, name  # nothing reached the scheduler
    # the right key, either header
    for headers in (keyed.headers, {"x-api-key": KEY}):
        assert httpx.get(keyed.url + "/v1/models", headers=headers).status_code == 200


def test_metrics_move_by_exactly_the_requests_sent(keyed):
    before = scrape(keyed)
    c = keyed.client()
    usages = [greedy_chat(keyed, 6).usage for _ in range(2)]
    r = c.completions.create(model=keyed.model(), prompt="Hello", max_tokens=3, temperature=0)
    usages.append(r.usage)
    a = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)
    m = a.messages.create(model=keyed.model(), max_tokens=5, messages=MESSAGES,
                          extra_body=GREEDY)
    bad = httpx.post(keyed.url + "/v1/chat/completions", headers=keyed.headers,
                     json={"messages": MESSAGES, "max_tokens": 0})
    assert bad.status_code == 400
    after = scrape(keyed)
    assert delta(after, before, "hpcmac_requests_total", endpoint="/v1/chat/completions",
                 status="200") == 2
    assert delta(after, before, "hpcmac_requests_total", endpoint="/v1/chat/completions",
                 status="400") == 1
    assert delta(after, before, "hpcmac_requests_total", endpoint="/v1/completions",
                 status="200") == 1
    assert delta(after, before, "hpcmac_requests_total", endpoint="/v1/messages",
                 status="200") == 1
    assert delta(after, before, "hpcmac_prompt_tokens_total") == \
        sum(u.prompt_tokens for u in usages) + m.usage.input_tokens
    assert delta(after, before, "hpcmac_completion_tokens_total") == \
        sum(u.completion_tokens for u in usages) + m.usage.output_tokens
    assert delta(after, before, "hpcmac_time_to_first_token_seconds_count") == 4
    # prompt tokens the prefix cache gave back: the sum of what each answer reported
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages) + \
        m.usage.cache_read_input_tokens
    assert delta(after, before, "hpcmac_prompt_cached_tokens_total") == cached > 0
    assert after[("hpcmac_prefix_cache_blocks", ())] > 0
    assert delta(after, before, "hpcmac_inter_token_latency_seconds_count") == \
        sum(u.completion_tokens - 1 for u in usages) + m.usage.output_tokens - 1
    assert after[("hpcmac_slots", ())] == 16
    assert after[("hpcmac_running_sequences", ())] == 0
    # the placement as labels: one series per rank, its host, layers and heads
    info = {dict(k[1])["rank"]: dict(k[1]) for k in after if k[0] == "hpcmac_rank_info"}
    assert sorted(info) == [str(r) for r in range(keyed.np)]
    assert {i["layout"] for i in info.values()} == {f"tp{keyed.tp}xpp{keyed.pp}"}
    # the stages' layers, in rank order, tile SmolLM2's 30 (each stage's tensor group
    # holds the same ones), and each stage's group splits its 9 heads
    spans = sorted({tuple(map(int, i["layers"].split("-"))) for i in info.values()})
    assert len(spans) == keyed.pp and spans[0][0] == 0 and spans[-1][1] == 30
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    assert sum(int(i["heads"]) for i in info.values()) == 9 * keyed.pp
    # every rank's busy time reaches rank 0 (reports at most once a second)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 15:
        busy = {dict(k[1])["rank"]: v for k, v in scrape(keyed).items()
                if k[0] == "hpcmac_rank_busy_seconds"}
        if len(busy) == keyed.np and all(v > 0 for v in busy.values()):
            break
        time.sleep(0.5)
    assert len(busy) == keyed.np and all(v > 0 for v in busy.values()), busy
    j = httpx.get(keyed.url + "/metrics.json", headers=keyed.headers).json()
    assert j["completion_tokens"] == after[("hpcmac_completion_tokens_total", ())]
    assert len(j["history"]) == 600 and sum(n for _, n in j["history"]) >= 18


def test_slots_show_the_running_sequence(keyed):
    n_prompt = keyed.client().completions.create(
        model=keyed.model(), prompt="Once upon a time", max_tokens=1).usage.prompt_tokens
    with httpx.stream("POST", keyed.url + "/v1/completions", headers=keyed.headers,
                      json={"prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                            "temperature": 0}, timeout=120) as r:
        lines = r.iter_lines()  # held: a closed iterator would close the stream
        got = 0
        while got < 3:
            got += next(lines).startswith("data:")
        slots = httpx.get(keyed.url + "/v1/slots", headers=keyed.headers).json()
    assert slots["slots"] == 16 and len(slots["data"]) == 1, slots
    s = slots["data"][0]
    assert s["state"] == "decode" and s["generated"] >= 2 and s["slot"] >= 0
    assert s["prompt_tokens"] == n_prompt and s["max_tokens"] == 400


def test_slots_snapshot_never_sees_a_half_updated_request():
    """/v1/slots' rows come from LiveRequests.snapshot on the HTTP thread while the
    scheduler admits requests (a slot and its cached prompt tokens) and counts their
    tokens. The window between a request's slot and its cached tokens is held open (a
    slot that takes 2 ms to set): every row read is still one the scheduler wrote whole
    (waiting with nothing cached, or in its slot with its cached tokens), and counts()
    agrees with the rows."""
    import threading

    from hpcmac.llm.model.sampling import SamplingParams
    from hpcmac.llm.parallel.live import LiveRequest, LiveRequests

    class SlowSlot(LiveRequest):
        @property
        def slot(self):
            return self._slot

        @slot.setter
        def slot(self, v):
            self._slot = v
            time.sleep(0.002 if v >= 0 else 0)  # the scheduler is mid-update here

    src, n = LiveRequests(capacity=64), 24
    keys = [src.submit(SlowSlot(prompt=[1] * (10 + i), max_tokens=8,
                                sampling=SamplingParams())) for i in range(n)]
    done, bad, seen = threading.Event(), [], [0]

    def scheduler():  # rank 0's main thread: admit each, then its tokens
        for k in keys:
            src.admitted(k, k % 16, cached=8)
            for t in range(3):
                src.token(k, t)
        done.set()

    t = threading.Thread(target=scheduler)
    t.start()
    while not done.is_set():
        for row in src.snapshot():
            seen[0] += row["slot"] >= 0
            if not ((row["slot"] < 0 and row["cached_tokens"] == 0) or
                    (row["slot"] == row["id"] % 16 and row["cached_tokens"] == 8)):
                bad.append(row)
        time.sleep(0.0005)
    t.join(30)
    assert not bad, bad[:3]
    assert seen[0] > n  # the reads did overlap the admissions
    rows = src.snapshot()
    assert [r["generated"] for r in rows] == [3] * n
    assert src.counts() == (0, n, sum(r["prompt_tokens"] + 3 for r in rows))


def test_anthropic_message_and_stream_equal_chat(keyed):
    want = greedy_chat(keyed, 12)
    a = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)
    m = a.messages.create(model=keyed.model(), max_tokens=12, messages=MESSAGES,
                          extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text" and m.content[0].text == want.choices[0].message.content
    assert m.usage.input_tokens == want.usage.prompt_tokens
    assert m.usage.output_tokens == want.usage.completion_tokens
    assert m.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length"
                             else "end_turn")
    with a.messages.stream(model=keyed.model(), max_tokens=12, messages=MESSAGES,
                           extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == m.content[0].text
    assert final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # a system prompt and a stop sequence taken from the greedy answer
    text = m.content[0].text
    stop = text.split()[2]
    s = a.messages.create(model=keyed.model(), max_tokens=12, messages=MESSAGES,
                          stop_sequences=[stop], extra_body=GREEDY)
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop
    assert s.content[0].text == text[:text.index(stop)]
    sysm = a.messages.create(model=keyed.model(), max_tokens=4, extra_body=GREEDY,
                             system="Answer in French.", messages=MESSAGES)
    ref = keyed.client().chat.completions.create(
        model=keyed.model(), temperature=0, max_tokens=4,
        messages=[{"role": "system", "content": "Answer in French."}, *MESSAGES])
    assert sysm.usage.input_tokens == ref.usage.prompt_tokens != m.usage.input_tokens
    assert sysm.content[0].text == ref.choices[0].message.content
    # an image block: 400 naming the block
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=keyed.model(), max_tokens=4, messages=[{
            "role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "iVBORw0KGgo="}}]}])
    assert "messages[0].content[1]" in str(e.value) and "'image'" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=keyed.model(), max_tokens=4, messages=MESSAGES,
                          extra_body={"temperature": 1.5})
    assert "temperature" in str(e.value)


WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "input_schema": {"type": "object", "required": ["city"], "additionalProperties": False,
                            "properties": {"city": {"type": "string", "maxLength": 20}}}}
#: one forced call (the grammar then ends the answer: fewer tokens than several calls)
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}


def test_anthropic_tool_use_streamed_and_not_and_its_result_fed_back(keyed):
    """tool_choice any: the grammar makes even SmolLM2 call the tool; the call comes back
    as a tool_use block (stop_reason tool_use), the same streamed; its tool_result is
    rendered into the next prompt."""
    pytest.importorskip("llguidance")
    a = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = a.messages.create(model=keyed.model(), max_tokens=40, messages=ask, tools=[WEATHER],
                          tool_choice=ONE_CALL, extra_body=GREEDY)
    assert m.stop_reason == "tool_use", m
    use = [b for b in m.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    assert set(use[0].input) == {"city"} and isinstance(use[0].input["city"], str)
    with a.messages.stream(model=keyed.model(), max_tokens=40, messages=ask, tools=[WEATHER],
                           tool_choice=ONE_CALL, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed] == [(use[0].name, use[0].input)]
    # as it was written: the tool_use block started with its name, its input in pieces
    with a.messages.stream(model=keyed.model(), max_tokens=40, messages=ask, tools=[WEATHER],
                           tool_choice=ONE_CALL, extra_body=GREEDY) as stream:
        events = list(stream)
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"], starts
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert len(pieces) >= 3 and json.loads("".join(pieces)) == use[0].input, pieces
    back = a.messages.create(model=keyed.model(), max_tokens=4, tools=[WEATHER],
                             extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                      "content": "18 C and sunny"}]}])
    # the oracle: the same conversation through the chat endpoint, OpenAI-shaped
    ref = keyed.client().chat.completions.create(
        model=keyed.model(), max_tokens=4, temperature=0, tools=[{"type": "function",
        "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                     "parameters": WEATHER["input_schema"]}}], messages=[
            *ask, {"role": "assistant", "content": "".join(
                b.text for b in m.content if b.type == "text"), "tool_calls": [
                {"id": use[0].id, "type": "function", "function": {
                    "name": "get_weather", "arguments": json.dumps(use[0].input)}}]},
            {"role": "tool", "tool_call_id": use[0].id, "content": "18 C and sunny"}])
    assert back.usage.input_tokens == ref.usage.prompt_tokens > m.usage.input_tokens
    assert "".join(b.text for b in back.content if b.type == "text") == \
        (ref.choices[0].message.content or "")


THINK = {"chat_template_kwargs": {"enable_thinking": True}}


def test_reasoning_in_chat_anthropic_and_responses(keyed):
    """The prompt opens <think> (chat_template_kwargs; Anthropic's thinking; Responses'
    reasoning.effort): SmolLM2's greedy answer, the same tokens as /v1/completions gives
    for the prompt's ids, is all reasoning (it writes no </think> in 10 tokens). It comes
    back as chat's reasoning_content (streamed as reasoning_content deltas), Anthropic's
    thinking block (thinking_delta pieces), Responses' reasoning item
    (response.reasoning_text.delta pieces); never as content."""
    from hpcmac.llm.model.tokenizer import load_tokenizer
    from hpcmac.llm.request import chat_ids

    c, model, n = keyed.client(), keyed.model(), 10
    tok = load_tokenizer("smollm2")
    tok.chat_template = THINK_TEMPLATE
    ids = chat_ids(tok, MESSAGES, variables={"enable_thinking": True})
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n")
    want = c.completions.create(model=model, prompt=ids, max_tokens=n,
                                temperature=0).choices[0].text.lstrip("\n")
    assert want and "</think>" not in want
    r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=n,
                                  temperature=0, extra_body=THINK)
    msg = r.choices[0].message
    assert msg.reasoning_content == want and not msg.content, msg
    assert r.usage.prompt_tokens == len(ids)
    pieces, content = [], ""
    for ch in c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=n,
                                        temperature=0, extra_body=THINK, stream=True):
        d = ch.choices[0].delta
        pieces += [d.reasoning_content] if getattr(d, "reasoning_content", None) else []
        content += d.content or ""
    assert len(pieces) > 1 and "".join(pieces) == want and not content
    # without the switch: SmolLM2's own prompt, no reasoning
    plain = greedy_chat(keyed, n).choices[0].message
    assert plain.content and getattr(plain, "reasoning_content", None) is None
    a = anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0)
    on = {"type": "enabled", "budget_tokens": 1024}
    m = a.messages.create(model=model, max_tokens=n, messages=MESSAGES, thinking=on,
                          extra_body=GREEDY)
    assert [(b.type, b.thinking) for b in m.content] == [("thinking", want)], m.content
    with a.messages.stream(model=model, max_tokens=n, messages=MESSAGES, thinking=on,
                           extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    thought = [e.delta.thinking for e in events if e.type == "content_block_delta"
               and e.delta.type == "thinking_delta"]
    assert len(thought) > 1 and "".join(thought) == want
    assert [b.type for b in final.content] == ["thinking"] and final.content[0].thinking == want
    off = a.messages.create(model=model, max_tokens=n, messages=MESSAGES, extra_body=GREEDY,
                            thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == plain.content
    rr = c.responses.create(model=model, input=QUESTION, max_output_tokens=n, temperature=0,
                            reasoning={"effort": "low"})
    assert [o.type for o in rr.output] == ["reasoning"] and rr.output_text == ""
    assert rr.output[0].content[0].text == want
    events = list(c.responses.create(model=model, input=QUESTION, max_output_tokens=n,
                                     temperature=0, reasoning={"effort": "low"}, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[2].item.type == "reasoning"
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == want
    assert next(e.text for e in events if e.type == "response.reasoning_text.done") == want
    assert events[-1].response.output[0].content[0].text == want
    assert "response.output_text.delta" not in kinds


def test_responses_text_and_stream_equal_chat(keyed):
    want = greedy_chat(keyed, 5).choices[0].message.content  # cut: the answer is longer
    c = keyed.client()
    r = c.responses.create(model=keyed.model(), input=QUESTION, max_output_tokens=5,
                           temperature=0)
    assert r.output_text == want and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 5
    events = list(c.responses.create(model=keyed.model(), input=MESSAGES,
                                     max_output_tokens=5, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want == events[-1].response.output_text
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=keyed.model(), input=QUESTION, store=True)
    assert "store" in str(e.value)


def test_responses_function_call_streamed_and_not_and_its_output_fed_back(keyed):
    pytest.importorskip("llguidance")
    c = keyed.client()
    fn = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
          "parameters": WEATHER["input_schema"]}
    ask = "What is the weather in Paris?"
    r = c.responses.create(model=keyed.model(), input=ask, tools=[fn], tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    events = list(c.responses.create(model=keyed.model(), input=ask, tools=[fn],
                                     tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=40,
                                     temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(d.type, d.name, json.loads(d.arguments)) for d in done
            if d.type == "function_call"] == [("function_call", "get_weather", args)]
    # the call streamed as it was written: added with its name, then its arguments in
    # pieces that join to what .done and the item say
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    assert events[added].item.type == "function_call" and \
        events[added].item.name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) >= 3 and kinds.index("response.function_call_arguments.delta") > added
    fin = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(pieces) == fin.arguments == done[-1].arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[-1].arguments == fin.arguments
    back = c.responses.create(model=keyed.model(), max_output_tokens=4, temperature=0,
                              tools=[fn], input=[
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id,
         "output": "18 C and sunny"}])
    ref = c.chat.completions.create(
        model=keyed.model(), max_tokens=4, temperature=0, tools=[{"type": "function",
        "function": {k: fn[k] for k in ("name", "description", "parameters")}}], messages=[
            {"role": "user", "content": ask},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": calls[0].call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 C and sunny"}])
    assert back.usage.input_tokens == ref.usage.prompt_tokens
    assert back.output_text == (ref.choices[0].message.content or "")


def _chromium():
    """(chromium binary, chromedriver), or skip saying what is missing."""
    pytest.importorskip("selenium", reason="selenium not installed (the test extra)")
    found = [shutil.which(n) for n in ("chromium", "chromedriver")]
    if not all(found):
        pytest.skip("chromium / chromium-driver not installed (tools/system-deps installs "
                    "them as root with apt-get)")
    return found


def test_page_renders_the_cluster_and_streams_a_chat(keyed):
    """The page in headless Chromium: the hosts and ranks of the job, its links, the
    placement and live figures, and a chat answer streamed through the same API (greedy:
    the same text as the openai client's). A screenshot is saved under out/."""
    binary, driver_path = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    want = greedy_chat(keyed, 16).choices[0].message.content
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,900"):
        opts.add_argument(a)
    d = webdriver.Chrome(options=opts, service=Service(driver_path))
    try:
        wait = WebDriverWait(d, 60)
        d.get(keyed.url + "/")
        wait.until(lambda d: d.find_element(By.ID, "key-box").is_displayed())
        d.find_element(By.ID, "key").send_keys(KEY)
        d.find_element(By.ID, "key-save").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#hosts .rank")) == keyed.np)
        hosts = d.find_elements(By.CSS_SELECTOR, "#hosts .host")
        assert [h.get_attribute("data-host") for h in hosts] == [os.uname().nodename]
        placed = d.find_elements(By.CSS_SELECTOR, "#placement tr.placed")
        assert len(placed) == keyed.np
        links = [tr.text for tr in d.find_elements(By.CSS_SELECTOR, "#links tr.link")]
        if keyed.np == 2:
            assert links == ["rank 0 → rank 1 tensor shared memory (shmsum) + mpi, same host"]
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#busy tr.busy-rank"))
                   == keyed.np)
        temp = d.find_element(By.ID, "chat-temp")
        temp.clear()
        temp.send_keys("0")
        mx = d.find_element(By.ID, "chat-max")
        mx.clear()
        mx.send_keys("16")
        d.find_element(By.ID, "chat-input").send_keys(QUESTION)
        d.find_element(By.ID, "chat-send").click()
        wait.until(lambda d: d.find_elements(
            By.CSS_SELECTOR, "#chat-log .msg.assistant[data-done='1'], #chat-log .msg.error"))
        answer = d.find_element(By.CSS_SELECTOR, "#chat-log .msg.assistant")
        assert answer.get_attribute("textContent") == want
        wait.until(lambda d: d.find_element(By.ID, "tok-s").text not in ("-", ""))
        out = ROOT / "out"
        out.mkdir(exist_ok=True)
        shot = Path(out / f"serve-page-np{keyed.np}.png")
        d.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
    finally:
        d.quit()
