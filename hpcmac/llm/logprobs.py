"""Logprobs in OpenAI's shapes, from the rows the pipeline hands back.

A row (float64) is what the rank that samples computed for one token of a sequence
that asked for ``k`` top logprobs: the chosen token's logprob, the ``k`` largest
logprobs, their ``k`` token ids (hpcmac.llm.parallel.pipeline, ``TAG_LOGP``). They are
the model's own distribution: log-softmax of the logits before the grammar's mask, the
repetition penalty and the temperature. Pure functions; nothing here knows HTTP or MPI.
"""

from __future__ import annotations

import numpy as np


def _piece(tok, t: int) -> str:
    return tok.decode([int(t)]) if tok is not None else str(int(t))


def _entry(tok, t: int, lp: float) -> dict:
    s = _piece(tok, t)
    return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8"))}


def chat(tok, items: list[tuple[int, np.ndarray]]) -> dict:
    """``choices[].logprobs`` of a chat completion: ``{"content": [...]}`` for
    ``items`` = [(token id, row)]."""
    out = []
    for t, row in items:
        k = (len(row) - 1) // 2
        e = _entry(tok, t, row[0])
        e["top_logprobs"] = [_entry(tok, int(i), v) for v, i in zip(row[1:1 + k], row[1 + k:])]
        out.append(e)
    return {"content": out}


def completion(tok, items: list[tuple[int, np.ndarray]], offset: int = 0) -> dict:
    """``choices[].logprobs`` of a (legacy) completion: tokens, token_logprobs,
    top_logprobs ({token: logprob}) and text_offset (from ``offset`` characters)."""
    tokens, lps, tops, offs = [], [], [], []
    at = offset
    for t, row in items:
        k = (len(row) - 1) // 2
        s = _piece(tok, t)
        tokens.append(s)
        lps.append(float(row[0]))
        tops.append({_piece(tok, int(i)): float(v) for v, i in zip(row[1:1 + k], row[1 + k:])})
        offs.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}
