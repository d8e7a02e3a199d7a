"""Model families, one module each, registered here by ``model_type``.

A family module ``arch/<model_type>.py`` defines ``FAMILY``
(:class:`~hpcmac.llm.model.arch.base.Family`): its config mappings from
``config.json`` and GGUF metadata, and the blocks (:mod:`.blocks`) each of its
layers is made of, which give the layer's tensors (names, GGUF names, shapes,
class, tensor-parallel split), its loading and its forward. Adding a family is
its module, its test and one entry in :data:`NAMES`.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from hpcmac.errors import UsageError

if TYPE_CHECKING:
    from hpcmac.llm.model.arch.base import Family
    from hpcmac.llm.model.arch.fields import GGUFMeta, ModelConfig
    from hpcmac.llm.model.spec import TensorSpec

#: the supported families, by Hugging Face ``model_type`` (= their module's name)
NAMES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss",
         "minimax_m2", "glm4_moe_lite", "kimi_k25", "kimi_k2", "qwen3_next",
         "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v32",
         "gemma4", "gemma4_text", "deepseek_v4")

_FAMILIES: dict[str, Family] = {}


def families() -> dict[str, Family]:
    """Every family by ``model_type``, in :data:`NAMES` order (their modules imported on
    first use, so that importing a block or the config imports no family)."""
    if not _FAMILIES:
        for n in NAMES:
            _FAMILIES[n] = import_module(f"{__name__}.{n}").FAMILY
    return _FAMILIES


def family(model_type, where: str) -> Family:
    """The family of a ``model_type``; UsageError naming ``where``, listing the supported."""
    fams = families()
    if model_type not in fams:
        raise UsageError(f"{where}: model_type {model_type!r} is not supported; "
                         f"expected one of {', '.join(fams)}")
    return fams[model_type]


def gguf_family(meta: GGUFMeta) -> Family:
    """The family of a GGUF file by its ``general.architecture``; where llama.cpp stores
    several families under one (``deepseek2``: DeepSeek-V3, Kimi K2, GLM-4.7-Flash), the one
    whose :attr:`~.base.Family.gguf_pre` holds the file's ``tokenizer.ggml.pre`` (their
    layers read alike; the vocabulary is what differs). UsageError (one line) for an
    unknown architecture, or a vocabulary that no family or more than one claims."""
    arch, where = meta.arch, meta.where
    fams = [f for f in families().values() if f.gguf_arch]
    known = list(dict.fromkeys(f.gguf_arch for f in fams))
    if arch not in known:
        raise UsageError(f"{where}: general.architecture {arch!r} is not supported; "
                         f"expected one of {', '.join(known)}")
    cands: list = []  # one per mapping (qwen3_5_text is qwen3_5's family under its name)
    for f in fams:
        if f.gguf_arch == arch and all(c.from_gguf is not f.from_gguf for c in cands):
            cands.append(f)
    if len(cands) == 1:
        return cands[0]
    pre = meta.field("tokenizer.ggml.pre")
    claimed = [f for f in cands if pre in f.gguf_pre]
    if len(claimed) != 1:
        raise UsageError(f"{where}: tokenizer.ggml.pre {pre!r}: cannot tell which of "
                         f"{', '.join(f.model_type for f in cands)} this {arch!r} file is "
                         "(llama.cpp stores them under one architecture; their vocabularies "
                         "tell them apart: "
                         + "; ".join(f"{', '.join(map(repr, f.gguf_pre))} {f.model_type}"
                                     for f in cands if f.gguf_pre) + ")")
    return claimed[0]


def of(cfg: ModelConfig) -> Family:
    """The family of a :class:`~hpcmac.llm.model.config.ModelConfig`."""
    return families()[cfg.arch]


# -- the configuration ---------------------------------------------------------------

def config_from_hf(raw: dict, where: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from the dict of a Hugging Face ``config.json``
    by its family's mapping (checked: :meth:`ModelConfig.check`)."""
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    fam = family(raw.get("model_type"), where)
    check_quantization(raw, fam, where)
    try:
        cfg = fam.from_hf(raw, where)
        if cfg.n_heads % cfg.n_kv_heads:
            raise UsageError(f"{where}: num_attention_heads {cfg.n_heads} is not a multiple of "
                             f"num_key_value_heads {cfg.n_kv_heads}")
        return cfg.check(where)
    except (TypeError, ValueError, AttributeError, ArithmeticError) as exc:
        raise UsageError(f"{where}: a field has the wrong type or value ({exc})") from None


