"""MXFP4 and FP8 weights kept in their precision: the codes, the held bytes and the
kernels' error bound.

The bound, derived: a dot product of n float32 terms computed in float32 in any order
(with or without FMA) is within ``gamma_n * sum_i |w_i x_i|`` of the exact one,
``gamma_n = n u / (1 - n u)``, ``u = 2^-24`` (Higham, Accuracy and Stability of
Numerical Algorithms, 3.1). The weights themselves are exact in float32 (an E2M1 value
times a power of two; an E4M3 value times its float32 scale, one rounding, as the
release's own dequantization: the same float32 value on every path). So the numpy
kernels (per chunk of 32 products, then scaled, in their own order), the BLAS tiles on
the dequantized weights and MLX are each within ``gamma_n S`` of the exact product, and
within ``2 gamma_n S`` of each other (``S = sum |w| |x|`` per output). The model-level
checks (tokens equal, logits within 1e-4 of the largest) are the family tests'
(tests/mpi/test_gpt_oss.py, test_deepseek_fp8.py) and the MLX-folder ones.
"""

from __future__ import annotations

import numpy as np
import pytest

from hpcmac.llm.model import fp8, mxfp4
from hpcmac.llm.model.qkernels import NQWeight, qmatmul
from hpcmac.llm.model.quant import QuantTensor, numpy_held_nbytes, pack

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _mxfp4(rng, out, inp) -> QuantTensor:
    codes = rng.integers(0, 16, (out, inp), dtype=np.uint8)
    scales = rng.integers(118, 130, (out, inp // 32), dtype=np.uint8)
    return QuantTensor(pack(codes, 4), scales, None, 4, 32, "test", "mxfp4")


def _fp8(rng, out, inp) -> QuantTensor:
    w = (rng.standard_normal((out, inp)) * 0.05).astype(np.float32)
    codes, sinv = fp8.quantize(w)
    return fp8.from_blocks(codes, sinv)


def test_e4m3_table_is_torchs():
    torch = pytest.importorskip("torch")
    ref = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    assert np.array_equal(fp8.E4M3_VALUES, ref.float().numpy(), equal_nan=True)


def test_fp8_blocks_dequantize_as_the_release_does():
    """DeepSeek's own dequantization: weight.float() times the block's scale_inv, in float32
    (here with torch); an out size that is not a multiple of 128 (a last partial block)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((200, 256)).astype(np.float32)
    codes, sinv = fp8.quantize(w)
    assert codes.dtype == np.uint8 and sinv.shape == (2, 2)
    t = fp8.from_blocks(codes, sinv)
    c = torch.from_numpy(codes).view(torch.float8_e4m3fn).float()
    s = torch.from_numpy(sinv).repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)
    assert np.array_equal(t.dequantize(), (c * s).numpy())
    assert np.abs(t.dequantize() - w).max() <= np.abs(w).max() / 448 * 32  # e4m3: 3 bits
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.from_blocks(codes[:, :200], sinv)


@pytest.mark.parametrize("block", [128, 32])  # 128: runs of 64 (AVX-512 VBMI); 32: chunks
def test_fp8_kernel_gives_every_code_exactly(block):
    """Each E4M3 code but the two NaNs, in every position of a run (rows of a rolled list
    of all 254) and in a last odd row, times a one-hot activation: the kernel's output is
    the code's value times its block's power-of-two scale, bit for bit (the decode to
    float32 is exact on each path: :mod:`hpcmac.llm.model.qvec`)."""
    from hpcmac.llm.model.qvec import E4M3_BYTES, VBMI_ORDER

    assert sorted(VBMI_ORDER) == list(range(64)) and E4M3_BYTES.shape == (4, 64)
    codes = np.array([c for c in range(256) if c & 127 != 127], np.uint8)
    n, k = 255, 256
    c = np.stack([np.roll(np.resize(codes, k), i) for i in range(n)])
    rng = np.random.default_rng(3)
    sinv = np.ldexp(np.float32(1), rng.integers(-6, 6, (-(-n // block), k // block)))
    t = fp8.from_blocks(c, sinv.astype(np.float32), block)
    nq = NQWeight(t)
    w = t.dequantize()
    for j in (0, 1, 7, 8, 31, 32, 63, 64, 100, 127, 128, 200, 255):
        x = np.zeros((1, k), np.float32)
        x[0, j] = 1.0
        assert np.array_equal(qmatmul(x, nq)[0], w[:, j]), j


def test_mxfp4_layout_is_mlxs():
    """gpt-oss's blocks and scales are MLX's mode="mxfp4" words and scales, bit for bit."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    words, scales = (np.array(a) for a in mx.quantize(mx.array(w), group_size=32, bits=4,
                                                      mode="mxfp4"))
    blocks = words.view(np.uint8).reshape(8, 4, 16)
    ref = np.array(mx.dequantize(mx.array(words), mx.array(scales), None, group_size=32,
                                 bits=4, mode="mxfp4").astype(mx.float32))
    assert np.array_equal(mxfp4.dequantize(blocks, scales), ref)


