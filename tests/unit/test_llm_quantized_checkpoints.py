"""Quantized checkpoints kept quantized: MLX affine safetensors and GGUF blocks.

Oracles nobody here wrote:
- mlx-lm itself quantizes random Hugging Face checkpoints (``quantize_model``, as
  ``mlx_lm.convert -q``) and generates greedily on them; our numpy and MLX
  backends must give the same tokens, at one rank and over a 2-rank pipeline;
- ``gguf.quants.dequantize`` (llama.cpp's reference dequantizer in Python) and
  ``mx.dequantize`` for the block mapping, bit for bit;
- float32 inference on the dequantized weights for the logits (1e-4 of the largest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from hpcmac.errors import UsageError  # noqa: E402
from hpcmac.llm.model.fixtures import (  # noqa: E402
    mlx_lm_greedy,
    mlx_lm_quantize,
    random_checkpoint,
    stage_greedy,
)
from hpcmac.llm.model.gguf_quant import EXACT, to_quant  # noqa: E402
from hpcmac.llm.model.qkernels import NQWeight, qmatmul  # noqa: E402
from hpcmac.llm.model.quant import QuantTensor, pack, unpack  # noqa: E402
from hpcmac.llm.model.stage import Batch, load_stage  # noqa: E402
from hpcmac.llm.model.weights import open_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHAPES = dict(hidden_size=128, intermediate_size=256, vocab_size=256, num_attention_heads=4,
              num_key_value_heads=2)
#: name -> (arch, config overrides, bits, group, mlx-lm recipe or mode)
CASES = {
    "llama-q4-g64": ("llama", {}, 4, 64, None),
    "qwen3-q8-g32": ("qwen3", dict(head_dim=32), 8, 32, None),
    "qwen3moe-q4-g128": ("qwen3_moe", dict(head_dim=32, moe_intermediate_size=128), 4, 128,
                         None),
    "llama-mixed_3_6-g64": ("llama", {}, 4, 64, "mixed_3_6"),
    # Qwen3-Next as mlx-lm converts it: norms stored 1 + w, conv1d (C, K, 1), experts
    # stacked, routers and shared-expert gate 8-bit g64
    "qwen3next-q4-g64": ("qwen3_next", dict(
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128), 4, 64, None),
    # mlx-lm's --q-mode mxfp4: E2M1 codes, E8M0 scales per 32, no biases
    "qwen3moe-mxfp4": ("qwen3_moe", dict(head_dim=32, moe_intermediate_size=128), 4, 32,
                       "mxfp4"),
}
PROMPT = [1, 5, 9, 33, 70, 2, 17]
N_TOKENS = 12


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Each case converted once by mlx-lm: name -> folder."""
    made = {}

    def get(name):
        if name not in made:
            arch, over, bits, group, recipe = CASES[name]
            base = tmp_path_factory.mktemp(name)
            src = random_checkpoint(arch, base / "hf", seed=5, initializer_range=0.2,
                                    **{**SHAPES, **over})
            mode = recipe if recipe == "mxfp4" else "affine"
            made[name] = mlx_lm_quantize(src, base / "q", bits, group,
                                         None if mode != "affine" else recipe, mode)
        return made[name]

    return get


# -- the format itself ------------------------------------------------------------------

@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_mlx_layout_and_dequantize_bit_for_bit(bits, group):
    rng = np.random.default_rng(bits * group)
    w = rng.standard_normal((6, 256)).astype(np.float32)
    words, scales, biases = (np.array(a) for a in mx.quantize(mx.array(w), group_size=group,
                                                              bits=bits))
    t = QuantTensor(words, scales, biases, bits, group)
    ref = np.array(mx.dequantize(*(mx.array(a) for a in (words, scales, biases)),
                                 group_size=group, bits=bits))
    assert t.shape == (6, 256)
    assert np.array_equal(t.dequantize().view(np.uint32), ref.view(np.uint32))
    q = t.codes()
    assert q.max() < 2 ** bits and np.array_equal(pack(q, bits), words)
    assert np.array_equal(unpack(pack(q, bits), bits, 256), q)