#: quantization methods of Hugging Face folders that no family reads yet, and what to do
_NOT_READ = {
    "fp8": "FP8 e4m3 with block scales is read for the families with FP8 releases "
           "(DeepSeek V3.x and V3.2, Kimi K2, GLM-4.x, MiniMax M2, Qwen3, Qwen3-Next, "
           "Qwen3.5)",
    "compressed-tensors": "compressed-tensors pack-quantized INT4 is read for the Kimi K2 "
                          "line (K2 Thinking, K2.5)",
}


def check_quantization(raw: dict, fam: Family, where: str) -> None:
    """One line, before any weights load, unless the folder's quantization is one that
    its family's loader reads: a ``quantization_config.quant_method`` the family lists in
    :attr:`~.base.Family.quant_methods`, or MLX's affine ``quantization`` (bits, group)."""
    from hpcmac.llm.model.quant import check_format

    for key in ("quantization_config", "quantization"):
        q = raw.get(key)
        if q is None:
            continue
        if not isinstance(q, dict):
            raise UsageError(f"{where}: {key}: expected a JSON object, found "
                             f"{type(q).__name__}")
        method = q.get("quant_method")
        if method is not None:
            if method not in fam.quant_methods:
                why = _NOT_READ.get(method, "not a format hpcmac reads")
                known = ", ".join(repr(m) for m in fam.quant_methods)
                raise UsageError(f"{where}: {key}.quant_method {method!r} is not supported "
                                 f"for {fam.model_type} ({why}); expected "
                                 + (f"one of {known}, " if known else "")
                                 + "MLX's 'quantization' (bits, group_size) or a float "
                                   "checkpoint")
            if method == "fp8":
                check_fp8(q, f"{where}: {key}")
            elif method == "compressed-tensors":
                compressed_format(q, f"{where}: {key}")
        elif "bits" in q or "group_size" in q or "mode" in q:  # MLX's own
            check_format(f"{where}: {key}", q.get("bits"), q.get("group_size"),
                         q.get("mode", "affine"))