def test_gguf_mxfp4_is_the_reference_and_mlxs():
    """GGUF's MXFP4 blocks (ggml type 39) mapped onto mode mxfp4: equal to the gguf
    package's reference dequantizer (llama.cpp's) and, bit for bit, to MLX's dequantize."""
    gguf = pytest.importorskip("gguf")
    from hpcmac.llm.model.gguf_quant import to_quant

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (8 * 512 // 32, 17), dtype=np.uint8)
    raw[:, 0] = rng.integers(110, 140, raw.shape[0])
    ref = gguf.quants.dequantize(raw.reshape(8, -1), gguf.GGMLQuantizationType.MXFP4)
    t = to_quant(raw, "MXFP4", (8, 512))
    assert t.mode == "mxfp4" and t.biases is None and t.scales.dtype == np.uint8
    # as floats: code 8 is -0 here (E2M1's own sign) where the reference gives +0
    assert np.array_equal(t.dequantize(), ref.reshape(8, 512))
    mx = pytest.importorskip("mlx.core")
    via_mlx = mx.dequantize(mx.array(t.words), mx.array(t.scales), None, group_size=32,
                            bits=4, mode="mxfp4").astype(mx.float32)
    assert np.array_equal(np.array(via_mlx), t.dequantize())
    # our quantizer (fixtures) picks llama.cpp's scale and codes
    w = rng.standard_normal((4, 64)).astype(np.float32)
    codes, e = mxfp4.quantize(w)
    ggml = gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4).reshape(-1, 17)
    assert np.array_equal(ggml[:, 0], e.reshape(-1))
    back = to_quant(ggml, "MXFP4", (4, 64))
    assert np.array_equal(back.codes(), codes)


