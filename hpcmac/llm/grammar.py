"""Constrained decoding: a grammar per sequence, and the token mask it allows at each step.

The engine is llguidance (docs/serve.md says why, with the measurements). A
grammar travels as llguidance's own serialized form (a string), built on the
HTTP side from ``response_format`` or a tool-call format (:mod:`.tools`) and
checked there, so that a bad one is a 400; the rank that samples builds one
:class:`Constraint` per sequence from it and asks it for a mask before each
sampled step. A mask is packed: one bit per vocabulary entry, 32 to an int32
word, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed
(llguidance's layout). With a vocabulary-parallel head each rank applies its
own slice of the same mask (:func:`apply_mask` with ``v0``).

Nothing here knows HTTP or MPI: plain dicts and strings in, strings and numpy
arrays out.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import numpy as np

#: what a JSON schema may be before it is refused unread (characters of its JSON text)
MAX_SCHEMA_CHARS = 256 * 1024
#: JSON without free whitespace between tokens: a small model left free to write spaces
#: may write nothing else until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A grammar the engine refuses: ``path`` says where (a JSON path into the request)."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.message, self.path = message, path


def _llg():
    try:
        import llguidance
    except ImportError:  # the serve extra brings it
        raise GrammarError("constrained decoding needs llguidance (pip install "
                           "'hpcmac[serve]')", "response_format") from None
    return llguidance


# -- the vocabulary ------------------------------------------------------------------------

_LOCK = threading.Lock()
_CACHE: dict[tuple[int, int], object] = {}
_SOURCE: dict[str, object] = {}


def ll_tokenizer(tok, n_vocab: int, eos_ids=()) -> object:
    """llguidance's view of ``tok`` (a :class:`~hpcmac.llm.model.tokenizer.Tokenizer`) with
    ``n_vocab`` entries (the model's head, which may be padded past the tokenizer's).
    Built once per tokenizer (0.2 s at 49k entries, 1.2 s at 150k) and cached."""
    key = (id(tok), int(n_vocab))
    with _LOCK:
        lt = _CACHE.get(key)
        if lt is None:
            eos = [int(e) for e in (tok.eos_ids or eos_ids)] or None
            lt = _llg().LLTokenizer(tok.tk.to_str(), n_vocab=int(n_vocab), eos_token=eos)
            _CACHE[key] = lt
        return lt


def configure(load: Callable[[], object], n_vocab: int, eos_ids=()) -> None:
    """Where this rank finds its tokenizer when a constrained sequence arrives (local:
    ``serve`` calls it on every rank; only the rank that samples ever loads it)."""
    _SOURCE.clear()
    _SOURCE.update(load=load, n_vocab=int(n_vocab), eos=tuple(eos_ids))


def default_tokenizer():
    """The tokenizer :func:`configure` named, loaded on first use."""
    if not _SOURCE:
        raise RuntimeError("constrained decoding: no tokenizer configured on this rank")
    with _LOCK:
        if "tok" not in _SOURCE:
            _SOURCE["tok"] = _SOURCE["load"]()
        tok = _SOURCE["tok"]
    if tok is None:
        raise RuntimeError("constrained decoding needs the checkpoint's tokenizer")
    return ll_tokenizer(tok, _SOURCE["n_vocab"], _SOURCE["eos"])


def warm() -> None:
    """Load the configured tokenizer now (the sampling rank, at start), if there is one
    (a checkpoint without one serves token ids, and no grammar is ever accepted)."""
    if not _SOURCE:
        return
    with _LOCK:
        if "tok" not in _SOURCE:
            _SOURCE["tok"] = _SOURCE["load"]()
    if _SOURCE["tok"] is not None:
        default_tokenizer()


# -- grammars ------------------------------------------------------------------------------

def json_schema(schema, path: str, tokenizer=None) -> str:
    """The grammar of JSON values valid under ``schema`` (a dict, or True for any object:
    ``json_object``); GrammarError naming the schema path that the engine cannot compile."""
    llg = _llg()
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise GrammarError(f"'{path}' must be a JSON schema object", path)
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise GrammarError(f"'{path}' is over {MAX_SCHEMA_CHARS} characters", path)
    why = _schema_error(llg, schema, tokenizer)
    if not why:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    where = _locate(llg, schema, why, tokenizer)
    at = path + where
    raise GrammarError(f"'{at}': the grammar engine cannot compile this schema: "
                       f"{' '.join(why.split())[:240]}", at)


def lark(text: str, path: str, tokenizer=None) -> str:
    """A Lark grammar (llguidance's dialect, with ``%json{...}`` for a schema), checked."""
    llg = _llg()
    g = llg.LLMatcher.grammar_from_lark(text)
    why = llg.LLMatcher.validate_grammar(g, tokenizer)
    if why and not why.startswith("WARNING"):
        raise GrammarError(f"'{path}': the grammar engine cannot compile it: "
                           f"{' '.join(why.split())[:240]}", path)
    return g


def _schema_error(llg, schema: dict, tokenizer) -> str:
    try:
        g = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:
        return str(exc) or "not a valid schema"
    why = llg.LLMatcher.validate_grammar(g, tokenizer)
    return "" if why.startswith("WARNING") else why


def _subschemas(node, path: str) -> Iterator[tuple[str, dict]]:
    """(JSON path suffix, sub-schema) of every schema nested in ``node``, deepest last."""
    if not isinstance(node, dict):
        return
    for key, v in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas") and isinstance(v, dict):
            for name, sub in v.items():
                if isinstance(sub, dict):
                    p = f"{path}.{key}.{name}"
                    yield p, sub
                    yield from _subschemas(sub, p)
        elif key in ("items", "additionalProperties", "not", "if", "then", "else",
                     "contains", "propertyNames") and isinstance(v, dict):
            p = f"{path}.{key}"
            yield p, v
            yield from _subschemas(v, p)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems", "items") and \
                isinstance(v, list):
            for i, sub in enumerate(v):
                if isinstance(sub, dict):
                    p = f"{path}.{key}[{i}]"
                    yield p, sub
                    yield from _subschemas(sub, p)


def _locate(llg, root: dict, why: str, tokenizer) -> str:
    """The deepest sub-schema of ``root`` that fails alone with the same message (the
    root's ``$defs``/``definitions`` beside it, so its references still resolve); "" for
    the root itself. The engine's messages say what, not where."""
    defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict)}
    best = ""
    for p, sub in _subschemas(root, ""):
        if _schema_error(llg, {**defs, **sub}, tokenizer) == why:
            if p.count(".") + p.count("[") >= best.count(".") + best.count("["):
                best = p
    return best