def _random_blocks(qtype, rows, cols, rng):
    """Random GGUF blocks of ``qtype`` with finite float16 scales (any codes)."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = rows * cols // block
    raw = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    n_f16 = 2 if qtype in ("Q8_0", "Q4_0", "Q5_0") else 4  # d, or d and m/dmin
    raw[:, :n_f16] = (rng.standard_normal((n, n_f16 // 2)) * 0.02).astype(
        np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [q for q in EXACT if q != "MXFP4"])  # its own mode:
def test_gguf_blocks_map_onto_mlx_exactly(qtype):  # tests/unit/test_llm_float_formats.py
    """The reference dequantizer and MLX's dequantize of the mapped codes agree exactly
    (as floats: for the symmetric types a code equal to the offset gives +0 here where
    the reference may give -0 when d < 0, which no product or sum can tell apart)."""
    rng = np.random.default_rng(len(qtype))
    raw = _random_blocks(qtype, 8, 512, rng)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(8, 512)
    t = to_quant(raw, qtype, (8, 512))
    assert t.group == 32 and t.bits == {"8": 8, "4": 4, "5": 5}[qtype[1]]
    ours = t.dequantize()
    via_mlx = np.array(mx.dequantize(*(mx.array(a) for a in (t.words, t.scales, t.biases)),
                                     group_size=32, bits=t.bits))
    assert np.array_equal(ours, ref) and np.array_equal(via_mlx, ref)
    assert np.array_equal(ours.view(np.uint32), via_mlx.view(np.uint32))
    differs = ours.view(np.uint32) != ref.view(np.uint32)
    assert np.all(ref[differs] == 0)


def test_gguf_types_that_cannot_map_fall_back_to_float32():
    assert to_quant(np.zeros(210, np.uint8), "Q6_K", (1, 256)) is None


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("m", [1, 3, 9, 20, 40, 70])  # 70: over BLOCK_ROWS, the BLAS tiles
def test_numpy_kernel_equals_dequantized_product(bits, m):
    rng = np.random.default_rng(bits + 10 * m)
    group = {2: 32, 3: 64, 4: 32, 5: 128, 6: 64, 8: 64}[bits]
    w = rng.standard_normal((300, 512)).astype(np.float32)
    t = QuantTensor(*(np.array(a) for a in mx.quantize(mx.array(w), group_size=group,
                                                       bits=bits)), bits, group)
    x = rng.standard_normal((m, 512)).astype(np.float32)
    ref = x.astype(np.float64) @ t.dequantize().T.astype(np.float64)
    y = qmatmul(x, NQWeight(t))
    assert y.dtype == np.float32 and y.shape == (m, 300)
    np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("bits", [4, 8])
def test_numpy_kernel_row_does_not_depend_on_its_neighbours(bits):
    """The float32 kernel multiplies blocks of activation rows together (qvec.MB); each
    row's product is bit for bit the product of that row alone, for every block size
    and remainder (7 rows: a block of 4 and one of 3; 2 weight rows at a time and the
    odd last one)."""
    rng = np.random.default_rng(bits)
    w = rng.standard_normal((301, 256)).astype(np.float32)
    t = QuantTensor(*(np.array(a) for a in mx.quantize(mx.array(w), group_size=32,
                                                       bits=bits)), bits, 32)
    nq = NQWeight(t)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    y = qmatmul(x, nq)
    for i in range(7):
        assert np.array_equal(qmatmul(x[i:i + 1], nq)[0], y[i])
    assert np.array_equal(qmatmul(x[2:5], nq), y[2:5])


# -- mlx-lm checkpoints ------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "mlx"])
@pytest.mark.parametrize("name", list(CASES))
def test_mlx_lm_checkpoint_same_tokens_as_mlx_lm(name, backend, quantized):
    folder = quantized(name)
    cfg = json.loads((folder / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    q = load_stage(folder, 0, n_layers, backend=backend)
    assert q.formats and all(k.startswith("mlx ") for k in q.formats)
    if name.endswith("mxfp4"):  # mlx-lm keeps the router affine 8-bit
        assert set(q.formats) == {"mlx mxfp4", "mlx q8 g64"}
    assert stage_greedy(q, PROMPT, N_TOKENS) == mlx_lm_greedy(folder, PROMPT, N_TOKENS)
    f = load_stage(folder, 0, n_layers, backend="numpy", keep_quantized=False)
    assert not f.formats
    b = Batch([0], [len(PROMPT)], [0])
    lq = q.logits(q.forward(q.embed(PROMPT), b, q.new_cache(1, 16)))
    lf = f.logits(f.forward(f.embed(PROMPT), b, f.new_cache(1, 16)))
    np.testing.assert_allclose(lq, lf, rtol=0, atol=1e-4 * np.abs(lf).max())
    assert q.nbytes < 0.45 * f.nbytes  # held quantized, not as float32


def test_mlx_lm_float_folder_of_qwen3_next(tmp_path):
    """mlx-lm's conversion without quantizing (no ``quantization`` in config.json) is found
    by its conv1d's (C, K, 1): its norms are read as stored (1 + w), and it gives the
    Hugging Face folder's tokens (hpcmac's, exact against transformers) and mlx-lm's."""
    src = random_checkpoint("qwen3_next", tmp_path / "hf", seed=6, initializer_range=0.2)
    folder = mlx_lm_quantize(src, tmp_path / "mlx", None, 64)
    assert "quantization" not in json.loads((folder / "config.json").read_text())
    hf, ml = open_checkpoint(src), open_checkpoint(folder)
    assert ml.mlx_lm_sanitized() and not hf.mlx_lm_sanitized()
    # the forward's 1 + w is what mlx-lm stored, float32's 1 + w of the source
    for name in ("model.layers.3.self_attn.q_norm.weight", "model.norm.weight"):
        assert np.array_equal(ml.get(name) + np.float32(1), hf.get(name) + np.float32(1))
    for name in ("model.layers.0.linear_attn.conv1d.weight",
                 "model.layers.0.linear_attn.norm.weight"):  # the gated norm: w in both
        assert np.array_equal(ml.get(name), hf.get(name)), name
    want = stage_greedy(load_stage(src, 0, 4), PROMPT, N_TOKENS)
    assert stage_greedy(load_stage(folder, 0, 4), PROMPT, N_TOKENS) == want
    assert mlx_lm_greedy(folder, PROMPT, N_TOKENS) == want


