"""SentencePiece BPE tokenizers embedded in GGUF files (``tokenizer.ggml.model = llama``).

The oracle is the ``sentencepiece`` library itself: a BPE model trained here with
Llama's settings (no normalisation, spaces kept, digits split, byte fallback) is
written into a GGUF file the way llama.cpp's converter does, and our tokenizer
must give the same ids and the same text back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

from hpcmac.llm.model.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Hello world",
    " leading space and  two  spaces",
    "The matrix A is factored as P A = L U with partial pivoting.",
    "numbers 12345 and 3.14159, dates 2026-11-30",
    "unicode: café, naïve, Größe, 東京, emoji 🚀 and ∑ symbols",
    "tabs\tand\nnew lines\n\nend",
    "mpirun -np 4 python -m hpcmac.hpl --dat HPL.dat",
    "",
]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp / "m"), vocab_size=600, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=0.9995,
        minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "m.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else
                     6 if sp.is_byte(i) else 5 if sp.is_unused(i) else 1)
    path = tmp / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, path


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_and_text_as_sentencepiece(spm_gguf, text):
    sp, path = spm_gguf
    tok = load_tokenizer(path)
    ids = tok.encode(text, add_bos=False)
    assert ids == sp.encode(text), (text, [sp.id_to_piece(i) for i in sp.encode(text)])
    assert tok.decode(ids) == sp.decode(ids) == text


def test_bos_and_eos(spm_gguf):
    sp, path = spm_gguf
    tok = load_tokenizer(path)
    assert tok.encode("Hi")[0] == sp.bos_id()  # SentencePiece GGUFs add BOS by default
    assert tok.eos_ids == [sp.eos_id()]
    assert tok.decode([sp.bos_id()] + sp.encode("Hi") + [sp.eos_id()],
                      skip_special=True) == "Hi"