@pytest.mark.parametrize("make", [_mxfp4, _fp8], ids=["mxfp4", "fp8"])
@pytest.mark.parametrize("m", [1, 3, 40, 70])  # 40: past GEMM_ROWS (FP8's tiles),
# 70: past BLOCK_ROWS (MXFP4's)
def test_numpy_kernel_within_the_bound(make, m):
    rng = np.random.default_rng(m)
    t = make(rng, 130, 512)
    w = t.dequantize()
    x = rng.standard_normal((m, 512)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = gamma(512) * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    nq = NQWeight(t)
    y = qmatmul(x, nq)
    assert np.all(np.abs(y - exact) <= bound)
    assert np.all(np.abs(y - x @ w.T) <= 2 * bound)  # against float32 BLAS on w
    assert np.array_equal(nq.dequantize_rows(0, 130), w)
    # held in (nearly) the file's bytes: MXFP4 17 bytes a 32 (codes and the E8M0 byte),
    # held 18 (its bfloat16); FP8 1 byte a weight and a float32 per 128 x 128, held one
    # per row and 128
    file = 130 * 512 * (17 / 32 if t.mode == "mxfp4" else 1 + 4 / 128 ** 2)
    assert nq.nbytes == numpy_held_nbytes(t) <= 1.1 * file


@pytest.mark.parametrize("make", [_mxfp4, _fp8], ids=["mxfp4", "fp8"])
def test_mlx_backend_within_the_bound(make):
    pytest.importorskip("mlx.core")
    from hpcmac.llm.model.backend import get_backend
    from hpcmac.llm.model.quant import mlx_held_nbytes

    be = get_backend("mlx")
    rng = np.random.default_rng(7)
    t = make(rng, 70, 256)
    w = t.dequantize()
    x = rng.standard_normal((3, 256)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = gamma(256) * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    qw = be.weight(t)
    y = be.to_numpy(be.linear(be.asarray(x), qw))
    assert np.all(np.abs(y - exact) <= bound)
    assert np.array_equal(be.rows(qw, np.array([0, 5, 69])), w[[0, 5, 69]])
    assert qw.nbytes == mlx_held_nbytes(t)


def test_compressed_tensors_int4_reads_as_affine_exactly(tmp_path):
    """compressed-tensors pack-quantized INT4 (Kimi K2 Thinking): word j of a row holds
    codes q + 8 of inputs 8j .. 8j+7 at bits 4i (its pack_to_int32); read as MLX affine,
    ``s * (q + 8) - 8 s`` is ``s * q`` exactly, held in the file's bytes (bias derived)."""
    pytest.importorskip("torch")
    from safetensors.numpy import load_file
    from safetensors.torch import load_file as load_torch

    from hpcmac.llm.model.fixtures import int4_checkpoint, random_checkpoint
    from hpcmac.llm.model.weights import open_checkpoint

    src = random_checkpoint("qwen3_moe", tmp_path / "src", hidden_size=64,
                            moe_intermediate_size=32, num_hidden_layers=1, head_dim=16)
    int4_checkpoint(src, tmp_path / "q", tmp_path / "f")
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    stored = load_torch(str(tmp_path / "q" / "model.safetensors"))
    words = stored[name + "_packed"].numpy().view(np.uint32)  # (64, 32 / 8)
    codes = np.stack([(words >> np.uint32(4 * i)) & np.uint32(15) for i in range(8)], -1)
    q = codes.reshape(64, 32).astype(np.int32) - 8
    ck = open_checkpoint(tmp_path / "q")
    t = ck.get_weight(name)
    assert t.mode == "affine" and t.bits == 4 and t.group == 32 and ck.shape(name) == (64, 32)
    s = t.scales
    assert np.array_equal(t.dequantize(), q * s.repeat(32, axis=1))
    want = load_file(str(tmp_path / "f" / "model.safetensors"))[name]
    assert np.array_equal(t.dequantize(), want)
    nq = NQWeight(t)
    assert nq.biases.size == 0 and nq.nbytes == ck.stored_nbytes(name) == \
        words.nbytes + 2 * stored[name[:-len("weight")] + "weight_scale"].numel()


@pytest.mark.parametrize("m", [1, 3])
def test_float_panel_kernel_within_the_bound(m):
    """Decode's float32 product (:mod:`hpcmac.llm.model.fvec` over the backend's panels)
    and its bfloat16 form: within ``gamma_n S`` of the exact product (the derivation
    above: the weights are exact float32 values, only the sums round); an output count
    that pads the last panel, an input count that is not a multiple of the unroll; the
    bfloat16 bits give exactly the float32 kernel's result on their widened values."""
    from hpcmac.llm.model.backend import NumpyBackend, Panels
    from hpcmac.llm.model.fvec import matvec

    rng = np.random.default_rng(11 + m)
    w = rng.standard_normal((70, 515)).astype(np.float32)
    x = rng.standard_normal((m, 515)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = gamma(515) * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    be = NumpyBackend()
    p = Panels(w, be.panel)
    y = be.linear(x, p) if m == 1 else matvec(x, p.p)[:, :70]
    assert y.shape == (m, 70) and np.all(np.abs(y - exact) <= bound)
    bits = (p.p.view(np.uint32) >> np.uint32(16)).astype(np.uint16)  # truncated to bf16
    wide = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    assert np.array_equal(matvec(x, bits), matvec(x, wide))


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_embedding_and_head_kept_in_two_bytes(tmp_path, tied):
    """An FP8 release's bfloat16 embedding and head (``fixtures.fp8_checkpoint`` stores
    them so) are held in their 2 bytes on both backends: the rows looked up are the
    dequantized model's exactly, the logits within ``2 gamma_n S`` of float32 BLAS on
    the same (exactly widened) weights, for one row, a few and past GEMM_ROWS (the
    widened tiles); the stage holds <= 1.1x the file, and both planners count its bytes
    (``weights.stage_nbytes`` whole and as tensor rank 1 of 2; ``hpcmac.plan``'s
    tables at 16 bits)."""
    pytest.importorskip("torch")
    from importlib.util import find_spec
    from pathlib import Path

    from safetensors.numpy import load_file

    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.fixtures import fp8_checkpoint, random_checkpoint
    from hpcmac.llm.model.spec import make_shards
    from hpcmac.llm.model.stage import load_stage
    from hpcmac.llm.model.weights import stage_nbytes
    from hpcmac.plan.shape import load_shape

    src = random_checkpoint("qwen3", tmp_path / "src", vocab_size=300, hidden_size=256,
                            intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=128, tie_word_embeddings=tied)
    q, f = Path(fp8_checkpoint(src, tmp_path / "q", tmp_path / "f")), tmp_path / "f"
    file = sum(p.stat().st_size for p in q.glob("*.safetensors"))
    cfg = load_config(q)
    table = 300 * 256 * 2  # one bfloat16 table (a tied head is the embedding)
    rng = np.random.default_rng(5)
    for backend in ("numpy", "mlx") if find_spec("mlx") else ("numpy",):
        st = load_stage(q, 0, 1, backend=backend)
        ref = load_stage(f, 0, 1, backend=backend, keep_quantized=False)
        assert st.nbytes == stage_nbytes(q, 0, 1, True, True) <= 1.1 * file
        assert ref.nbytes - st.nbytes >= (1 if tied else 2) * table  # float32 tables: 2x
        tok = np.array([0, 7, 299, 7])
        assert np.array_equal(st.embed(tok), ref.embed(tok))
        w = np.abs(load_file(str(f / "model.safetensors"))[
            "model.embed_tokens.weight" if tied else "lm_head.weight"]).astype(np.float64)
        for m in (1, 3, 40):
            h = rng.standard_normal((m, 256)).astype(np.float32)
            got, want = st.logits(h), ref.logits(h)
            be = ref.backend  # S over the normed activations the head multiplies
            x = be.to_numpy(be.rms_norm(be.asarray(h), ref.extra["norm"], cfg.norm_eps))
            bound = gamma(256) * (np.abs(np.asarray(x, np.float64)) @ w.T)
            assert got.shape == (m, 300) and np.all(np.abs(got - want) <= 2 * bound)
    shard = make_shards(cfg, [2.0, 1.0])[1]
    part = load_stage(q, 0, 1, True, True, shard=shard, reduce=lambda a: a)
    assert stage_nbytes(q, 0, 1, True, True, shard=shard) == part.nbytes
    shape = load_shape(str(q))
    assert shape.table_bits == 16 and shape.embed * shape.table_bits / 8 == table