def test_mlx_lm_qwen3_5_moe_released_layout(tmp_path):
    """Qwen3.5-MoE laid out as released (config under ``text_config``, tensors under
    ``model.language_model.``, the experts fused as ``gate_up_proj`` / ``down_proj``),
    converted by mlx-lm (q4 g64, its routers and shared-expert gates 8-bit: per-layer
    entries named ``language_model.model.layers.N``): mlx-lm's tokens."""
    from safetensors.numpy import load_file, save_file

    text = dict(SHAPES, num_hidden_layers=4, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                shared_expert_intermediate_size=128)
    src = random_checkpoint("qwen3_5_moe_text", tmp_path / "text", seed=3,
                            initializer_range=0.2, **text)
    t = {"model.language_model." + k[len("model."):] if k.startswith("model.") else k: v
         for k, v in load_file(src / "model.safetensors").items()}
    for layer in range(4):
        pre = f"model.language_model.layers.{layer}.mlp.experts"
        parts = {p: [t.pop(f"{pre}.{e}.{p}_proj.weight") for e in range(4)]
                 for p in ("gate", "up", "down")}
        t[f"{pre}.gate_up_proj"] = np.concatenate([np.stack(parts["gate"]),
                                                   np.stack(parts["up"])], axis=1)
        t[f"{pre}.down_proj"] = np.stack(parts["down"])
    out = tmp_path / "released"
    out.mkdir()
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(
        model_type="qwen3_5_moe", text_config=cfg, tie_word_embeddings=False)))
    q = mlx_lm_quantize(out, tmp_path / "q", 4, 64)
    st = load_stage(q, 0, 4)
    assert set(st.formats) == {"mlx q4 g64", "mlx q8 g64"}
    assert stage_greedy(st, PROMPT, N_TOKENS) == mlx_lm_greedy(q, PROMPT, N_TOKENS)


def test_mixed_precision_checkpoint_keeps_each_format(quantized):
    folder = quantized("llama-mixed_3_6-g64")
    st = load_stage(folder, 0, 3, backend="numpy")
    assert set(st.formats) == {"mlx q3 g64", "mlx q6 g64"}