def check_fp8(q: dict, where: str) -> None:
    """One line unless an ``fp8`` quantization_config is the releases' form: ``fmt``
    e4m3 and square ``weight_block_size`` blocks of a multiple of 32 (128 x 128)."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UsageError(f"{where}.fmt {fmt!r} is not supported; expected 'e4m3'")
    b = q.get("weight_block_size")
    if not (isinstance(b, list) and len(b) == 2 and b[0] == b[1] and isinstance(b[0], int)
            and not isinstance(b[0], bool) and b[0] > 0 and b[0] % 32 == 0):
        raise UsageError(f"{where}.weight_block_size {b!r}: expected [b, b] with b a "
                         "multiple of 32 ([128, 128] in the releases; per-tensor FP8 is "
                         "not read)")


def compressed_format(q: dict, where: str) -> tuple[int, int]:
    """(bits, group_size) of a compressed-tensors ``pack-quantized`` config whose weights
    are what Kimi K2 Thinking ships: symmetric integers of 4 (or 8) bits, one scale per
    group of 32, 64 or 128 inputs, no activation quantization; one line otherwise."""
    from hpcmac.llm.model.quant import GROUPS

    if q.get("format") != "pack-quantized":
        raise UsageError(f"{where}.format {q.get('format')!r} is not supported; expected "
                         "'pack-quantized'")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UsageError(f"{where}.config_groups: expected an object of quantization groups")
    found = set()
    for name, grp in groups.items():
        at = f"{where}.config_groups.{name}"
        w = grp.get("weights") if isinstance(grp, dict) else None
        if not isinstance(w, dict):
            raise UsageError(f"{at}.weights: expected an object")
        want = {"type": "int", "symmetric": True, "strategy": "group"}
        for k, v in want.items():
            if w.get(k) != v:
                raise UsageError(f"{at}.weights.{k} {w.get(k)!r} is not supported; expected "
                                 f"{v!r}")
        if w.get("num_bits") not in (4, 8) or w.get("group_size") not in GROUPS or \
                w.get("actorder") not in (None, False):
            raise UsageError(f"{at}.weights: num_bits {w.get('num_bits')!r}, group_size "
                             f"{w.get('group_size')!r}, actorder {w.get('actorder')!r}: "
                             f"expected 4 or 8 bits, groups of {', '.join(map(str, GROUPS))}, "
                             "no actorder")
        if grp.get("input_activations") is not None:
            raise UsageError(f"{at}.input_activations: quantized activations are not "
                             "supported (weights only)")
        found.add((w["num_bits"], w["group_size"]))
    if len(found) != 1:
        raise UsageError(f"{where}.config_groups: groups of different formats {sorted(found)} "
                         "are not supported")
    return found.pop()


def config_from_gguf(meta: GGUFMeta) -> ModelConfig:
    """Build a :class:`ModelConfig` from GGUF metadata by its family's mapping (checked:
    :meth:`ModelConfig.check`, and block_count against the layers the tensors hold)."""
    try:
        fam = gguf_family(meta)
        cfg = fam.from_gguf(meta)
    except (TypeError, ValueError, AttributeError, ArithmeticError, KeyError) as exc:
        raise UsageError(f"{meta.where}: a metadata field has the wrong type or value "
                         f"({type(exc).__name__}: {exc})") from None
    return cfg.check(meta.where, max_layers=meta.n_blocks())


# -- the tensors ------------------------------------------------------------------

def layer(cfg: ModelConfig, i: int):
    """The :class:`~hpcmac.llm.model.arch.blocks.Layer` of global layer ``i``."""
    return of(cfg).layer(cfg, i)


def layer_tensors(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    """The tensors of global layer ``i`` (routed experts as one (E, out, in) stack each),
    as its family's blocks describe them (with the layer's own config, ``cfg.at(i)``)."""
    return layer(cfg, i).tensors(cfg.at(i), i)


def stage_tensors(cfg: ModelConfig, start: int, end: int, first: bool,
                  last: bool) -> list[TensorSpec]:
    """Every tensor a stage of layers ``[start, end)`` loads (the embedding once)."""
    from hpcmac.llm.model.spec import embed_spec, head_tensors

    out: list[TensorSpec] = []
    if first or (last and cfg.tie_embeddings):
        out.append(embed_spec(cfg))
    for i in range(start, end):
        out += layer_tensors(cfg, i)
    if last:
        out += head_tensors(cfg)
    return out


def gguf_names(cfg: ModelConfig) -> dict[str, str]:
    """Canonical name -> GGUF name of every tensor of the model (those with a GGUF form)."""
    return {t.name: t.gguf for t in stage_tensors(cfg, 0, cfg.n_layers, True, True) if t.gguf}


def gguf_forms(cfg: ModelConfig) -> dict[str, tuple]:
    """Canonical name -> :attr:`~hpcmac.llm.model.spec.TensorSpec.gguf_form` of every tensor
    a GGUF file stores in another layout (gpt-oss's experts: gate and up split, (out, in))."""
    return {t.name: t.gguf_form for t in stage_tensors(cfg, 0, cfg.n_layers, True, True)
            if t.gguf_form}
