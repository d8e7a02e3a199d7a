"""Decode measures: a random Llama checkpoint, the read bandwidth, a stage's decode rate.

Shared by ``hpcmac.bench`` (which prints them against references) and
``hpcmac.plan`` (which calibrates its model with them). Local, not collective.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np


def write_random_llama(folder: Path, hidden: int, layers: int, intermediate: int, vocab: int,
                       heads: int, kv_heads: int, seed: int = 0) -> Path:
    """A random float32 Llama checkpoint (config.json + model.safetensors), numpy only."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    d = hidden // heads
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02))

    t = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
         "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "self_attn.q_proj.weight"] = w(heads * d, hidden)
        t[p + "self_attn.k_proj.weight"] = w(kv_heads * d, hidden)
        t[p + "self_attn.v_proj.weight"] = w(kv_heads * d, hidden)
        t[p + "self_attn.o_proj.weight"] = w(hidden, heads * d)
        t[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        t[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
    save_file(t, str(folder / "model.safetensors"))
    return folder


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Read bandwidth in bytes/s: BLAS sdot over two float32 arrays of nbytes/2 each."""
    n = nbytes // 8
    a = np.ones(n, dtype=np.float32)
    b = np.ones(n, dtype=np.float32)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n * 4 / statistics.median(times)


def decode_rate(stage, n_seq: int, steps: int, prompt_len: int = 16,
                counts: dict | None = None) -> float:
    """Aggregate decode tok/s of n_seq sequences (median step time), after a prefill.

    On MLX a step is what generate's one rank does: the forward, the head and the greedy
    argmax in the graph, one evaluation, the ids alone brought back. ``counts``: filled
    with the backend's ``host_syncs_per_token`` and ``host_bytes_per_token`` over the
    decode steps (counted by the backend: 0 on numpy)."""
    from hpcmac.llm.model.stage import Batch

    be = stage.backend
    lazy = be.name == "mlx"
    cache = stage.new_cache(n_seq, prompt_len + steps + 1)
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, stage.config.vocab, size=(n_seq, prompt_len))
    slots = list(range(n_seq))
    h = stage.forward(stage.embed(prompts.ravel()), Batch(slots, [prompt_len] * n_seq,
                                                          [0] * n_seq), cache)
    last = np.cumsum([prompt_len] * n_seq) - 1
    toks = stage.logits(h[last]).argmax(axis=1)
    times = []
    s0, b0 = be.syncs, be.host_bytes
    for s in range(steps):
        t = time.perf_counter()
        h = stage.forward(stage.embed(toks), Batch(slots, [1] * n_seq,
                                                   [prompt_len + s] * n_seq), cache, lazy=lazy)
        if lazy:
            toks = be.host(be.mx.argmax(stage.logits(h, lazy=True), axis=1),
                           *stage.cache_arrays(cache)).astype(np.int64)
        else:
            toks = stage.logits(h).argmax(axis=1)
        times.append(time.perf_counter() - t)
    if counts is not None:
        counts["host_syncs_per_token"] = (be.syncs - s0) / (steps * n_seq)
        counts["host_bytes_per_token"] = (be.host_bytes - b0) / (steps * n_seq)
    return n_seq / statistics.median(times)
