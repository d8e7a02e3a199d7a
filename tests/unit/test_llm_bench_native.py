"""``python -m hpcmac.bench.llm --llamacpp-native VENV``'s side of the protocol, against a stub
``llama_cpp`` in a fake venv (a real build takes minutes and is no part of ``make test``):
the subprocess is run in VENV's Python with the GGUF, the thread count and OMP_NUM_THREADS,
prefills 16 tokens below the vocabulary, feeds back each step's argmax, and reports the
build's features; a build that crashes or fails on one file is a reason, not a traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpcmac.bench.llm import native_python, native_rate

#: the stub: logits that depend on every token so far, so a wrong token fed back is seen;
#: its calls appended to $STUB_LOG as JSON lines; $STUB_MODE makes it fail or crash
STUB = '''
import json, os, signal
import numpy as np

def _log(**kw):
    with open(os.environ["STUB_LOG"], "a") as f:
        f.write(json.dumps(kw) + "\\n")

def llama_print_system_info():
    return b"CPU : AVX512 = 1 | STUB = 1 | "

class Llama:
    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose):
        mode = os.environ.get("STUB_MODE", "")
        if mode == "fail":
            raise ValueError("Failed to load model from file: " + model_path)
        if mode == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        self.vocab = int(os.environ["STUB_VOCAB"])
        self.scores = np.zeros((n_ctx, self.vocab), np.float32)
        self.n_tokens = 0
        self._h = 0
        _log(init=dict(path=os.path.basename(model_path), n_ctx=n_ctx, threads=n_threads,
                       threads_batch=n_threads_batch, omp=os.environ.get("OMP_NUM_THREADS")))

    def reset(self):
        self.n_tokens, self._h = 0, 0
        _log(reset=True)

    def eval(self, tokens):
        ok = True
        for t in tokens:
            assert 0 <= t < self.vocab, t
            if self.n_tokens >= 16:  # a decode step: the greedy token of the last logits
                ok &= t == int(np.argmax(self.scores[self.n_tokens - 1]))
            self._h = (self._h * 31 + t + 1) % 9973
            row = np.sin(np.arange(self.vocab, dtype=np.float32) * (self._h + 0.5))
            self.scores[self.n_tokens] = row
            self.n_tokens += 1
        _log(eval=len(tokens), greedy=bool(ok))
'''


@pytest.fixture
def venv(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "llama_cpp.py").write_text(STUB)
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    py = bin_ / "python"
    py.write_text(f'#!/bin/sh\nPYTHONPATH={lib} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("STUB_LOG", str(log))
    monkeypatch.setenv("STUB_VOCAB", "50")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the bench must set its own
    gguf = tmp_path / "llama-MXFP4.gguf"
    gguf.write_bytes(b"GGUF")
    return str(tmp_path / "venv"), gguf, log


@pytest.mark.timeout(60)
def test_native_rate_runs_greedy_decode_in_the_venv(venv):
    path, gguf, log = venv
    python = native_python(path)
    assert python == str(Path(path) / "bin" / "python")
    rate, system = native_rate(python, gguf, 2, 5, 50)
    assert rate is not None and rate > 0, system
    assert system == "CPU : AVX512 = 1 | STUB = 1 | "
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert calls[0]["init"] == dict(path=gguf.name, n_ctx=256, threads=2, threads_batch=2,
                                    omp="2")
    # twice (the first warms up): reset, the 16-token prompt, 5 one-token greedy steps
    once = [{"reset": True}, {"eval": 16, "greedy": True}] + [{"eval": 1, "greedy": True}] * 5
    assert calls[1:] == once + once


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, says", [
    ("fail", "llama-MXFP4.gguf: exit 1: ValueError: Failed to load model from file: "),
    ("crash", "llama-MXFP4.gguf: killed by SIGSEGV"),
])
def test_a_failing_build_is_a_reason_not_an_exception(venv, monkeypatch, mode, says):
    path, gguf, _ = venv
    monkeypatch.setenv("STUB_MODE", mode)
    rate, why = native_rate(native_python(path), gguf, 1, 3, 50)
    assert rate is None and why.startswith(says), why