def test_pipeline_two_ranks_same_tokens_as_mlx_lm(quantized, tmp_path):
    """A real 2-rank job (mpirun; the default layout for one prompt: tensor 2) on the MoE
    checkpoint with its 8-bit router."""
    folder = quantized("qwen3moe-q4-g128")
    out = tmp_path / "r.json"
    env = dict(os.environ, HPCMAC_QUIET_TRANSPORT="1")
    cmd = [str(ROOT / "tools" / "mpirun"), "2", sys.executable, "-m", "hpcmac.llm", "generate",
           "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
           "--max-tokens", str(N_TOKENS), "--ignore-chat-template", "--quiet",
           "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["ranks"] == 2
    assert got["tokens"] == mlx_lm_greedy(folder, PROMPT, N_TOKENS)


# -- refusals ---------------------------------------------------------------------------

def _cli(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "hpcmac.llm", "generate", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_unsupported_mode_is_one_line(quantized, tmp_path):
    import shutil

    folder = shutil.copytree(quantized("llama-q4-g64"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {**cfg["quantization"], "mode": "nvfp4"}
    (folder / "config.json").write_text(json.dumps(cfg))
    r = _cli(["--model", str(folder), "--prompt-ids", "1,2", "--max-tokens", "2"])
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "quantization mode 'nvfp4' is not supported" in lines[0]
    assert "config.json: quantization" in lines[0]  # at config time, before any weight


def test_corrupt_scales_shape_is_one_line(quantized, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = shutil.copytree(quantized("llama-q4-g64"), tmp_path / "m")
    for f in folder.glob("*.safetensors"):
        t = load_file(f)
        name = "model.layers.1.mlp.down_proj.scales"
        if name in t:
            t[name] = t[name][:, :-1].copy()
            save_file(t, f, metadata={"format": "mlx"})
    with pytest.raises(UsageError, match=r"model\.layers\.1\.mlp\.down_proj\.scales/biases "
                                         r"has shape \[128, 3\]; expected \[128, 4\]"):
        load_stage(folder, 0, 3, backend="numpy")
    r = _cli(["--model", str(folder), "--prompt-ids", "1,2", "--max-tokens", "2"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- SmolLM2's shipped GGUF -------------------------------------------------------------

def test_smollm2_gguf_kept_quantized_exactly():
    ckpt = open_checkpoint("smollm2")
    seen = set()
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.7.mlp.down_proj.weight"):
        t = ckpt.get_weight(name)
        assert isinstance(t, QuantTensor)
        seen.add(t.source)
        assert np.array_equal(t.dequantize(), ckpt.get(name))  # incl. Llama's Q/K un-permute
    assert seen == {"gguf Q8_0", "gguf Q4_1"}


def test_smollm2_same_tokens_as_float32_path():
    q = load_stage("smollm2", 0, 30, backend="numpy")
    f = load_stage("smollm2", 0, 30, backend="numpy", keep_quantized=False)
    assert q.formats == {"gguf Q4_1": 210, "gguf Q8_0": 1}
    assert q.nbytes < 0.3 * f.nbytes
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365]
    b = Batch([0], [len(prompt)], [0])
    lq = q.logits(q.forward(q.embed(prompt), b, q.new_cache(1, 16)))
    lf = f.logits(f.forward(f.embed(prompt), b, f.new_cache(1, 16)))
    np.testing.assert_allclose(lq, lf, rtol=0, atol=1e-4 * np.abs(lf).max())
    assert stage_greedy(q, prompt, 16) == stage_greedy(f, prompt, 16)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_mlx_holds_16_bit_scales_with_the_same_products(qtype):
    """The MLX backend keeps GGUF's float16 scales (and biases) as float16: the products
    equal those with float32 scales and biases bit for bit, and the bytes shrink."""
    from hpcmac.llm.model.backend import MLXBackend, QWeight

    rng = np.random.default_rng(7)
    t = to_quant(_random_blocks(qtype, 64, 512, rng), qtype, (64, 512))
    qw = QWeight(mx, t, t.bits, t.group)
    assert qw.scales.dtype == mx.float16 and qw.biases.dtype == mx.float16
    assert qw.nbytes < t.nbytes
    x = mx.array(rng.standard_normal((3, 512)).astype(np.float32))
    ref = mx.quantized_matmul(x, mx.array(t.words), mx.array(t.scales), mx.array(t.biases),
                              transpose=True, group_size=32, bits=t.bits)
    got = MLXBackend().linear(x, qw)
    assert got.dtype == mx.float32 and np.array_equal(np.array(got), np.array(ref))
    rows = MLXBackend().rows(qw, np.array([0, 5, 63]))
    assert np.array_equal(rows, t.dequantize()[[0, 5, 63]])
