"""gpt-oss as GGUF (llama.cpp's ``gpt-oss``): the same model as the safetensors folder and
transformers, its MXFP4 experts kept 4-bit, and llama.cpp itself (the ``xllamacpp`` wheel)
reading the same files to the same greedy tokens, which checks the names and layouts
independently of hpcmac's own writer and reader; the o200k pre-tokenizer against llama.cpp's.

Shapes: sizes of 32s (MXFP4's groups), 4 query heads over 2 KV heads, 6 experts (4 a token),
3 layers (sliding, full, sliding; window 8), prompts of 20 tokens (past the window).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_util import (  # noqa: E402
    PROMPT,
    N,
    assert_same_run,
    hf_greedy,
    llama_cpp_greedy,
    our_greedy,
)

from hpcmac.errors import UsageError  # noqa: E402
from hpcmac.llm.model.config import load_config  # noqa: E402
from hpcmac.llm.model.fixtures import (  # noqa: E402
    mxfp4_checkpoint,
    random_checkpoint,
    stage_greedy,
    write_gguf,
)
from hpcmac.llm.model.gguf_loader import GGUFCheckpoint  # noqa: E402
from hpcmac.llm.model.stage import load_stage  # noqa: E402
from hpcmac.llm.model.weights import SafetensorsCheckpoint, stage_nbytes  # noqa: E402

SHAPES = dict(hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=3, num_local_experts=6,
              num_experts_per_tok=4, sliding_window=8)
#: the config fields a GGUF must give back as the folder has them
FIELDS = ("arch", "n_layers", "hidden", "vocab", "n_heads", "n_kv_heads", "head_dim",
          "intermediate", "n_experts", "n_experts_per_tok", "moe_intermediate",
          "attention_bias", "o_bias", "tie_embeddings", "sliding_window", "layer_types",
          "rope_theta", "rope_scaling", "swiglu_limit", "swiglu_alpha")


def fused_copy(src: Path, out: Path) -> Path:
    """A copy of a gpt-oss GGUF with each layer's ``ffn_gate_exps`` and ``ffn_up_exps``
    (weights and biases) as one ``ffn_gate_up_exps`` (gate's rows, then up's), as newer
    llama.cpp converters may write it; the bytes of each part unchanged."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    by = {t.name: t for t in r.tensors}
    for t in r.tensors:
        if "ffn_up_exps" in t.name:
            continue
        data, typ = np.array(t.data), t.tensor_type
        if "ffn_gate_exps" in t.name:
            up = np.array(by[t.name.replace("gate", "up")].data)
            data = np.concatenate([data, up], axis=-2 if data.ndim == 3 else -1)
            name = t.name.replace("ffn_gate_exps", "ffn_gate_up_exps")
        else:
            name = t.name
        if typ in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=typ)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A float folder (gpt-oss's own YaRN) and its MXFP4 copy as gpt-oss publishes it."""
    root = tmp_path_factory.mktemp("gptoss")
    f = random_checkpoint("gpt_oss", root / "float", seed=3, initializer_range=0.3, **SHAPES)
    return f, mxfp4_checkpoint(f, root / "mxfp4", seed=3)


def test_float_gguf_is_the_folder(folders, tmp_path):
    """An F32 GGUF: the folder's configuration, byte count, greedy tokens and logits, and
    transformers' (YaRN with factor 32 untruncated, sinks, window 8 < prompt)."""
    folder = folders[0]
    g = write_gguf(folder, tmp_path / "f32.gguf", "F32")
    a, b = load_config(folder), load_config(g)
    for field in FIELDS:
        assert getattr(a, field) == pytest.approx(getattr(b, field)), field
    assert stage_nbytes(g, 0, 3, True, True) == stage_nbytes(folder, 0, 3, True, True)
    ref = hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, experts_implementation="eager").eval(), PROMPT)
    assert len(set(ref[0])) > 4  # not a degenerate run
    assert_same_run(our_greedy(load_stage(g, 0, 3)), ref, "GGUF F32")
    assert_same_run(our_greedy(load_stage(folder, 0, 3)), ref, "folder")


