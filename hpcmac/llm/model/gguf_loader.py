"""GGUF files: configuration from metadata, tensors dequantized to float32 on request.

Tensors are addressed by their canonical (Hugging Face) names and translated
to GGUF names here. The header is read by hpcmac.plan.gguf_header and the file
memory-mapped (:class:`GGUFFile`); only the tensors asked for are dequantized.
Llama-architecture Q/K rows, which the converter permutes for its rotary layout,
are un-permuted back.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from struct import error as struct_error

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.config import ModelConfig

#: GGUF general.architecture -> Hugging Face model_type
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
              "deepseek2": "deepseek_v3"}

#: tensor types dequantized here (via gguf.quants)
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q4_K", "Q5_K", "Q6_K")

#: bits of the GGUF types kept quantized (see gguf_quant)
_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}
#: bytes of scale and bias per 32 weights as the numpy backend holds them: the float16
#: ``d`` alone for the symmetric types (bias derived), ``d`` and ``m`` for Q4_1/Q5_1,
#: float32 for the K types (``d * sc`` needs up to 17 significant bits)
_GROUP_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q5_0": 2, "Q4_1": 4, "Q5_1": 4, "Q4_K": 8, "Q5_K": 8}

_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GLOBAL_MAP = {"model.embed_tokens.weight": "token_embd.weight",
               "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")

#: opened readers by (path, size, mtime): parsing a file's metadata (a tokenizer's
#: vocabulary and merges are ~150k fields) takes seconds, and one run opens the
#: same file for its plan, its stage and its tokenizer
_READERS: dict[tuple[str, int, int], object] = {}
_READERS_MAX = 2


def forget_readers() -> None:
    """Drop the opened readers (see ``_READERS``): their parsed metadata is Python objects
    for every vocabulary entry and merge (measured: ~25 MB of resident memory for the
    bench's 32000-token vocabulary, ~12 MB for SmolLM2's 49152 tokens and merges), held
    for nothing once a run has its tokenizer and its stage. ``generate`` and
    ``serve`` call this after loading; a later open parses the file again. The readers'
    objects form reference cycles: collected here, and the freed heap handed back."""
    import gc

    from hpcmac.llm.model.backend import release_freed_memory

    _READERS.clear()
    gc.collect()
    release_freed_memory()


def check_gguf(path: str | Path, head=None) -> None:
    """UsageError (one line) unless ``path`` is a regular file whose GGUF header holds
    together: every count and length within the file (read by hpcmac's own bounded reader,
    hpcmac.plan.gguf_header), at most 4 dimensions per tensor, and every tensor's data
    inside the file at its alignment. ``head``: the header, when already read."""
    import stat

    from hpcmac.plan.gguf_header import GGML_TYPES, read_header

    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path}: expected a regular GGUF file")
    if head is None:
        head = read_header(path)
    align = head.fields.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or not 1 <= align <= 1 << 20 \
            or align & (align - 1):
        raise UsageError(f"{path}: general.alignment {align!r}: expected a power of two")
    start = -(-head.size // align) * align
    for t in head.tensors.values():
        _, size, block = GGML_TYPES[t.ggml_type]
        n = t.numel
        if any(d < 1 for d in t.shape) or n >= 1 << 48 or n % block:
            raise UsageError(f"{path}: tensor {t.name}: shape {t.shape} is not whole "
                             f"blocks of {block} elements")
        end = start + t.offset + n // block * size
        if t.offset % align or end > st.st_size:
            raise UsageError(f"{path}: tensor {t.name}: data at offset {t.offset} "
                             f"({n // block * size} bytes) is not inside the file "
                             f"({st.st_size} bytes) at alignment {align}: truncated or not "
                             "GGUF")


class _Field:
    """One metadata value, read the way ``gguf.ReaderField`` is used here (``contents()``,
    ``data`` for an array's entries)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value

    @property
    def data(self):
        return self.value


#: ggml types whose tensors are typed arrays; every other type is a byte array whose
#: last axis is the row's bytes (as ``gguf.GGUFReader`` gives them)
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFTensor:
    """One tensor of a :class:`GGUFFile`: ``name``, ``type_name`` (e.g. ``"Q4_1"``),
    ``ggml_type``, ``shape`` (GGUF order, fastest axis first), ``n_bytes``,
    ``data_offset`` (in the file) and ``data`` (a view into the mapping)."""

    __slots__ = ("name", "ggml_type", "type_name", "shape", "n_bytes", "data_offset", "_file")

    def __init__(self, name, ggml_type, type_name, shape, n_bytes, data_offset, file):
        self.name, self.ggml_type, self.type_name = name, ggml_type, type_name
        self.shape, self.n_bytes, self.data_offset = shape, n_bytes, data_offset
        self._file = file

    @property
    def data(self) -> np.ndarray:
        from hpcmac.plan.gguf_header import GGML_TYPES

        _, size, block = GGML_TYPES[self.ggml_type]
        dims = tuple(reversed(self.shape))
        raw = self._file.data[self.data_offset:self.data_offset + self.n_bytes]
        if self.type_name in _TYPED:
            return raw.view(_TYPED[self.type_name]).reshape(dims)
        return raw.reshape(dims[:-1] + (dims[-1] // block * size,))


class GGUFFile:
    """A GGUF file read by hpcmac: its header parsed once by hpcmac.plan.gguf_header
    (every array decoded), its data memory-mapped read-only. ``fields`` maps each
    metadata key to a field (``contents()``); ``tensors`` lists :class:`GGUFTensor`.

    The ``gguf`` package's reader builds numpy views for each of a tokenizer's ~100k
    strings (1.2 s for SmolLM2's file); this reads the same header in ~0.05 s."""

    def __init__(self, path: Path):
        from hpcmac.plan.gguf_header import GGML_TYPES, read_header

        head = read_header(path, keep_arrays=True)
        check_gguf(path, head)
        self.data = np.memmap(path, mode="r")
        self.fields = {k: _Field(v) for k, v in head.fields.items()}
        align = head.fields.get("general.alignment", 32)
        self.data_offset = -(-head.size // align) * align
        self.tensors = [GGUFTensor(t.name, t.ggml_type, GGML_TYPES[t.ggml_type][0], t.shape,
                                   t.nbytes, self.data_offset + t.offset, self)
                        for t in head.tensors.values()]


def gguf_reader(path: str | Path) -> GGUFFile:
    """The :class:`GGUFFile` of ``path`` (read-only, memory-mapped), opened once per file
    version.

    A file rewritten in place (new size or mtime) is opened again. Raises
    :class:`UsageError` with one line when the file is not readable GGUF.
    """
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    reader = _READERS.get(key)
    if reader is None:
        try:
            reader = GGUFFile(path)
        except UsageError:
            raise
        except (ValueError, OSError, UnicodeError, struct_error) as exc:
            raise UsageError(f"{path}: not a readable GGUF file "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") from None
        while len(_READERS) >= _READERS_MAX:
            _READERS.pop(next(iter(_READERS)))
        _READERS[key] = reader
    return reader


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a canonical name (None when it has no GGUF equivalent)."""
    if name in _GLOBAL_MAP:
        return _GLOBAL_MAP[name]
    m = _LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"blk.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the rotary row permutation llama.cpp's converter applies to Llama Q/K."""
    d = w.shape[0]
    return w.reshape(n_head, d // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file (single-file models)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.reader = gguf_reader(self.path)
        size = self.path.stat().st_size
        self._tensors = {}
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise UsageError(f"{self.path}: truncated: tensor {t.name} ends past the file end")
            self._tensors[t.name] = t
        self._arch_gguf = self._field("general.architecture")
        self._cfg: ModelConfig | None = None

    # -- metadata ------------------------------------------------------------
    def _field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        if f is None:
            return default
        return f.contents()

    def _meta(self, key: str, default=None):
        return self._field(f"{self._arch_gguf}.{key}", default)

    def _need(self, key: str):
        v = self._meta(key)
        if v is None:
            raise UsageError(f"{self.path}: metadata {self._arch_gguf}.{key} is missing")
        return v

    def config(self) -> ModelConfig:
        """Model configuration from the GGUF metadata (checked: ModelConfig.check, and
        block_count against the layers the tensors hold)."""
        if self._cfg is not None:
            return self._cfg
        try:
            cfg = self._config()
        except (TypeError, ValueError, AttributeError, ArithmeticError, KeyError) as exc:
            raise UsageError(f"{self.path}: a metadata field has the wrong type or value "
                             f"({type(exc).__name__}: {exc})") from None
        blocks = {int(n.split(".")[1]) for n in self._tensors
                  if n.startswith("blk.") and n.split(".")[1].isdigit()}
        self._cfg = cfg.check(str(self.path), max_layers=len(blocks))
        return self._cfg

    def _config(self) -> ModelConfig:
        arch = GGUF_ARCHS.get(self._arch_gguf)
        if arch is None:
            raise UsageError(f"{self.path}: general.architecture {self._arch_gguf!r} is not "
                             f"supported; expected one of {', '.join(GGUF_ARCHS)}")
        n_heads = int(self._need("attention.head_count"))
        n_kv = self._meta("attention.head_count_kv", n_heads)
        if isinstance(n_kv, list):
            n_kv = n_kv[0]
        hidden = int(self._need("embedding_length"))
        vocab = self._meta("vocab_size")
        if vocab is None:
            vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data) \
                if "tokenizer.ggml.tokens" in self.reader.fields \
                else int(self._tensors["token_embd.weight"].shape[1])
        head_dim = int(self._meta("attention.key_length", hidden // n_heads))
        scaling: dict = {"rope_type": "default"}
        stype = self._meta("rope.scaling.type")
        if stype and stype != "none":
            scaling = {"rope_type": stype, "factor": float(self._meta("rope.scaling.factor", 1.0))}
            orig = self._meta("rope.scaling.original_context_length")
            if orig:
                scaling["original_max_position_embeddings"] = int(orig)
            if stype == "yarn":
                mscale = self._meta("rope.scaling.yarn_log_multiplier")
                if mscale:
                    scaling["mscale"] = scaling["mscale_all_dim"] = float(mscale) / 0.1
        eos = self._field("tokenizer.ggml.eos_token_id")
        cfg = ModelConfig(
            arch=arch,
            n_layers=int(self._need("block_count")),
            hidden=hidden,
            vocab=int(vocab),
            n_heads=n_heads,
            n_kv_heads=int(n_kv),
            head_dim=head_dim,
            intermediate=int(self._meta("feed_forward_length", 0) or 0),
            norm_eps=float(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._meta("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position=int(self._meta("context_length", 4096)),
            tie_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            o_bias="blk.0.attn_output.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            n_experts=int(self._meta("expert_count", 0) or 0),
            n_experts_per_tok=int(self._meta("expert_used_count", 0) or 0),
            moe_intermediate=int(self._meta("expert_feed_forward_length", 0) or 0),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [int(eos)],
        )
        if arch == "qwen3_moe":
            cfg.norm_topk_prob = True  # Qwen3-MoE checkpoints all normalise
        if arch == "deepseek_v3":
            cfg.q_lora_rank = int(self._meta("attention.q_lora_rank", 0)) or None
            cfg.kv_lora_rank = int(self._need("attention.kv_lora_rank"))
            cfg.qk_rope_head_dim = int(self._need("rope.dimension_count"))
            # newer converters write the absorbed (MQA) lengths as key/value_length
            # and the per-head ones as key/value_length_mla
            head_dim = int(self._meta("attention.key_length_mla", head_dim))
            cfg.head_dim = head_dim
            cfg.qk_nope_head_dim = head_dim - cfg.qk_rope_head_dim
            cfg.v_head_dim = int(self._meta("attention.value_length_mla", 0)
                                 or self._need("attention.value_length"))
            cfg.n_kv_heads = n_heads
            cfg.n_shared_experts = int(self._meta("expert_shared_count", 0) or 0)
            cfg.first_k_dense = int(self._meta("leading_dense_block_count", 0) or 0)
            cfg.routed_scaling_factor = float(self._meta("expert_weights_scale", 1.0))
            cfg.norm_topk_prob = bool(self._meta("expert_weights_norm", False))
            cfg.n_group = int(self._meta("expert_group_count", 1) or 1)
            cfg.topk_group = int(self._meta("expert_group_used_count", 1) or 1)
            cfg.rope_interleave = True
        return cfg

    # -- tensors -------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        g = gguf_name(name)
        return g is not None and g in self._tensors

    def _tensor(self, name: str, gname: str | None = None):
        g = gname or gguf_name(name)
        if g is None or g not in self._tensors:
            raise UsageError(f"{self.path}: tensor {g or name} is missing")
        return self._tensors[g]

    def shape(self, name: str) -> tuple[int, ...]:
        if name.endswith("self_attn.kv_b_proj.weight") and gguf_name(name) not in self._tensors:
            return self.shape_of_kv_b(name)
        return tuple(int(s) for s in reversed(self._tensor(name).shape))

    def numel(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64))

    def release(self) -> None:
        """Forget the file's pages read so far (the reader stays usable)."""
        from hpcmac.llm.model.weights import release_mapped

        release_mapped(self.reader.data)

    def stored_nbytes(self, name: str) -> int:
        """Bytes ``name`` takes in memory as :meth:`get_weight` returns it."""
        from hpcmac.llm.model.gguf_quant import EXACT
        from hpcmac.llm.model.quant import held_nbytes

        g = gguf_name(name)
        if g in self._tensors and self._tensors[g].type_name in EXACT:
            t = self._tensors[g]
            return held_nbytes(self.numel(name), _BITS[t.type_name], 32,
                               _GROUP_BYTES[t.type_name])
        return 4 * self.numel(name)

    def experts_nbytes(self, layer: int) -> int | None:
        """Bytes of one layer's routed experts as held (None: not all kept quantized)."""
        from hpcmac.llm.model.gguf_quant import EXACT
        from hpcmac.llm.model.quant import held_nbytes

        total = 0
        for which in ("gate", "up", "down"):
            t = self._tensors.get(f"blk.{layer}.ffn_{which}_exps.weight")
            if t is None or t.type_name not in EXACT:
                return None
            total += held_nbytes(int(np.prod(t.shape)), _BITS[t.type_name], 32,
                                 _GROUP_BYTES[t.type_name])
        return total

    def _keep(self, t, shape: tuple[int, ...]):
        """A tensor as kept in memory: a QuantTensor for the exact types, else float32."""
        from hpcmac.llm.model.gguf_quant import to_quant

        qt = to_quant(t.data, t.type_name, shape)
        if qt is None:
            return self._dequant(t)
        return qt

    def get_weight(self, name: str):
        """The tensor as stored: a QuantTensor for the exact GGUF types, else float32."""
        if name.endswith("self_attn.kv_b_proj.weight") and gguf_name(name) not in self._tensors:
            return self._kv_b_from_split(name)
        t = self._tensor(name)
        w = self._keep(t, self.shape(name))
        if self._arch_gguf == "llama" and (name.endswith("self_attn.q_proj.weight")
                                           or name.endswith("self_attn.k_proj.weight")):
            cfg = self.config()
            heads = cfg.n_heads if name.endswith("q_proj.weight") else cfg.n_kv_heads
            d = w.shape[0]
            perm = np.arange(d).reshape(heads, d // heads // 2, 2).swapaxes(1, 2).reshape(-1)
            w = w[perm]  # the rotary un-permute is a row permutation: codes move as they are
        return w

    def _dequant(self, t) -> np.ndarray:
        from gguf import quants

        qtype = t.type_name
        if qtype not in SUPPORTED_QUANTS:
            raise UsageError(f"{self.path}: tensor {t.name} has type {qtype}; "
                             f"supported: {', '.join(SUPPORTED_QUANTS)}")
        shape = tuple(int(s) for s in reversed(t.shape))
        from gguf import GGMLQuantizationType

        w = quants.dequantize(t.data, GGMLQuantizationType(t.ggml_type))
        return np.ascontiguousarray(w, dtype=np.float32).reshape(shape)

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32 in Hugging Face layout (out, in)."""
        if name.endswith("self_attn.kv_b_proj.weight") and gguf_name(name) not in self._tensors:
            return self._kv_b_from_split(name)
        w = self._dequant(self._tensor(name))
        if self._arch_gguf == "llama":
            cfg = self.config()
            if name.endswith("self_attn.q_proj.weight"):
                w = unpermute_rows(w, cfg.n_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                w = unpermute_rows(w, cfg.n_kv_heads)
        return w

    def _kv_b_from_split(self, name: str) -> np.ndarray:
        """kv_b_proj (H*(nope+v), r) rebuilt from attn_k_b (H, r, nope) and attn_v_b (H, v, r)."""
        base = gguf_name(name)[:-len("attn_kv_b.weight")]
        k_b = self._dequant(self._tensor(name, base + "attn_k_b.weight"))
        v_b = self._dequant(self._tensor(name, base + "attn_v_b.weight"))
        kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # (H, nope+v, r)
        return np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))

    def shape_of_kv_b(self, name: str) -> tuple[int, ...]:
        cfg = self.config()
        return (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)

    def experts(self, layer: int, which: str, keep_quant: bool = False):
        """Routed expert weights of one layer, (E, out, in) (``keep_quant``: as stored)."""
        t = self._tensor("", f"blk.{layer}.ffn_{which}_exps.weight")
        if keep_quant:
            return self._keep(t, tuple(int(s) for s in reversed(t.shape)))
        return self._dequant(t)
