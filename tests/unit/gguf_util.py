"""What the GGUF family tests share: greedy runs of transformers, of hpcmac and of
llama.cpp (the ``xllamacpp`` wheel) on one prompt, and the comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcmac.llm.model.stage import Batch

#: 20 tokens: longer than the sliding windows of the tests' models
PROMPT = [3, 17, 42, 5, 9, 11, 60, 2, 8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
N = 16


def hf_greedy(model, prompt, steps=N):
    """transformers' greedy tokens and per-step logits (one torch thread)."""
    import torch

    torch.set_num_threads(1)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), [lg[0].numpy() for lg in out.logits]


def our_greedy(stage, prompt=PROMPT, steps=N):
    """hpcmac's greedy tokens and per-step logits on one whole-model stage."""
    cache = stage.new_cache(1, len(prompt) + steps)
    h = stage.forward(stage.embed(prompt), Batch([0], [len(prompt)], [0]), cache)
    logits = [stage.logits(h[-1:])[0]]
    toks = [int(np.argmax(logits[-1]))]
    for i in range(steps - 1):
        h = stage.forward(stage.embed(toks[-1:]), Batch([0], [1], [len(prompt) + i]), cache)
        logits.append(stage.logits(h)[0])
        toks.append(int(np.argmax(logits[-1])))
    return toks, logits


def assert_same_run(got, ref, what):
    """16 greedy tokens equal; every step's logits within 1e-4 of the largest."""
    assert got[0] == ref[0], what
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max(), err_msg=what)


#: the fixtures' EOS token (hpcmac.llm.model.fixtures.write_gguf)
EOS = 1


def greedy_without_eos(stage, prompt=PROMPT, steps=N) -> list[int]:
    """hpcmac's greedy tokens as llama.cpp chooses them under ``ignore_eos``: the EOS token
    never chosen (llama.cpp biases its end-of-generation tokens to -inf)."""
    cache = stage.new_cache(1, len(prompt) + steps)
    h = stage.forward(stage.embed(prompt), Batch([0], [len(prompt)], [0]), cache)
    toks = []
    for i in range(steps):
        lg = np.array(stage.logits(h[-1:])[0], dtype=np.float64)
        lg[EOS] = -np.inf
        toks.append(int(np.argmax(lg)))
        h = stage.forward(stage.embed(toks[-1:]), Batch([0], [1], [len(prompt) + i]), cache)
    return toks


def llama_cpp_greedy(path: Path, prompt=PROMPT, steps=N) -> list[int]:
    """llama.cpp's greedy tokens on ``path`` (float32 KV cache, no flash attention: its
    defaults round K and V to float16). The placeholder vocabulary spells token i ``t{i}``."""
    xlc = pytest.importorskip("xllamacpp")
    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_ctx = 128
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
    p.cache_type_k = p.cache_type_v = xlc.ggml_type.GGML_TYPE_F32
    p.flash_attn_type = 0
    server = xlc.Server(p)
    try:
        res = server.handle_completions({"prompt": prompt, "n_predict": steps,
                                         "temperature": 0, "ignore_eos": True,
                                         "cache_prompt": False})
    finally:
        del server
    return [int(t) for t in res["choices"][0]["text"].split("t")[1:]]
