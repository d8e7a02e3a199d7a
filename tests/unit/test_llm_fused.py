"""The fused one-token decode (hpcmac.llm.model.fused) against the numpy operations it
replaces: same logits, step by step, on the attention variants it takes (plain GQA;
sinks and a sliding window shorter than the prompt; Q/K norm, biases and partial
rotary; Qwen3-Next's and Qwen3.5's gated attention beside their Gated DeltaNet step);
the compiled attention alone at thousands of keys against ``layers._decode_one``; its
exponential against float64's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcmac.llm.model import fused, layers
from hpcmac.llm.model import linear_attention as la
from hpcmac.llm.model.backend import NumpyBackend
from hpcmac.llm.model.rope import apply_rope

PROMPT = [3, 17, 42, 5, 9, 11, 60, 2, 8, 30, 31, 7]  # longer than gpt_oss's window of 8
STEPS = 6
#: Qwen3-Next / Qwen3.5: two full-attention layers of the four (the default is one)
HYBRID = dict(layer_types=["linear_attention", "full_attention"] * 2)


def _decode(stage, tokens):
    """Logits of the prompt's last position and of each decode step fed ``tokens``."""
    from hpcmac.llm.model.stage import Batch

    cache = stage.new_cache(1, 64)
    h = stage.forward(stage.embed(PROMPT), Batch([0], [len(PROMPT)], [0]), cache)
    out = [stage.logits(h[-1:])[0]]
    for i, t in enumerate(tokens):
        h = stage.forward(stage.embed([t]), Batch([0], [1], [len(PROMPT) + i]), cache)
        out.append(stage.logits(h)[0])
    return out


@pytest.mark.parametrize("arch,over", [("llama", {}), ("gpt_oss", {}), ("glm4_moe", {}),
                                       ("qwen3_next", HYBRID), ("qwen3_5", HYBRID)])
def test_fused_decode_equals_numpy_ops(arch, over, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hpcmac.llm.model.fixtures import random_checkpoint
    from hpcmac.llm.model.stage import load_stage

    folder = random_checkpoint(arch, tmp_path, seed=5, initializer_range=0.3, **over)
    kinds = json.loads((folder / "config.json").read_text()).get("layer_types")
    n_layers = len(kinds) if kinds else stage_layers(folder)
    n_attn = sum(k != "linear_attention" for k in kinds) if kinds else n_layers
    stage = load_stage(folder, 0, n_layers)
    calls = {"attend": 0, "delta": 0}

    def counted(name, f):
        def run(*a):
            calls[name] += 1
            return f(*a)
        return run

    monkeypatch.setattr(fused, "attend_one", counted("attend", fused.attend_one))
    monkeypatch.setattr(fused, "delta_step", counted("delta", fused.delta_step))
    tokens = list(np.random.default_rng(0).integers(0, stage.config.vocab, STEPS))
    on = _decode(stage, tokens)
    # every decode step of every layer took them (and the prompt did not)
    assert calls == {"attend": STEPS * n_attn, "delta": STEPS * (n_layers - n_attn)}
    monkeypatch.setattr(fused, "ATTEND", False)
    monkeypatch.setattr(fused, "MAX_ROWS", 0)
    monkeypatch.setattr(la, "STEP", False)
    off = _decode(stage, tokens)
    assert calls == {"attend": STEPS * n_attn, "delta": STEPS * (n_layers - n_attn)}  # none
    # float32 sums in another order (the numpy path's BLAS dot products). The hybrid
    # families amplify rounding more: on qwen3_next here the fused norms alone (MAX_ROWS,
    # with the numpy attention and DeltaNet step) already differ by 3.7e-6 at step 4;
    # attend_one alone 1.6e-6, delta_step alone 2.8e-6, all three 1.0e-5
    tol = 2e-5 if over else 2e-6
    for i, (a, b) in enumerate(zip(on, off)):
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), f"step {i}"


@pytest.mark.parametrize("arch,over", [("llama", dict(num_key_value_heads=3)),
                                       ("gpt_oss", {}), ("qwen3_next", HYBRID)])
