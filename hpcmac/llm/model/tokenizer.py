"""Tokenizers: ``tokenizer.json`` of a Hugging Face folder (or its tiktoken-style
``tiktoken.model``, Kimi's), or the one embedded in a GGUF file.

Both become a ``tokenizers.Tokenizer`` wrapped in :class:`Tokenizer`, which adds
the chat template (rendered with jinja2, as transformers does), the BOS rule,
the EOS ids and a streaming decoder that never emits half a UTF-8 character.
"""

from __future__ import annotations

import threading
from pathlib import Path

from hpcmac.errors import UsageError
from hpcmac.io.inputs import parse_json, read_text
from hpcmac.llm.model.config import is_gguf, resolve_model

# pre-tokenizer splits of byte-level BPE vocabularies, by GGUF tokenizer.ggml.pre
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
#: o200k's split (gpt-oss): words by letter case, a contraction kept on its word, numbers
#: of up to 3 digits, punctuation runs with trailing newlines and slashes
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
           "deepseek-v3": _LLAMA3_SPLIT, "gpt-4o": _GPT4O_SPLIT}
#: the GGUF pre-tokenizers read with GPT-2's own split, and SmolLM2's (digits one by one)
_GPT2_PRES = ("default", "gpt2", "gpt-2")
_PRES = (*_SPLITS, *_GPT2_PRES, "smollm")

_LOCK = threading.Lock()