def test_mxfp4_gguf_kept_4bit(folders, tmp_path):
    """MXFP4 experts (GGUF type 39, the rest F32, as ggml-org's files): the folder's MXFP4
    experts exactly (its codes and power-of-two scales requantize to themselves), kept
    4-bit on load (held <= 1.1x the file, the planner's count), transformers' tokens and
    logits on the same experts; the fused ``ffn_gate_up_exps`` form gives the same."""
    folder = folders[1]
    g = write_gguf(folder, tmp_path / "mx.gguf", "MXFP4", experts_only=True)
    ours, theirs = GGUFCheckpoint(g), SafetensorsCheckpoint(folder)
    for i in range(3):
        for t in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            name = f"model.layers.{i}.mlp.experts.{t}"
            np.testing.assert_array_equal(ours.get(name), theirs.get(name), err_msg=name)
    st = load_stage(g, 0, 3)
    assert st.formats == {"gguf MXFP4": 6}  # gate/up and down of 3 layers
    assert stage_nbytes(g, 0, 3, True, True) == st.nbytes <= 1.1 * g.stat().st_size
    ref = hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, experts_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval(), PROMPT)
    assert len(set(ref[0])) > 4
    got = our_greedy(st)
    assert_same_run(got, ref, "GGUF MXFP4")
    fused = load_stage(fused_copy(g, tmp_path / "fused.gguf"), 0, 3)
    assert fused.formats == st.formats and fused.nbytes == st.nbytes
    assert_same_run(our_greedy(fused), got, "fused gate_up")
    pytest.importorskip("mlx.core")
    mlx = load_stage(g, 0, 3, backend="mlx")
    assert mlx.formats == st.formats
    assert_same_run(our_greedy(mlx), ref, "GGUF MXFP4, MLX backend")


# -- llama.cpp reads the same files -------------------------------------------------------

@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_llama_cpp_gives_the_same_tokens(tmp_path, monkeypatch, rope):
    """llama.cpp's 16 greedy tokens equal hpcmac's on the same F32 GGUF and on one with MXFP4
    experts (llama.cpp multiplies MXFP4 by 8-bit-quantized activations: a milder random
    model, initializer_range 0.2, keeps its argmax away from ties; the wheel refuses the
    fused ``ffn_gate_up_exps`` of newer converters, so that form is checked above only).
    YaRN: llama.cpp rounds the correction range to whole dimensions (floor, ceil:
    transformers' ``truncate: true``), where gpt-oss's own YaRN does not (its ramp differs
    in a few dimensions); hpcmac reads gpt-oss's and matches transformers (above), so here
    it is run with llama.cpp's rounding to compare the rest."""
    pytest.importorskip("xllamacpp")
    from hpcmac.llm.model import gguf_loader
    from hpcmac.llm.model.arch import gpt_oss

    over = {} if rope == "yarn" else dict(rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e4})
    folder = random_checkpoint("gpt_oss", tmp_path / "f", seed=3, initializer_range=0.2,
                               **SHAPES, **over)
    files = [write_gguf(folder, tmp_path / "f32.gguf", "F32"),
             write_gguf(folder, tmp_path / "mx.gguf", "MXFP4", experts_only=True)]
    if rope == "yarn":
        read = gpt_oss.FAMILY.from_gguf

        def rounded(meta):
            cfg = read(meta)
            assert cfg.rope_scaling["truncate"] is False  # gpt-oss's own
            cfg.rope_scaling["truncate"] = True
            return cfg

        object.__setattr__(gpt_oss.FAMILY, "from_gguf", rounded)  # a frozen dataclass
        monkeypatch.setattr(gguf_loader, "_READERS", {})
    try:
        for f in files:
            ours = stage_greedy(load_stage(f, 0, 3), PROMPT, N)
            assert len(set(ours)) > 4
            assert llama_cpp_greedy(f) == ours, f.name
    finally:
        if rope == "yarn":
            object.__setattr__(gpt_oss.FAMILY, "from_gguf", read)


# -- the tokenizer ----------------------------------------------------------------------

#: text that tells the splits apart: case runs, contractions in either case, 4+ digits,
#: punctuation runs with slashes and newlines, accents, runs of spaces
TEXTS = ["HelloWorld and CamelCaseWORDS helloWORLD", "I'M here, they'RE not; it's DON'T",
         "12345678 and 9.75", "a/b//c\n\n  x = y+1;\n\tdone!!!\r\n", "naïve café ÀÉÎ straße",
         "  spaces   end  "]