def test_fused_decode_of_a_padded_shard_equals_numpy_ops(arch, over, tmp_path, monkeypatch):
    """A tensor-parallel shard holding part of a KV group (its queries padded to whole
    groups: llama 6 heads / 3 KV heads, gpt-oss's sinks and window, Qwen3-Next's gate, each
    5 heads / 1 KV head at 2 ranks) takes the fused one-token attention too: every rank's
    partial logits equal the numpy path's. The group's sums are left out (each shard's own
    partial results, summed by no one): the kernel path alone is compared here;
    tests/mpi/test_tensor_parity.py checks the group's tokens and logits against one rank."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.fixtures import random_checkpoint
    from hpcmac.llm.model.spec import make_shards, padded_heads
    from hpcmac.llm.model.stage import load_stage

    folder = random_checkpoint(arch, tmp_path, seed=6, initializer_range=0.3, **over)
    cfg = load_config(folder)
    kinds = json.loads((folder / "config.json").read_text()).get("layer_types")
    n_attn = sum(k != "linear_attention" for k in kinds) if kinds else cfg.n_layers
    calls = [0]

    def counted(*a):
        calls[0] += 1
        return attend(*a)

    attend = fused.attend_one
    monkeypatch.setattr(fused, "attend_one", counted)
    tokens = list(np.random.default_rng(1).integers(0, cfg.vocab, STEPS))
    for r, shard in enumerate(make_shards(cfg, [1.0, 1.0])):
        assert padded_heads(cfg, shard) is not None  # the case under test
        stage = load_stage(folder, 0, cfg.n_layers, shard=shard, reduce=lambda a: a)
        monkeypatch.setattr(fused, "ATTEND", True)
        calls[0] = 0
        on = _decode(stage, tokens)
        assert calls[0] == STEPS * n_attn  # every decode step of every attention layer
        monkeypatch.setattr(fused, "ATTEND", False)
        off = _decode(stage, tokens)
        tol = 2e-5 if over is HYBRID else 2e-6
        for i, (a, b) in enumerate(zip(on, off)):
            assert np.abs(a - b).max() <= tol * np.abs(b).max(), f"rank {r} step {i}"


def stage_layers(folder) -> int:
    from hpcmac.llm.model.config import load_config

    return load_config(folder).n_layers


def _numpy_attention(qkv, H, KV, d, cos, sin, scale, qn, kn, eps, ck, cv, pos, window,
                     sinks, gated):
    """``layers.attention``'s numpy path from the QKV row on, one sequence in slot 0."""
    be = NumpyBackend()
    qd = 2 * d if gated else d
    q = qkv[:, :H * qd].reshape(1, H, qd)
    q, gate = q[..., :d], q[..., d:].reshape(1, H * d) if gated else None
    k = qkv[:, H * qd:H * qd + KV * d].reshape(1, KV, d)
    v = qkv[:, H * qd + KV * d:].reshape(1, KV, d)
    if qn.shape[0]:
        q, k = be.rms_norm(q, qn, eps), be.rms_norm(k, kn, eps)
    c, s = cos[None, None], sin[None, None]
    q = apply_rope(q, c, s, False, np) * scale
    k = apply_rope(k, c, s, False, np)
    o = layers._decode_one(be, q, k, v, (0, 0, 1, pos), ck, cv, H // KV, window,
                           sinks if sinks.shape[0] else None)
    return o * be.sigmoid(gate) if gated else o


@pytest.mark.parametrize("keys,window,sinks,gated,norm,H,d", [
    (4096, 0, False, True, True, 8, 64),  # Qwen3-Next's full attention at 4k context
    (1500, 0, False, False, False, 8, 64),
    (3000, 700, True, False, False, 8, 64),  # gpt-oss: a window and sinks
    (1, 0, True, True, True, 8, 64),
    (4097, 0, False, True, True, 8, 128),  # heads of 128 (Qwen3-Next's own), keys past a block
    (1029, 0, True, False, True, 14, 128),  # 7 query heads a KV head: a group of 4, then 3
    (203, 0, True, False, False, 4, 48)])  # d not a multiple of 64: the loops
