"""Kimi's tiktoken-style tokenizer folder (``tiktoken.model`` + ``tokenization_kimi.py``'s
``pat_str`` + ``tokenizer_config.json``) read as a ``tokenizers`` BPE, against tiktoken
itself on the same files.

The vocabulary is trained here (byte-level BPE, 400 merges, on text mixing English, Chinese,
accents, digits, code and whitespace, split by Kimi's pattern), so that ranks, merges,
the Han-aware split and the special tokens all matter; tiktoken (``tiktoken.Encoding``)
is the oracle: the same ids for every text, and decoding gives the text back.
"""

from __future__ import annotations

import base64
import json
import os
from collections import Counter

import numpy as np
import pytest

from hpcmac.errors import UsageError

tiktoken = pytest.importorskip("tiktoken")
regex = pytest.importorskip("regex")

#: Kimi K2's split: Han runs apart, cased words without Han, digits by three, the rest
PARTS = [r"[\p{Han}]+",
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
         r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
         r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
         r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
         r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"]
PAT = "|".join(PARTS)
CORPUS = ("The quick brown fox jumps over the lazy dog. It's 2026, and we're running "
          "Kimi K2.5 on Mac clusters! 你好，世界。我们在集群上运行大模型。École, naïve café. "
          "def f(x):\n    return x ** 2  # squared\n\n\tTabs\tand   spaces   "
          "1234567890 3.14159 URL https://example.org/a?b=c&d=e DON'T SHOUT; they'll see.\n")
SPECIALS = {0: "[BOS]", 1: "[EOS]", 3: "<|im_end|>", 4: "<|im_user|>"}  # 2: a gap
TEMPLATE = ("{% for m in messages %}<|im_user|>{{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}[BOS]{% endif %}")


def train(text: str, n_merges: int) -> dict[bytes, int]:
    """Ranks of a byte-level BPE trained on ``text`` split by PAT (256 bytes first)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in w.encode())
                    for w in regex.findall(regex.compile(PAT, regex.V1), text))
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        new = Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return ranks


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """(the folder, tiktoken's Encoding of the same files)."""
    folder = tmp_path_factory.mktemp("kimi-tok")
    ranks = train(CORPUS * 3, 400)
    (folder / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (folder / "tokenization_kimi.py").write_text(
        "class TikTokenTokenizer:\n    pat_str = \"|\".join(\n        [\n" +
        "".join(f"            r\"\"\"{p}\"\"\",\n" for p in PARTS) + "        ]\n    )\n")
    n = len(ranks)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n + i): {"content": c, "special": True}
                                 for i, c in SPECIALS.items()},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "chat_template": TEMPLATE}))
    specials = {c: n + i for i, c in SPECIALS.items()} | {f"<|reserved_token_{n + 2}|>": n + 2}
    enc = tiktoken.Encoding("kimi-test", pat_str=PAT, mergeable_ranks=ranks,
                            special_tokens=specials)
    return folder, enc


def texts():
    rng = np.random.default_rng(5)
    pool = list("aAbBzZ éÉüñ你好世界集群 0123456789.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@~`\n\t\r  ") + \
        ["'s", "'LL", "🙂", "\u0301", "[EOS]", "<|im_end|>", "don't", "ÉCOLE"]
    out = [CORPUS, "", " ", "\n\n\n", "  leading and trailing  ", "ABCdef GHI", "12345678",
           "你好，世界。", "Ünïcödé ÀÉÎÕÜ", "x[BOS]y<|im_end|>z"]
    out += ["".join(rng.choice(pool, size=int(rng.integers(1, 60)))) for _ in range(300)]
    return out


def test_ids_equal_tiktoken(kimi):
    from hpcmac.llm.model.tokenizer import load_tokenizer

    folder, enc = kimi
    tok = load_tokenizer(folder)
    assert tok.vocab_size == enc.n_vocab
    for text in texts():
        want = enc.encode(text, allowed_special="all")
        assert tok.encode(text) == want, repr(text)
        assert tok.decode(want) == text, repr(text)
        # user text: special-token strings stay text, as tiktoken with none allowed
        assert tok.encode(text, special=False) == enc.encode(text, disallowed_special=()), \
            repr(text)


def test_config_specials_and_template(kimi):
    from hpcmac.llm.model.tokenizer import load_tokenizer

    folder, enc = kimi
    tok = load_tokenizer(folder)
    n = enc.n_vocab - 5
    assert (tok.bos_id, tok.eos_ids) == (n, [n + 1])
    assert tok.tk.id_to_token(n + 2) == f"<|reserved_token_{n + 2}|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "你好 there"}])
    assert tok.encode(prompt) == [n + 4] + enc.encode("你好 there") + [n + 3, n]


def test_missing_pattern_is_one_line(kimi, tmp_path):
    from hpcmac.llm.model.tokenizer import load_tokenizer

    folder, _ = kimi
    for f in ("tiktoken.model", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((folder / f).read_bytes())
    with pytest.raises(UsageError, match=r"tokenization_kimi.py: no pat_str") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json",
                                  "chat_template.jinja", "tokenizer.json"])
def test_a_fifo_in_a_tokenizer_folder_is_one_line_not_a_hang(tmp_path, name):
    from tokenizers import Tokenizer as TK
    from tokenizers import models

    from hpcmac.llm.model.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    TK(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
        str(folder / "tokenizer.json"))
    (folder / name).unlink(missing_ok=True)
    os.mkfifo(folder / name)
    with pytest.raises(UsageError, match="pipe|regular file"):
        load_tokenizer(folder)