# -- one sequence --------------------------------------------------------------------------

def mask_words(n_vocab: int) -> int:
    """int32 words of a packed mask over ``n_vocab`` tokens."""
    return (int(n_vocab) + 31) // 32


class Constraint:
    """One sequence's grammar state on the sampling rank (local)."""

    def __init__(self, grammar: str, tokenizer=None):
        llg = _llg()
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
        self.m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if self.m.is_error():
            raise ValueError(f"grammar: {self.m.get_error()[:240]}")

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32, :func:`mask_words` long)."""
        assert row.dtype == np.int32 and row.flags["C_CONTIGUOUS"]
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self.m.is_error():
            raise ValueError(f"grammar: {self.m.get_error()[:240]}")

    def accept(self, token: int) -> None:
        """The sampled token; ValueError if the grammar forbids it."""
        if not self.m.is_stopped() and not self.m.consume_token(int(token)):
            raise ValueError(f"grammar: token {token} is not allowed here "
                             f"({self.m.get_error()[:200]})")

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow."""
        return self.m.is_stopped()


def allowed(mask: np.ndarray, v0: int, n: int) -> np.ndarray:
    """bool (k, n): whether tokens ``[v0, v0 + n)`` are allowed by packed ``mask`` (k, W)."""
    m = np.atleast_2d(mask)
    w0, w1 = v0 // 32, -(-(v0 + n) // 32)
    bits = np.unpackbits(np.ascontiguousarray(m[:, w0:w1]).view(np.uint8), axis=1,
                         bitorder="little")
    off = v0 - 32 * w0
    return bits[:, off:off + n].astype(bool)


def apply_mask(logits: np.ndarray, mask: np.ndarray, v0: int = 0) -> np.ndarray:
    """``logits`` (k, n) or (n,) of tokens ``[v0, v0 + n)`` with the tokens ``mask`` (k, W)
    forbids set to -inf (in place when it can; returns the array)."""
    flat = logits.ndim == 1
    x = np.atleast_2d(logits)
    ok = allowed(mask, v0, x.shape[1])
    if ok.shape[1] < x.shape[1]:  # the head is padded past the mask: never allowed
        ok = np.pad(ok, ((0, 0), (0, x.shape[1] - ok.shape[1])))
    x[~ok] = -np.inf
    return x[0] if flat else x