def test_attend_one_equals_numpy_at_many_keys(keys, window, sinks, gated, norm, H, d):
    rng = np.random.default_rng(keys)
    KV, half = 2, d // 8  # a rotary quarter of each head
    qkv = rng.standard_normal((1, (2 * H if gated else H) * d + 2 * KV * d), dtype=np.float32)
    ck = rng.standard_normal((2, KV, keys + 3, d), dtype=np.float32)
    cv = rng.standard_normal((2, KV, keys + 3, d), dtype=np.float32)
    ang = rng.uniform(0, 6, half).astype(np.float32)
    qn, kn = ((1 + 0.1 * rng.standard_normal((2, d))).astype(np.float32) if norm else
              (fused_none(), fused_none()))
    sk = rng.standard_normal(H).astype(np.float32) if sinks else fused_none()
    scale, pos = np.float32(d ** -0.5), keys - 1
    args = (qkv, H, KV, d, np.cos(ang), np.sin(ang), scale, qn, kn, 1e-6)
    ck2, cv2, ck0 = ck[1:].copy(), cv[1:].copy(), ck[0].copy()  # slot 1 alone
    want = _numpy_attention(*args, ck2, cv2, pos, window, sk, gated)
    j0 = max(0, pos + 1 - window) if window else 0
    got = fused.attend_one(*args, ck, cv, 1, pos, j0, sk, gated)  # slot 1
    # the cache written (the key normed and rotated: the same up to rounding)
    np.testing.assert_allclose(ck[1, :, pos], ck2[0, :, pos], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cv[1, :, pos], cv2[0, :, pos])
    np.testing.assert_array_equal(ck[0], ck0)  # another slot untouched
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    assert np.abs(want).max() > 0.01


def fused_none():
    return np.empty(0, np.float32)


def test_avec_exp_within_one_ulp():
    """The softmax kernel's exponential (explicit SIMD, the same steps as exp32) over
    float32's whole normal range against float64's exp: within 1 ulp; 0 below the
    normals; a length not a multiple of 16 (the one-value tail)."""
    from hpcmac.llm.model import avec

    x = np.concatenate([np.linspace(-87.3, 88.3, 2_000_001, dtype=np.float32),
                        np.float32([0.0, -1e-30, 1e-30, -0.3465736, 0.3465736, -87.32])])
    ex = np.exp(x.astype(np.float64))
    ulp = np.spacing(ex.astype(np.float32)).astype(np.float64)
    assert (np.abs(avec.exp(x) - ex) / ulp).max() <= 1.0
    assert not avec.exp(np.float32([-87.5, -1e4, -np.inf])).any()


@pytest.mark.parametrize("L", [1, 15, 16, 33, 4096])
def test_avec_softmax_equals_numpy(L):
    """Rows of scores through avec.softmax, with and without a sink, against float64."""
    from hpcmac.llm.model import avec

    rng = np.random.default_rng(L)
    s = (5 * rng.standard_normal((3, L))).astype(np.float32)
    sinks = np.float32([-np.inf, 0.5, 9.0])
    want = np.exp(np.concatenate([s, sinks[:, None]], axis=1).astype(np.float64))
    want = (want / want.sum(axis=1, keepdims=True))[:, :L]
    got = s.copy()
    avec.softmax(got, sinks)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert np.abs(got[0].sum() - 1.0) < 1e-5


def test_exp32_within_one_ulp():
    """exp32 in a compiled loop (vectorised, as the softmax runs it) over float32's whole
    normal range against float64's exp: within 1 ulp (numpy's own float32 exp: within 2.3
    here); 0 where e^x is below the normals; sigmoid32 likewise."""
    import numba as nb

    @nb.njit(fastmath={"reassoc", "contract"})
    def each(f, x):
        out = np.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = f(x[i])
        return out

    x = np.concatenate([np.linspace(-87.3, 88.3, 2_000_001, dtype=np.float32),
                        np.float32([0.0, -1e-30, 1e-30, -0.3465736, 0.3465736, -87.32])])
    ex = np.exp(x.astype(np.float64))
    ulp = np.spacing(ex.astype(np.float32)).astype(np.float64)
    assert (np.abs(each(fused.exp32, x) - ex) / ulp).max() <= 1.0
    assert not each(fused.exp32, np.float32([-87.5, -1e4, -np.inf])).any()
    s = np.linspace(-80, 80, 100_001, dtype=np.float32)
    want = 1.0 / (1.0 + np.exp(-s.astype(np.float64)))
    assert (np.abs(each(fused.sigmoid32, s) - want) / want).max() <= 3e-7
