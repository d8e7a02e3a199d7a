"""The configuration every family maps to, and the fields every family reads alike.

:class:`ModelConfig` is one dataclass for every architecture. A family's
``from_hf`` / ``from_gguf`` (``arch/<model_type>.py``) start from
:func:`hf_fields` / :func:`gguf_fields` (and the ``*_moe_fields``) and add their
own; :func:`hpcmac.llm.model.arch.config_from_hf` checks the result. Values
from ``config.json`` are strictly typed (:func:`json_int`: a size spelled
``"48"``, ``48.0`` or ``true`` is refused naming the field). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcmac.errors import UsageError

#: Most decoder layers a config may declare: the largest published decoders have under 200,
#: and planning walks every layer, so an absurd count (10^9) is refused before it starts.
MAX_LAYERS = 1 << 14

@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a decoder-only transformer (global)."""

    arch: str  # the family's model_type (hpcmac.llm.model.arch.NAMES)
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
    partial_rotary_factor: float = 1.0  # the share of each head rotated (GLM-4: 0.5)
    max_position: int = 4096
    tie_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2: always)
    o_bias: bool = False  # bias on o_proj (Llama attention_bias=True)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of Q and K
    sliding_window: int = 0  # keys a sliding-window layer's query sees (itself included)
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" / "full_attention"
    # mixture of experts (Qwen3-MoE, DeepSeek-V3)
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    n_shared_experts: int = 0
    shared_intermediate: int = 0  # the shared experts' width (0: n_shared * moe_intermediate)
    first_k_dense: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0  # gpt-oss's clamped SwiGLU in the experts (0: plain SwiGLU)
    swiglu_alpha: float = 1.702  # its sigmoid gain
    # multi-head latent attention (DeepSeek-V3)
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention; 0: none)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): layer_types "linear_attention"
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    linear_conv_kernel: int = 0
    norm_offset: float = 0.0  # added to every RMSNorm weight as stored (Qwen3-Next: 1 + w)
    # Gemma 4: what its layers add to the others'
    attention_scale: float = 0.0  # the attention logits' scale (0: 1/sqrt(head_dim))
    v_norm: bool = False  # RMSNorm without a weight on each head of V
    v_from_k: bool = False  # no v_proj: V is K's projection (before K's norm and rope)
    hidden_act: str = "silu"  # the dense MLP's gate activation: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # the embedding rows are multiplied by it (Gemma: sqrt(hidden))
    final_logit_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (0: none)
    #: per layer type (``layer_types``' names), the fields whose value differs there from
    #: the above (Gemma 4's full-attention layers: head_dim, n_kv_heads, v_from_k, rope):
    #: :meth:`at` gives a layer's config
    by_layer_type: dict[str, dict[str, Any]] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    #: a family's own hyper-parameters that no other family reads (DeepSeek-V4's)
    family: dict[str, Any] = field(default_factory=dict)
    #: residual streams per token between layers (DeepSeek-V4's hyper-connections: hc_mult)
    residual_streams: int = 1

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
                     "n_shared_experts", "first_k_dense", "sliding_window", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "shared_intermediate", "linear_k_heads", "linear_v_heads", "linear_k_dim",
                     "linear_v_dim", "linear_conv_kernel", "index_n_heads", "index_head_dim",
                     "index_topk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 1 << 31:
                raise UsageError(f"{where}: {name} = {v!r}: expected an integer from 0 to 2^31")
        for name in ("n_group", "topk_group", "decoder_sparse_step"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UsageError(f"{where}: {name} = {getattr(self, name)!r}: expected >= 1")
        for name in ("norm_eps", "rope_theta", "routed_scaling_factor", "partial_rotary_factor",
                     "swiglu_alpha"):
            v = getattr(self, name)
            if not isinstance(v, float) or not math.isfinite(v) or v <= 0:
                raise UsageError(f"{where}: {name} = {v!r}: expected a finite number > 0")
        f = self.partial_rotary_factor
        if f > 1 or (f < 1 and (self.rope_dim < 2 or self.rope_dim % 2)):
            raise UsageError(f"{where}: partial_rotary_factor {self.partial_rotary_factor} "
                             f"rotates {self.rope_dim} of {self.head_dim} dimensions per head; "
                             "expected an even number from 2 to head_dim")
        if not isinstance(self.swiglu_limit, float) or not self.swiglu_limit >= 0 or \
                not math.isfinite(self.swiglu_limit):
            raise UsageError(f"{where}: swiglu_limit = {self.swiglu_limit!r}: expected a finite "
                             "number >= 0")
        from hpcmac.llm.model.rope import ROPE_TYPES

        kind = self.rope_scaling.get("rope_type", "default")
        if kind not in ROPE_TYPES:  # refused here, before any weight is read
            raise UsageError(f"{where}: rope_type {kind!r} is not supported; "
                             f"expected one of {', '.join(ROPE_TYPES)}")
        if self.n_experts_per_tok > self.n_experts:
            raise UsageError(f"{where}: {self.n_experts_per_tok} experts per token of "
                             f"{self.n_experts}")
        if self.n_layers > MAX_LAYERS:
            raise UsageError(f"{where}: n_layers = {self.n_layers}: expected at most "
                             f"{MAX_LAYERS} layers")
        if max_layers is not None and self.n_layers > max_layers:
            raise UsageError(f"{where}: {self.n_layers} layers declared, the checkpoint's "
                             f"tensors hold {max_layers}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UsageError(f"{where}: hidden_act {self.hidden_act!r} is not supported; "
                             "expected 'silu' or 'gelu_tanh'")
        for name in ("attention_scale", "final_logit_softcap"):
            v = getattr(self, name)
            if not isinstance(v, float) or not math.isfinite(v) or v < 0:
                raise UsageError(f"{where}: {name} = {v!r}: expected a finite number >= 0")
        for kind, over in self.by_layer_type.items():
            from dataclasses import replace

            if self.n_heads % over.get("n_kv_heads", self.n_kv_heads):
                raise UsageError(f"{where}: the {kind} layers' {over['n_kv_heads']} KV heads "
                                 f"do not divide the {self.n_heads} query heads")
            replace(self, **over, by_layer_type={}).check(f"{where} ({kind} layers)")
        return self

    def at(self, i: int) -> ModelConfig:
        """The config global layer ``i``'s blocks see: this one, with the fields
        :attr:`by_layer_type` sets for its layer type (the same object when none)."""
        over = self.by_layer_type.get(self.layer_types[i]) if self.by_layer_type else None
        if not over:
            return self
        cache = self.__dict__.setdefault("_at", {})
        key = self.layer_types[i]
        if key not in cache:
            from dataclasses import replace

            cache[key] = replace(self, **over, by_layer_type={})
        return cache[key]

    @property
    def residual_width(self) -> int:
        """Floats per token a pipeline stage hands the next: the hidden size times the
        residual streams (DeepSeek-V4 keeps ``hc_mult`` of them)."""
        return self.hidden * self.residual_streams

    @property
    def shared_width(self) -> int:
        """The shared experts' summed intermediate width."""
        return self.shared_intermediate or self.moe_intermediate * self.n_shared_experts

    def is_linear(self, i: int) -> bool:
        """Whether global layer ``i`` is a linear-attention (Gated DeltaNet) layer."""
        return bool(self.layer_types) and self.layer_types[i] == "linear_attention"

    def is_sliding(self, i: int) -> bool:
        """Whether global layer ``i`` attends within ``sliding_window`` only."""
        return bool(self.sliding_window) and bool(self.layer_types) and \
            self.layer_types[i] == "sliding_attention"

    def is_moe_layer(self, i: int) -> bool:
        """Whether global layer ``i`` uses routed experts instead of a dense MLP: past the
        ``first_k_dense`` layers, not in ``mlp_only_layers``, every ``decoder_sparse_step``-th."""
        if self.n_experts <= 0 or i < self.first_k_dense or i in self.mlp_only_layers:
            return False
        return (i + 1) % self.decoder_sparse_step == 0

    @property
    def rope_dim(self) -> int:
        """Number of rotated dimensions per head (the first ones: partial rotary)."""
        if self.mla:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)


