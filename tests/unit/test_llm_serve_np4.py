"""The structured-output, tool, logprob, key, metrics and Anthropic tests at ``--tp 2
--pp 2`` on 4 ranks: one keyed server for the module (a pipeline of two stages, each a
tensor group of 2, so the last stage's vocabulary-parallel head masks and samples on
two ranks and hands the tokens back to rank 0), each test the np 1 / np 2 test itself
(test_llm_serve_structured, test_llm_serve_ops) run against it."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")
import test_llm_serve_ops as ops  # noqa: E402  (the tests themselves, one place)
import test_llm_serve_structured as structured  # noqa: E402

from tests.unit.test_llm_serve import Server  # noqa: E402

pytestmark = pytest.mark.slow  # 4 ranks oversubscribed: the start alone is the most of it

LAYOUT = ("--tp", "2", "--pp", "2")


@pytest.fixture(scope="module")
def np4():
    s = Server(4, *LAYOUT, key=ops.KEY)
    s.np, s.layout, s.tp, s.pp = 4, LAYOUT, 2, 2
    yield s
    s.stop()


def test_json_schema_answers_validate(np4):
    structured.test_json_schema_answers_validate(np4)


def test_required_tool_call_streaming_and_not(np4):
    structured.test_required_tool_call_streaming_and_not(np4)


def test_logprobs_chat_and_completion(np4):
    structured.test_logprobs_chat_and_completion(np4)


def test_wrong_key_is_401_and_no_work_is_done(np4):
    ops.test_wrong_key_is_401_and_no_work_is_done(np4)


def test_metrics_move_by_exactly_the_requests_sent(np4):
    ops.test_metrics_move_by_exactly_the_requests_sent(np4)


def test_anthropic_message_and_stream_equal_chat(np4):
    ops.test_anthropic_message_and_stream_equal_chat(np4)


def test_anthropic_tool_use_streamed_and_not_and_its_result_fed_back(np4):
    ops.test_anthropic_tool_use_streamed_and_not_and_its_result_fed_back(np4)
