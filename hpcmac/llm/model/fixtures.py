"""Small random checkpoints for tests and benchmarks, built with transformers.

``random_checkpoint(arch, folder)`` writes a Hugging Face folder (config.json +
float32 safetensors) of a tiny random model of each supported architecture;
``write_gguf(folder, file, qtype)`` converts such a Llama/Qwen folder to GGUF
with the ``gguf`` package's writer (the Llama Q/K permutation applied as
llama.cpp's converter does). Needs torch and transformers (the test extra);
both are imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def random_checkpoint(arch: str, folder: str | Path, seed: int = 0,
                      initializer_range: float = 0.1, **overrides) -> Path:
    """Write a random ``arch`` model to ``folder`` (float32 safetensors); returns the folder.

    Its shapes are the family's ``tiny`` fields (``arch/<model_type>.py``) with ``overrides``.

    Norm weights, biases (gpt-oss's per-expert ones too) and DeepSeek's routing
    correction bias are perturbed too (transformers initialises them to constants), so
    every tensor matters.
    """
    import torch
    import transformers

    from hpcmac.llm.model.arch import family

    fam = family(arch, "random_checkpoint")
    fields = {**fam.tiny, "initializer_range": initializer_range,
              "tie_word_embeddings": False, **overrides}
    cfg = getattr(transformers, fam.hf_class)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
            elif name.endswith("_bias"):  # per-expert biases (E, n): gpt-oss
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            elif t.ndim == 1 and "inv_freq" not in name:
                # norms and Gemma 4's layer_scalar and router scales multiply: around 1
                base = 1.0 if name.endswith(("norm.weight", "layer_scalar", "router.scale",
                                             "router.per_expert_scale")) else 0.0
                t.copy_(base + 0.1 * torch.randn(t.shape, generator=gen))
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def mxfp4_checkpoint(folder: str | Path, out: str | Path, seed: int = 0) -> Path:
    """A copy of a random gpt_oss ``folder`` whose experts are MXFP4, as gpt-oss publishes
    them: random codes and power-of-two scales (2^-5 to 2^-2) written as
    ``experts.{gate_up,down}_proj_{blocks,scales}`` (E, out, in/32, 16) and (E, out, in/32)
    uint8, and ``quantization_config`` ``mxfp4`` in config.json. Needs hidden and
    intermediate sizes that are multiples of 32."""
    from safetensors.numpy import load_file, save_file

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    rng = np.random.default_rng(seed)
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                E, inp, outs = t.shape  # transformers' (E, in, out): stored (E, out, in)
                tensors[name + "_blocks"] = rng.integers(0, 256, (E, outs, inp // 32, 16),
                                                         dtype=np.uint8)
                tensors[name + "_scales"] = rng.integers(122, 126, (E, outs, inp // 32),
                                                         dtype=np.uint8)
            else:
                tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def mlx_quantized_copy(folder: str | Path, out: str | Path, bits: int = 4, group: int = 32,
                       mode: str = "affine") -> Path:
    """A copy of ``folder`` in MLX's quantized format, as ``mx.quantize`` writes it (any
    family, the names kept; mlx-lm's converter covers only some): every 2-D ``.weight``
    whose input size is a multiple of ``group`` becomes ``.weight`` (uint32 words),
    ``.scales`` and ``.biases`` (affine) or ``.scales`` (uint8 E8M0, ``mode="mxfp4"``);
    ``quantization`` in config.json. Latent attention's ``kv_b_proj`` stays float (it is
    absorbed per head, never multiplied as stored); so do tensors that are not ``.weight``
    (gpt-oss's experts: :func:`mxfp4_checkpoint` for theirs)."""
    import mlx.core as mx
    from safetensors.numpy import load_file, save_file

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not (name.endswith(".weight") and t.ndim == 2 and t.shape[-1] % group == 0
                    and "kv_b_proj" not in name):
                tensors[name] = t
                continue
            wq, *sb = mx.quantize(mx.array(t.astype(np.float32)), group_size=group, bits=bits,
                                  mode=mode)
            base = name[:-len("weight")]
            tensors[name] = np.array(wq)
            for part, a in zip(("scales", "biases"), sb):
                tensors[base + part] = np.array(a)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "mlx"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {"group_size": group, "bits": bits, "mode": mode}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


#: config.json's quantization_config of the FP8 releases (DeepSeek V3's own)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}


def is_fp8_linear(name: str, shape, kept_float: tuple = ()) -> bool:
    """Whether the FP8 releases store tensor ``name`` in FP8: every linear projection
    (attention, MLP, routed and shared experts, the indexer's); not the embedding, the
    head, the norms or the routers, nor the projections in ``kept_float`` (the family's
    :attr:`~hpcmac.llm.model.arch.base.Family.fp8_float`)."""
    if len(shape) != 2 or not name.endswith(".weight") or "lm_head" in name or \
            any(name.endswith(k + ".weight") for k in kept_float):
        return False
    module = name[:-len(".weight")].rsplit(".", 1)[-1]  # q_proj, in_proj_qkvz, w1, wq_b
    return module.endswith("_proj") or "_proj_" in module or \
        module in ("w1", "w2", "w3", "wq_b", "wk")


def _release_copy(folder, out, float_out, convert, qcfg: dict, dtype: str | None = None
                  ) -> Path:
    """A copy of float ``folder`` with each tensor as ``convert(name, float32 array)``
    stores it (a dict of stored tensors and the dequantized float32, or None: as it was),
    ``qcfg`` as config.json's quantization_config (and ``dtype`` as its dtype, the
    release's), and in ``float_out`` (if given) the dequantized float32 model under the
    same config without it."""
    import torch
    from safetensors.numpy import load_file
    from safetensors.numpy import save_file as save_np
    from safetensors.torch import save_file

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    tensors, floats = {}, {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in load_file(f).items():
            got = convert(name, t)
            if got is None:
                tensors[name] = torch.from_numpy(np.ascontiguousarray(t))
                floats[name] = t
            else:
                tensors.update(got[0])
                floats[name] = got[1]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    qraw = {k: v for k, v in cfg.items() if not (dtype and k == "torch_dtype")}
    if dtype:
        qraw["dtype"] = dtype
    (out / "config.json").write_text(json.dumps({**qraw, "quantization_config": qcfg},
                                                indent=1))
    if float_out is not None:
        float_out = Path(float_out)
        float_out.mkdir(parents=True, exist_ok=True)
        save_np(floats, str(float_out / "model.safetensors"), metadata={"format": "pt"})
        (float_out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def fp8_checkpoint(folder: str | Path, out: str | Path, float_out: str | Path | None = None
                   ) -> Path:
    """A copy of a random float ``folder`` quantized as DeepSeek's FP8 release is: each
    linear weight (:func:`is_fp8_linear`) as F8_E4M3 codes and a float32
    ``weight_scale_inv`` per 128 x 128 block (``amax / 448``; torch's float8_e4m3fn
    rounding: :func:`hpcmac.llm.model.fp8.quantize`), the embedding and head in bfloat16
    (rounded to nearest even, by torch) as the releases store them, the rest as it was,
    and :data:`FP8_CONFIG` in config.json. ``float_out``: also the dequantized float32
    model (the same config without quantization; the oracle's weights)."""
    import torch

    from hpcmac.llm.model import fp8
    from hpcmac.llm.model.arch import family
    from hpcmac.llm.model.spec import BF16_KEPT

    raw = json.loads((Path(folder) / "config.json").read_text())
    kept = family(raw.get("model_type"), "fp8_checkpoint").fp8_float

    def convert(name, t):
        if name in BF16_KEPT:
            bf = torch.from_numpy(np.ascontiguousarray(t, np.float32)).to(torch.bfloat16)
            return {name: bf}, bf.float().numpy()
        if not is_fp8_linear(name, t.shape, kept):
            return None
        codes, sinv = fp8.quantize(t.astype(np.float32))
        return ({name: torch.from_numpy(codes).view(torch.float8_e4m3fn),
                 name + "_scale_inv": torch.from_numpy(sinv)}, fp8.dequantize(codes, sinv))

    return _release_copy(folder, out, float_out, convert, FP8_CONFIG, dtype="bfloat16")


def int4_config(group: int = 32) -> dict:
    """config.json's quantization_config of Kimi K2 Thinking (compressed-tensors INT4)."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False,
               "group_size": group, "num_bits": 4, "observer": "minmax",
               "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"}
    return {"config_groups": {"group_0": {"input_activations": None,
                                          "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*",
                                                   "re:.*shared_experts.*",
                                                   "re:.*mlp\\.(gate|up|down)_proj.*"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed"}


def int4_checkpoint(folder: str | Path, out: str | Path, float_out: str | Path | None = None,
                    group: int = 32) -> Path:
    """A copy of a random float ``folder`` quantized as Kimi K2 Thinking is: the routed
    experts' projections as compressed-tensors ``pack-quantized`` INT4 (``weight_packed``
    int32, eight codes ``q + 8`` a word, little-endian; ``weight_scale`` bfloat16 per
    ``group`` inputs, ``amax / 7.5`` as its min-max observer, ``q = clamp(round(w / s),
    -8, 7)``; ``weight_shape``), the rest as it was; :func:`int4_config` in config.json.
    ``float_out``: also the dequantized float32 model ``s * q`` (the oracle's weights)."""
    import torch

    from hpcmac.llm.model.quant import pack

    def convert(name, t):
        if ".experts." not in name or not is_fp8_linear(name, t.shape):
            return None
        g = t.astype(np.float32).reshape(t.shape[0], -1, group)
        s = torch.from_numpy(np.abs(g).max(axis=-1) / np.float32(7.5)).to(torch.bfloat16)
        s32 = s.float().numpy()
        q = np.clip(np.rint(g / np.where(s32 > 0, s32, 1)[..., None]), -8, 7).astype(np.int8)
        base = name[:-len("weight")]
        return ({base + "weight_packed": torch.from_numpy(
                    pack((q.reshape(t.shape) + 8).astype(np.uint8), 4).view(np.int32)),
                 base + "weight_scale": s,
                 base + "weight_shape": torch.tensor(list(t.shape), dtype=torch.int64)},
                (q * s32[..., None]).reshape(t.shape))

    return _release_copy(folder, out, float_out, convert, int4_config(group))


def hf_model(folder: str | Path):
    """The transformers model of a folder, float32, eval mode (the oracle)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Llama Q/K rows (inverse of unpermute_rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def gguf_form_parts(form: tuple, w: np.ndarray, cfg=None) -> dict[str, np.ndarray]:
    """The GGUF tensors of a canonical tensor ``w`` stored in another layout
    (:attr:`~hpcmac.llm.model.spec.TensorSpec.gguf_form`; the split, not the fused form;
    ``cfg``: the model's, which a ``rows`` form's index needs)."""
    kind, *names = form
    if kind == "rows":  # the inverse of GGUFCheckpoint._gather
        axis, index, post, *names = names
        idx, counts = index(cfg)
        if post == "neg_log":
            w = -np.exp(w)
        elif post == "conv":
            w = w[:, 0, :]
        if idx is not None:
            stored = np.empty_like(w)
            sl = [slice(None)] * w.ndim
            sl[axis] = idx
            stored[tuple(sl)] = w
            w = stored
        cuts = np.cumsum(counts)[:-1]
        return {n: np.ascontiguousarray(p, dtype=np.float32)
                for n, p in zip(names, np.split(w, cuts, axis=axis))}
    if kind == "t":
        return {names[0]: np.ascontiguousarray(w.swapaxes(-1, -2))}
    if kind == "pairs_t":
        w = w.swapaxes(-1, -2)  # (..., 2 out, in), rows interleaved
        return {names[0]: np.ascontiguousarray(w[..., 0::2, :]),
                names[1]: np.ascontiguousarray(w[..., 1::2, :])}
    return {names[0]: np.ascontiguousarray(w[..., 0::2]),
            names[1]: np.ascontiguousarray(w[..., 1::2])}


def write_gguf(folder: str | Path, out: str | Path, qtype: str = "F32",
               split_kv_b: bool = False, experts_only: bool = False) -> Path:
    """Convert a random Llama/Qwen2/Qwen3/Qwen3-MoE folder to one GGUF file, weights as ``qtype``.

    ``qtype`` is F32, F16, Q8_0 or another type the gguf package quantizes (MXFP4, Q4_0,
    ...; norms and biases stay F32, as llama.cpp keeps them).
    DeepSeek-V3 folders become ``deepseek2`` GGUFs with ``attn_kv_b``, or with the
    newer ``attn_k_b``/``attn_v_b`` split if ``split_kv_b``. A tensor the family stores
    in another GGUF layout (gpt-oss's experts: ``TensorSpec.gguf_form``) is written in
    that layout: gate and up split, each expert (out, in). ``experts_only``: only the
    routed experts as ``qtype``, the rest F32 (as ggml-org's MXFP4 gpt-oss files keep the
    experts alone MXFP4).
    """
    import gguf

    from hpcmac.llm.model import arch as families
    from hpcmac.llm.model import spec
    from hpcmac.llm.model.weights import SafetensorsCheckpoint

    folder, out = Path(folder), Path(out)
    ckpt = SafetensorsCheckpoint(folder)
    cfg = ckpt.config()
    fam = families.of(cfg)
    gname_of = families.gguf_names(cfg)
    w = gguf.GGUFWriter(str(out), fam.gguf_arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.intermediate)
    w.add_head_count(cfg.n_heads)
    if not cfg.mla:  # latent attention: the family's (llama.cpp's MQA form)
        w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_dimension_count(cfg.rope_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab)
    if cfg.n_experts:
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.n_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate)
    fam.write_gguf_meta(w, cfg)  # key/value lengths and the family's own metadata
    # a placeholder byte-level vocabulary (llama.cpp needs one; prompts are given as ids)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fam.gguf_pre[0] if fam.gguf_pre else "default")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab)])
    w.add_token_types([1] * cfg.vocab)
    w.add_token_merges(["t1 t2"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    gtype = getattr(gguf.GGMLQuantizationType, qtype)
    tensors = {n: ckpt.get(n) for n in ckpt.names() if ".experts." not in n}
    for t in families.stage_tensors(cfg, 0, cfg.n_layers, True, True):
        if spec.is_expert_stack(t):  # routed experts: one (E, out, in) tensor per projection
            parts = t.name.split(".")
            tensors[t.gguf] = ckpt.experts(int(parts[2]), parts[-1], module=parts[3])
        elif t.gguf_form:
            tensors.pop(t.name, None)
            tensors.update(gguf_form_parts(t.gguf_form, ckpt.get(t.name), cfg))
        elif ".experts." in t.name:  # an expert tensor stored as it is (gpt-oss's biases)
            tensors[t.gguf] = ckpt.get(t.name)
    if split_kv_b:
        for i in range(cfg.n_layers):
            kv = tensors.pop(f"model.layers.{i}.self_attn.kv_b_proj.weight")
            kv = kv.reshape(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            tensors[f"blk.{i}.attn_k_b.weight"] = np.ascontiguousarray(
                kv[:, :cfg.qk_nope_head_dim].transpose(0, 2, 1))  # (H, r, nope)
            tensors[f"blk.{i}.attn_v_b.weight"] = np.ascontiguousarray(
                kv[:, cfg.qk_nope_head_dim:])  # (H, v, r)
    for name, t in tensors.items():
        if cfg.norm_offset and name.endswith("norm.weight") and \
                not name.endswith("linear_attn.norm.weight"):
            t = t + np.float32(cfg.norm_offset)  # llama.cpp stores Qwen3-Next's 1 + w
        if fam.gguf_qk_permuted and name.endswith("q_proj.weight"):
            t = _permute(t, cfg.n_heads)
        elif fam.gguf_qk_permuted and name.endswith("k_proj.weight"):
            t = _permute(t, cfg.n_kv_heads)
        gname = name if name.startswith("blk.") else gname_of[name]
        block = gguf.GGML_QUANT_SIZES[gtype][0]
        if t.ndim >= 2 and qtype != "F32" and t.shape[-1] % block == 0 and \
                gname.endswith(".weight") and (not experts_only or "_exps." in gname):
            # biases stay F32, as llama.cpp keeps them
            # a few rows at a time: MXFP4's reference quantizer compares every weight with
            # all 16 values at once (64 bytes a weight)
            rows = t.reshape(-1, t.shape[-1])
            step = max(1, (16 << 20) // (64 * t.shape[-1]))
            data = np.concatenate([gguf.quants.quantize(rows[i:i + step], gtype)
                                   for i in range(0, rows.shape[0], step)])
            w.add_tensor(gname, data.reshape(*t.shape[:-1], -1), raw_dtype=gtype)
        else:
            w.add_tensor(gname, t.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def mlx_lm_quantize(folder: str | Path, out: str | Path, bits: int | None, group: int,
                    recipe: str | None = None, mode: str = "affine") -> Path:
    """Quantize a random folder with mlx-lm itself (as ``mlx_lm.convert -q``), into ``out``
    (``bits`` None: converted without quantizing, as ``mlx_lm.convert`` alone; the weights
    as mlx-lm's ``sanitize`` leaves them).

    ``recipe``: one of mlx-lm's mixed-precision recipes (e.g. ``mixed_3_6``); ``mode``:
    MLX's quantization mode (``mxfp4``: ``--q-mode mxfp4``).
    mlx-lm reads config.json's fields where the releases (transformers 4) put them:
    ``rope_theta``, ``rope_scaling`` (None for plain rotary: glm4_moe requires the key;
    gpt-oss's YaRN), ``partial_rotary_factor`` and ``num_experts`` at the top, MiniMax
    M2's ``rotary_dim`` and ``shared_intermediate_size`` (0: it has none), where
    transformers 5 writes ``rope_parameters`` and ``num_local_experts``: they are added to
    the source folder first, with the same values, so both sides read one model. mlx-lm
    is the oracle (test extra), never a dependency.
    """
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in rope:  # Qwen3-Next's, at the top in its releases
        cfg.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    cfg.setdefault("rope_scaling", None if scaling.get("rope_type", "default") == "default"
                   else scaling)
    if "num_local_experts" in cfg:
        cfg.setdefault("num_experts", cfg["num_local_experts"])
    if cfg.get("model_type") == "minimax_m2":  # as MiniMax-M2's release writes them
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        cfg.setdefault("rotary_dim", int(head * cfg.get("partial_rotary_factor", 1.0)))
        cfg.setdefault("shared_intermediate_size", 0)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    model, config = load_model(folder, lazy=False)
    pred = None
    if recipe:
        from mlx_lm.convert import mixed_quant_predicate_builder

        pred = mixed_quant_predicate_builder(recipe, model, group)
    if bits is not None:
        model, config = quantize_model(model, config, group, bits, mode=mode,
                                       quant_predicate=pred)
    save_model(out, model)
    save_config(config, out / "config.json")
    return out


def qwen3_5_released(folder: str | Path, out: str | Path, model_type: str) -> Path:
    """A random ``qwen3_5_text`` / ``qwen3_5_moe_text`` folder laid out as Qwen3.5's
    releases are (what mlx-lm reads: it has no text-only model type): config.json under
    ``text_config`` with ``model_type`` (``qwen3_5`` or ``qwen3_5_moe``), tensors under
    ``model.language_model.``, routed experts fused as ``experts.gate_up_proj`` (E, 2I, D)
    (gate's rows, then up's) and ``experts.down_proj`` (E, D, I)."""
    from safetensors.numpy import load_file, save_file

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    t = {"model.language_model." + k[len("model."):] if k.startswith("model.") else k: v
         for k, v in load_file(folder / "model.safetensors").items()}
    for layer in range(cfg["num_hidden_layers"]):
        pre = f"model.language_model.layers.{layer}.mlp.experts"
        if f"{pre}.0.gate_proj.weight" not in t:
            continue
        parts = {p: [t.pop(f"{pre}.{e}.{p}_proj.weight") for e in range(cfg["num_experts"])]
                 for p in ("gate", "up", "down")}
        t[f"{pre}.gate_up_proj"] = np.concatenate([np.stack(parts["gate"]),
                                                   np.stack(parts["up"])], axis=1)
        t[f"{pre}.down_proj"] = np.stack(parts["down"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(
        model_type=model_type, text_config=cfg,
        tie_word_embeddings=cfg.get("tie_word_embeddings", False)), indent=1))
    return out


def mlx_lm_greedy(folder: str | Path, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of mlx-lm's own generation loop on ``folder`` (the oracle)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    steps = generate_step(mx.array(prompt), model, max_tokens=n,
                          sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(tok) for (tok, _), _ in zip(steps, range(n))]


def stage_greedy(stage, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of one whole-model ``stage``, not stopping at EOS (as
    mlx-lm's generate_step)."""
    from hpcmac.llm.model.stage import Batch

    cache = stage.new_cache(1, len(prompt) + n)
    x = stage.forward(stage.embed(prompt), Batch([0], [len(prompt)], [0]), cache)
    out = [int(stage.logits(x[-1:]).argmax())]
    for pos in range(len(prompt), len(prompt) + n - 1):
        x = stage.forward(stage.embed(out[-1:]), Batch([0], [1], [pos]), cache)
        out.append(int(stage.logits(x).argmax()))
    return out


def dequantized_gguf(src: str | Path, out: str | Path) -> Path:
    """A copy of the GGUF file ``src`` whose quantized tensors are float32 (every
    metadata key kept, ``general.file_type`` set to all-F32): a float target beside its
    quantized draft, for hpcmac and llama.cpp alike (hpcmac.bench.spec)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = str(r.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(out), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        val = 0 if name == "general.file_type" else f.contents()
        w.add_key_value(name, val, vtype, sub_type=sub)
    for t in r.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        w.add_tensor(t.name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
