"""Gated DeltaNet's numerics (``hpcmac.llm.model.linear_attention``): the chunked form a
prompt runs equals the recurrence a decode step runs, token for token, from a given state;
the compiled decode step (``fused.delta_step``) equals the numpy one; and a
linear-attention family's bad config field is one line and exit 2 before any weight
is read (the whole models are checked against transformers in tests/mpi/test_qwen3_next.py
and test_qwen3_5.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcmac.lifecycle import run_cli
from hpcmac.llm.__main__ import main
from hpcmac.llm.model import linear_attention as la


def _inputs(rng, H, n, dk, dv):
    q = rng.standard_normal((H, n, dk), dtype=np.float32)
    k = rng.standard_normal((H, n, dk), dtype=np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((H, n, dv), dtype=np.float32)
    beta = rng.uniform(0.05, 0.95, (H, n)).astype(np.float32)
    g = -rng.uniform(0.0, 0.5, (H, n)).astype(np.float32)
    return q, k, v, beta, g


@pytest.mark.parametrize("n", [1, 63, 150])
def test_chunked_equals_the_recurrence(n):
    """150 tokens cross two 64-token chunk boundaries; the start state is not zero."""
    rng = np.random.default_rng(n)
    H, dk, dv = 3, 8, 5
    q, k, v, beta, g = _inputs(rng, H, n, dk, dv)
    S0 = 0.3 * rng.standard_normal((H, dk, dv), dtype=np.float32)
    out, S = la._chunked(S0, q, k, v, beta, g)
    R, want = S0[None], []
    for t in range(n):
        o, R = la._recurrent(R, q[None, :, t], k[None, :, t], v[None, :, t],
                             beta[None, :, t], g[None, :, t])
        want.append(o[0])
    np.testing.assert_allclose(out, np.stack(want, axis=1), rtol=0, atol=2e-5)
    np.testing.assert_allclose(S, R[0], rtol=0, atol=2e-5)
    assert np.abs(S - S0).max() > 1e-2  # the tokens moved the state


def test_bad_field_is_one_line_exit_2(tmp_path, capsys):
    cfg = dict(model_type="qwen3_next", vocab_size=96, hidden_size=40, num_hidden_layers=4,
               num_attention_heads=5, num_key_value_heads=1, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=5, linear_key_head_dim=8,
               linear_value_head_dim=12)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    try:
        code = run_cli(main, ["generate", "--model", str(tmp_path), "--prompt-ids", "1,2"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{tmp_path / 'config.json'}: field 'linear_num_value_heads' = 5" in err[0]


@pytest.mark.parametrize("n", [1, 37, 150])
def test_mlx_chunked_equals_numpy(n):
    """The MLX backend's chunked form (the UT system solved by an inverse made of matmuls,
    a chunk padded to a power of 2) against numpy's (``np.linalg.solve``): 150 tokens are
    two whole chunks and a 22-token tail."""
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(10 + n)
    H, dk, dv = 3, 8, 5
    q, k, v, beta, g = _inputs(rng, H, n, dk, dv)
    S0 = 0.3 * rng.standard_normal((H, dk, dv), dtype=np.float32)
    want, S_want = la._chunked(S0, q, k, v, beta, g)
    out, S = la._mlx_chunked(mx, *(mx.array(a) for a in (S0, q, k, v, beta, g)))
    np.testing.assert_allclose(np.array(out), want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.array(S), S_want, rtol=0, atol=2e-5)
    A = (np.tril(rng.uniform(-1, 1, (2, 16, 16)), -1) + np.eye(16)).astype(np.float32)
    inv = np.array(la._mlx_unit_lower_inverse(mx, mx.array(A)))
    np.testing.assert_allclose(inv @ A, np.broadcast_to(np.eye(16), A.shape), rtol=0, atol=1e-4)


def test_compiled_decode_step_equals_numpy():
    """``gated_delta_net``'s decode through ``fused.delta_step`` against its numpy form:
    two sequences in one step (one at position 0 in a slot holding another's old states,
    which it must not see), Qwen3-Next's head counts (8 key heads of 128, 16 value heads
    of 128, 2 value heads a key head); the output, the conv and recurrent states."""
    import types

    from hpcmac.llm.model.backend import NumpyBackend

    be = NumpyBackend()
    rng = np.random.default_rng(1)
    nk, nv, dk, dv, K, D = 8, 16, 128, 128, 4, 64
    C = 2 * nk * dk + nv * dv
    cfg = types.SimpleNamespace(linear_k_heads=nk, linear_v_heads=nv, linear_k_dim=dk,
                                linear_v_dim=dv, norm_eps=1e-6)
    w = {"w_lin_in": be.weight(0.2 * rng.standard_normal((C + nv * dv + 2 * nv, D),
                                                         dtype=np.float32)),
         "conv_w": 0.5 * rng.standard_normal((C, K), dtype=np.float32),
         "lin_A": -np.exp(rng.uniform(-1, 1, nv)).astype(np.float32),
         "dt_bias": rng.standard_normal(nv, dtype=np.float32),
         "lin_vk": np.arange(nv) // (nv // nk),
         "lin_norm": (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32),
         "w_lin_out": be.weight(0.05 * rng.standard_normal((D, nv * dv), dtype=np.float32))}
    conv0 = rng.standard_normal((3, K - 1, C), dtype=np.float32)
    state0 = 0.3 * rng.standard_normal((3, nv, dk, dv), dtype=np.float32)
    x = rng.standard_normal((2, D), dtype=np.float32)
    seqs = [(2, 0, 1, 5), (0, 1, 1, 0)]  # (slot, offset, n_new, position)
    got = {}
    for step in (True, False):
        la.STEP = step
        conv, state = conv0.copy(), state0.copy()
        got[step] = (la.gated_delta_net(be, cfg, w, x, seqs, conv, state), conv, state)
    la.STEP = True
    for a, b in zip(got[True], got[False]):
        assert np.abs(a - b).max() <= 2e-6 * np.abs(b).max()
    out, conv, state = got[True]
    np.testing.assert_array_equal(conv[0, :-1], 0.0)  # the fresh sequence's zero history
    np.testing.assert_array_equal(conv[1], conv0[1])  # an idle slot untouched
    np.testing.assert_array_equal(state[1], state0[1])
    assert np.abs(state[2] - state0[2]).max() > 1e-2 and np.abs(out).max() > 1e-2