#: a minimal ChatML template, used when a checkpoint has none
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Tokenizer:
    """Text <-> token ids for one model (global: the same on every rank)."""

    def __init__(self, tk, bos_id: int | None, eos_ids: list[int], add_bos: bool,
                 chat_template: str | None, bos_token: str = "", eos_token: str = ""):
        self.tk = tk
        self.bos_id, self.eos_ids, self.add_bos = bos_id, list(eos_ids), add_bos
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._tmpl: tuple[str, object] | None = None  # (template text, compiled)

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``.

        special : whether special-token strings in ``text`` (``<|im_start|>``, ``</s>``)
            become their control tokens (True, for text the caller wrote, e.g. a
            rendered chat template) or are tokenized as ordinary text (False, for
            text a user sent: a message cannot then inject roles).
        """
        tk = self.tk if special else self._as_text()
        ids = tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids = [self.bos_id] + ids
        return ids

    def _as_text(self):
        """A copy of the tokenizer that splits special-token strings as text (its own
        object: the flag is the tokenizer's, and several threads encode at once)."""
        with _LOCK:
            if getattr(self, "_text_tk", None) is None:
                from tokenizers import Tokenizer as TK

                tk = TK.from_str(self.tk.to_str())
                tk.encode_special_tokens = True
                self._text_tk = tk
        return self._text_tk

    @property
    def specials(self) -> tuple[str, ...]:
        """The special-token strings (control tokens) of this vocabulary."""
        return tuple(t.content for t in self.tk.get_added_tokens_decoder().values()
                     if t.special)

    @property
    def max_token_bytes(self) -> int:
        """The longest vocabulary entry in UTF-8 bytes: no token covers more bytes of
        text, so a text of B bytes has at least B / max_token_bytes tokens."""
        if getattr(self, "_max_bytes", None) is None:
            self._max_bytes = max(len(t.encode("utf-8")) for t in self.tk.get_vocab())
        return self._max_bytes

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text for chat ``messages`` ([{"role": ..., "content": ...}]); ``tools``
        as transformers passes them (OpenAI's ``[{"type": "function", ...}]``); ``kwargs``:
        more variables (``enable_thinking``), as transformers' ``apply_chat_template``
        hands its extra keyword arguments to the template."""
        import jinja2

        try:  # a template that refuses its input (raise_exception, a missing field): one line
            tmpl = self._compiled()
            return tmpl.render(**kwargs, messages=messages,
                               add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token, eos_token=self.eos_token, tools=tools)
        except jinja2.TemplateError as exc:
            raise UsageError(f"chat template: {exc}") from None

    def _compiled(self):
        """The chat template compiled (once per template text: parsing and compiling it
        took 2.8 ms of CPU a request, holding the GIL, against a render's fraction of a
        millisecond; a jinja2 template renders from several threads at once)."""
        import jinja2.sandbox

        text = self.chat_template or CHATML
        got = self._tmpl
        if got is not None and got[0] == text:
            return got[1]
        # a checkpoint's template is code from whoever published it: sandboxed, as
        # transformers renders it (not its immutable sandbox: Kimi K2's templates append
        # to a list of their own)
        env = jinja2.sandbox.SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(msg):
            raise UsageError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            import json  # as transformers' renderer: no HTML escaping

            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            import datetime

            return datetime.datetime.now().strftime(fmt)

        env.filters["tojson"] = tojson
        env.globals["strftime_now"] = strftime_now
        tmpl = env.from_string(text)  # a syntax error: jinja2.TemplateError, the caller's
        self._tmpl = (text, tmpl)
        return tmpl

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Turns tokens into text as they come; holds back incomplete UTF-8 sequences."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.emitted = 0  # characters of the full decode already returned

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new = text[self.emitted:]
        self.emitted = len(text)
        return new


def _from_folder(folder: Path) -> Tokenizer | None:
    from tokenizers import Tokenizer as TK

    path = folder / "tokenizer.json"
    if not path.exists() and not (folder / TIKTOKEN_FILE).exists():
        return None
    tcfg: dict = {}
    if (folder / "tokenizer_config.json").exists():  # bounded reads: a FIFO never hangs
        where = folder / "tokenizer_config.json"
        tcfg = _json_object(read_text(where, "tokenizer config", CONFIG_LIMIT), where)
    if path.exists():
        _regular(path, "tokenizer")  # the Rust reader would wait on a FIFO for ever
        tk = TK.from_file(str(path))
    else:
        tk = _from_tiktoken(folder, tcfg)

    def tok_str(v):
        return v.get("content") if isinstance(v, dict) else v

    bos, eos = tok_str(tcfg.get("bos_token")), tok_str(tcfg.get("eos_token"))
    bos_id = tk.token_to_id(bos) if bos else None
    eos_ids = [tk.token_to_id(eos)] if eos and tk.token_to_id(eos) is not None else []
    gen = folder / "generation_config.json"
    if gen.exists():
        e = _json_object(read_text(gen, "generation config", CONFIG_LIMIT), gen).get(
            "eos_token_id")
        for x in (e if isinstance(e, list) else [e] if e is not None else []):
            if x not in eos_ids:
                eos_ids.append(int(x))
    template = tcfg.get("chat_template")
    if template is None and (folder / "chat_template.jinja").exists():
        template = read_text(folder / "chat_template.jinja", "chat template", CONFIG_LIMIT)
    return Tokenizer(tk, bos_id, eos_ids, bool(tcfg.get("add_bos_token", False)), template,
                     bos or "", eos or "")


#: what a tokenizer folder's files may hold: tokenizer.json / tiktoken.model (a 200k
#: vocabulary is ~10-30 MB), and the JSON configs and templates beside them
TOKENIZER_LIMIT = 256 << 20
CONFIG_LIMIT = 16 << 20


def _regular(path: Path, what: str) -> None:
    import stat

    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise UsageError(f"{what} {path}: expected a regular file")
    if path.stat().st_size > TOKENIZER_LIMIT:
        raise UsageError(f"{what} {path}: expected at most {TOKENIZER_LIMIT >> 20} MiB")


def _json_object(text: str, where: Path) -> dict:
    data = parse_json(text, str(where))
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a JSON object, found {type(data).__name__}")
    return data


#: a tiktoken-style BPE (Kimi K2 / K2.5): one "base64-token rank" line per token
TIKTOKEN_FILE = "tiktoken.model"
#: the file that holds its split pattern (``pat_str``), shipped beside it
TIKTOKEN_CODE = "tokenization_kimi.py"


def _tiktoken_pattern(folder: Path) -> str:
    """``pat_str`` of the folder's tokenizer code, read as data (never run): a string
    constant or ``"|".join([...constants])``; one line if there is none."""
    import ast

    where = folder / TIKTOKEN_CODE
    if where.exists():
        for node in ast.walk(ast.parse(read_text(where, "tokenizer code", CONFIG_LIMIT),
                                       str(where))):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "pat_str" for t in node.targets):
                v = node.value
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    return v.value
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and \
                        v.func.attr == "join" and isinstance(v.func.value, ast.Constant) and \
                        len(v.args) == 1 and isinstance(v.args[0], (ast.List, ast.Tuple)):
                    parts = [e.value for e in v.args[0].elts if isinstance(e, ast.Constant)]
                    if len(parts) == len(v.args[0].elts) and all(isinstance(x, str)
                                                                  for x in parts):
                        return v.func.value.value.join(parts)
    raise UsageError(f"{where}: no pat_str (the split pattern of {TIKTOKEN_FILE}) found; "
                     "expected a string constant or '|'.join([...]) of them")


def _from_tiktoken(folder: Path, tcfg: dict):
    """A ``tokenizers.Tokenizer`` equal to tiktoken's encoding of ``tiktoken.model`` (Kimi):
    byte-level BPE where every split of a token into two tokens is a merge of that token's
    rank (tiktoken merges the adjacent pair whose join has the lowest rank; a piece that is
    a token is taken whole, as tiktoken does), the split ``pat_str``, the special tokens of
    ``tokenizer_config.json``'s ``added_tokens_decoder`` after the ranks (gaps named
    ``<|reserved_token_N|>``)."""
    import base64
    import binascii

    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as TK

    path = folder / TIKTOKEN_FILE
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(read_text(path, "tokenizer", TOKENIZER_LIMIT).splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise UsageError(f"{path}:{n}: expected 'base64-token rank'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UsageError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    b2u = _bytes_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    merges = [(spell(tok[:i]), spell(tok[i:]))
              for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1])
              for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
    tk = TK(models.BPE(vocab={spell(t): r for t, r in ranks.items()}, merges=merges,
                       fuse_unk=False, ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_tiktoken_pattern(folder)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    added = tcfg.get("added_tokens_decoder") or {}
    ids = {int(k): v for k, v in added.items() if str(k).isdigit() and isinstance(v, dict)}
    if ids and min(ids) < len(ranks):
        raise UsageError(f"{folder / 'tokenizer_config.json'}: added token id {min(ids)} is "
                         f"inside the {len(ranks)} ranks of {path.name}")
    for i in range(len(ranks), max(ids, default=len(ranks) - 1) + 1):
        v = ids.get(i, {"content": f"<|reserved_token_{i}|>", "special": True})
        tk.add_special_tokens([AddedToken(str(v.get("content")), normalized=False,
                                          special=bool(v.get("special", True)))])
    return tk


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _from_gguf(path: Path) -> Tokenizer | None:
    from hpcmac.llm.model.gguf_loader import gguf_reader

    r = gguf_reader(path)

    def field(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    model = field("tokenizer.ggml.model")
    if model is None:
        return None
    if model not in ("gpt2", "llama"):
        raise UsageError(f"{path}: embedded tokenizer {model!r} is not supported "
                         "(byte-level BPE 'gpt2' and SentencePiece BPE 'llama' are); "
                         "use --prompt-ids")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "llama":
        tk = _sentencepiece_bpe(tokens, field("tokenizer.ggml.scores"), types,
                                bool(field("tokenizer.ggml.add_space_prefix", True)), path)
    else:
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in _PRES:
            raise UsageError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported; expected "
                             f"one of {', '.join(_PRES)} (or use --prompt-ids)")
        tk = _byte_level_bpe(tokens, types, field("tokenizer.ggml.merges") or [], pre)
    bos_id = field("tokenizer.ggml.bos_token_id")
    eos_id = field("tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos_id is None else [int(eos_id)]
    eot = field("tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    return Tokenizer(tk, None if bos_id is None else int(bos_id), eos_ids,
                     bool(field("tokenizer.ggml.add_bos_token", model == "llama")),
                     field("tokenizer.chat_template"),
                     tokens[bos_id] if bos_id is not None else "",
                     tokens[eos_id] if eos_id is not None else "")


def _sentencepiece_bpe(tokens: list[str], scores, types: list[int], space_prefix: bool,
                       path):
    """A SentencePiece BPE vocabulary (GGUF ``llama``: Llama 2, Mistral, ...) as a BPE model.

    SentencePiece merges, at each step, the adjacent pair whose concatenation is
    the highest-scoring piece. A BPE model whose merges are ranked by the score
    of the piece they make does the same. Every split of every piece into two
    pieces of the vocabulary is a merge. Text is prefixed with one space
    (``add_space_prefix``), spaces become U+2581, and characters outside the
    vocabulary fall back to their UTF-8 bytes (``<0xNN>`` pieces).
    """
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as TK

    if scores is None or len(scores) != len(tokens):
        raise UsageError(f"{path}: tokenizer.ggml.scores is missing or does not match the "
                         f"{len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] != 1 or len(piece) < 2:   # normal pieces only
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)
    tk = TK(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk,
                       fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tk.normalizer = normalizers.Sequence(steps)
    tail = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                    decoders.Fuse()] + tail)
    tk.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t, ty in zip(tokens, types) if ty == 3])
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == 4]
    if user:
        tk.add_tokens(user)
    return tk


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str):
    """A byte-level BPE vocabulary (GGUF ``gpt2``: Llama 3, Qwen, SmolLM, DeepSeek)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as TK

    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tk = TK(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs,
                       fuse_unk=False))
    if pre in _SPLITS:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":  # digits one by one, then GPT-2's split (SmolLM2's tokenizer.json)
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    spelled = set(_bytes_to_unicode().values())
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == 3 and set(t) <= spelled]
    tk.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == 4]
    if user:
        tk.add_tokens(user)
    return tk


def load_tokenizer(path_or_name) -> Tokenizer | None:
    """The model's tokenizer, or None when the checkpoint has none (use prompt ids)."""
    path = resolve_model(path_or_name)
    if is_gguf(path):
        return _from_gguf(path)
    return _from_folder(path) if path.is_dir() else None