def pair_vocabulary() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, then one merge of every pair of
    adjacent symbols in :data:`TEXTS` (so merges cross every split's boundaries: only the
    pre-tokenizer keeps them apart)."""
    from hpcmac.llm.model.tokenizer import _bytes_to_unicode

    sym = _bytes_to_unicode()
    tokens = [sym[b] for b in range(256)]
    merges: list[str] = []
    for text in TEXTS:
        chars = [sym[b] for b in text.encode()]
        for a, b in zip(chars, chars[1:]):
            if a + b not in tokens:
                tokens.append(a + b)
                merges.append(f"{a} {b}")
    return tokens, merges


def test_gpt4o_pretokenizer_is_llama_cpps(tmp_path):
    """gpt-oss's GGUF tokenizer is byte-level BPE with llama.cpp's ``gpt-4o`` pre-tokenizer
    (o200k's split). hpcmac's tokens equal llama.cpp's /tokenize on :data:`TEXTS`, on a
    vocabulary whose merges cross every boundary; GPT-2's and Llama 3's splits give other
    tokens on it (so the check can fail)."""
    xlc = pytest.importorskip("xllamacpp")
    from hpcmac.llm.model.tokenizer import load_tokenizer

    tokens, merges = pair_vocabulary()
    tok = {pre: load_tokenizer(vocabulary_gguf(tmp_path / f"{pre}.gguf", tokens, merges, pre))
           for pre in ("gpt-4o", "default", "llama3")}
    for other in ("default", "llama3"):
        assert any(tok["gpt-4o"].encode(t) != tok[other].encode(t) for t in TEXTS), other
    p = xlc.CommonParams()
    p.model.path = str(tmp_path / "gpt-4o.gguf")
    p.n_ctx = 64
    server = xlc.Server(p)
    try:
        url = f"{server.listening_address}/tokenize"  # its HTTP server, on loopback
        for text in TEXTS:
            req = urllib.request.Request(url, json.dumps({"content": text}).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                ref = json.loads(r.read())["tokens"]
            assert tok["gpt-4o"].encode(text) == ref, text
            assert tok["gpt-4o"].decode(ref) == text
    finally:
        del server


def vocabulary_gguf(out: Path, tokens: list[str], merges: list[str], pre: str) -> Path:
    """A tiny Llama GGUF carrying a byte-level vocabulary with ``tokenizer.ggml.pre`` =
    ``pre`` (random weights; only the tokenizer is used)."""
    n, d = len(tokens), 32
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(d // 2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * n)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((n, d)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for name, shape in [("attn_norm.weight", (d,)), ("ffn_norm.weight", (d,)),
                        ("attn_q.weight", (d, d)), ("attn_k.weight", (d, d)),
                        ("attn_v.weight", (d, d)), ("attn_output.weight", (d, d)),
                        ("ffn_gate.weight", (32, d)), ("ffn_up.weight", (32, d)),
                        ("ffn_down.weight", (d, 32))]:
        w.add_tensor(f"blk.0.{name}", rng.standard_normal(shape).astype(np.float32) * 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_unknown_pretokenizer_refused(tmp_path):
    """A byte-level vocabulary whose ``tokenizer.ggml.pre`` hpcmac has no split for is one
    line naming the field (it was read with GPT-2's split, silently)."""
    from hpcmac.llm.model.tokenizer import load_tokenizer

    folder = random_checkpoint("llama", tmp_path / "l", seed=1)
    g = write_gguf(folder, tmp_path / "l.gguf", "F32")
    r = gguf.GGUFReader(str(g))
    w = gguf.GGUFWriter(str(tmp_path / "pre.gguf"), "llama")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        val = "kimi-k2" if name == "tokenizer.ggml.pre" else f.contents()
        w.add_key_value(name, val, f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UsageError, match=r"pre\.gguf: tokenizer\.ggml\.pre 'kimi-k2' is not "
                                         r"supported; expected one of .*gpt-4o"):
        load_tokenizer(tmp_path / "pre.gguf")