def json_int(raw: dict, key: str, where: str, default: int | None = None) -> int:
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


def json_float(raw: dict, key: str, where: str, default: float) -> float:
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
    theta = json_float(params, "rope_theta", where, json_float(raw, "rope_theta", where, 10000.0))
    scaling = {k: v for k, v in {**legacy, **params}.items() if k != "rope_theta"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    scaling["rope_type"] = rope_type
    return theta, scaling


def hf_fields(raw: dict, where: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every family reads the same way from ``config.json``
    (``arch`` included; sizes strictly typed: :func:`json_int`); a family adds or overrides its
    own."""
    hidden = json_int(raw, "hidden_size", where)
    n_heads = json_int(raw, "num_attention_heads", where)
    if n_heads < 1:
        raise UsageError(f"{where}: field 'num_attention_heads' = {n_heads}: expected >= 1")
    theta, scaling = _rope(raw, where)
    eos = raw.get("eos_token_id")
    eos_ids = [json_int({"eos_token_id": e}, "eos_token_id", where)
               for e in ([] if eos is None else eos if isinstance(eos, list) else [eos])]
    bos = raw.get("bos_token_id")
    return dict(
        arch=raw.get("model_type"),
        n_layers=json_int(raw, "num_hidden_layers", where),
        hidden=hidden,
        vocab=json_int(raw, "vocab_size", where),
        n_heads=n_heads,
        n_kv_heads=json_int(raw, "num_key_value_heads", where, 0) or n_heads,
        head_dim=json_int(raw, "head_dim", where, 0) or hidden // n_heads,
        intermediate=json_int(raw, "intermediate_size", where, 0),
        norm_eps=json_float(raw, "rms_norm_eps", where, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position=json_int(raw, "max_position_embeddings", where, 4096),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=None if bos is None else json_int(raw, "bos_token_id", where),
        eos_token_ids=eos_ids,
    )


def hf_moe_fields(raw: dict, where: str) -> dict[str, Any]:
    """Routed experts from ``config.json`` (the names Qwen3-MoE, DeepSeek and Mixtral use:
    the first of them present)."""
    experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts")
               if raw.get(k) is not None]
    return dict(n_experts=json_int(raw, experts[0], where) if experts else 0,
                n_experts_per_tok=json_int(raw, "num_experts_per_tok", where, 0),
                moe_intermediate=json_int(raw, "moe_intermediate_size", where, 0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)))


class GGUFMeta:
    """A GGUF file's metadata and tensor names, as the family mappings read them.

    fields : metadata key -> plain value (an array: a list, or its length alone)
    tensors : GGUF tensor name -> an object with ``shape`` (GGUF order)
    where : the file, for messages
    """

    def __init__(self, fields: dict, tensors: dict, where: str):
        self.fields, self.tensors, self.where = fields, tensors, where
        self.arch = fields.get("general.architecture")

    def field(self, key: str, default=None):
        v = self.fields.get(key)
        return default if v is None else v

    def meta(self, key: str, default=None):
        """``<general.architecture>.<key>``."""
        return self.field(f"{self.arch}.{key}", default)

    def need(self, key: str):
        v = self.meta(key)
        if v is None:
            raise UsageError(f"{self.where}: metadata {self.arch}.{key} is missing")
        return v

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def n_blocks(self) -> int:
        """The layers the tensors hold (``blk.N.*``)."""
        return len({n.split(".")[1] for n in self.tensors
                    if n.startswith("blk.") and n.split(".")[1].isdigit()})


def gguf_fields(meta: GGUFMeta, arch: str) -> dict[str, Any]:
    """The :class:`ModelConfig` fields every family reads the same way from GGUF metadata."""
    n_heads = int(meta.need("attention.head_count"))
    n_kv = meta.meta("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        n_kv = n_kv[0]
    hidden = int(meta.need("embedding_length"))
    vocab = meta.meta("vocab_size")
    if vocab is None:
        tokens = meta.field("tokenizer.ggml.tokens")
        if tokens is not None:  # a list, or its length (an int) when not decoded
            vocab = tokens if isinstance(tokens, int) else len(tokens)
        else:
            vocab = int(meta.tensors["token_embd.weight"].shape[1])
    head_dim = int(meta.meta("attention.key_length", hidden // n_heads))
    scaling: dict = {"rope_type": "default"}
    stype = meta.meta("rope.scaling.type")
    if stype and stype != "none":
        scaling = {"rope_type": stype, "factor": float(meta.meta("rope.scaling.factor", 1.0))}
        orig = meta.meta("rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        if stype == "yarn":
            mscale = meta.meta("rope.scaling.yarn_log_multiplier")
            if mscale:
                scaling["mscale"] = scaling["mscale_all_dim"] = float(mscale) / 0.1
    eos = meta.field("tokenizer.ggml.eos_token_id")
    return dict(
        arch=arch,
        n_layers=int(meta.need("block_count")),
        hidden=hidden,
        vocab=int(vocab),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        intermediate=int(meta.meta("feed_forward_length", 0) or 0),
        norm_eps=float(meta.meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta.meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position=int(meta.meta("context_length", 4096)),
        tie_embeddings=not meta.has_tensor("output.weight"),
        attention_bias=meta.has_tensor("blk.0.attn_q.bias"),
        o_bias=meta.has_tensor("blk.0.attn_output.bias"),
        qk_norm=meta.has_tensor("blk.0.attn_q_norm.weight"),
        bos_token_id=meta.field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [int(eos)],
    )


def gguf_moe_fields(meta: GGUFMeta) -> dict[str, Any]:
    """Routed experts from GGUF metadata."""
    return dict(n_experts=int(meta.meta("expert_count", 0) or 0),
                n_experts_per_tok=int(meta.meta("expert_used_count", 0) or 0),
                moe_intermediate=int(meta.meta("expert_feed_forward_length", 0) or 0))
