"""What a model costs per token: parameters per layer (all and active), bytes, KV cache.

Read from a checkpoint folder's ``config.json``, a ``config.json`` alone, or a
GGUF file's header (nothing past the tensor table is read: a file cut after
its header works). The configuration is parsed by ``hpcmac.llm``'s own
readers, so the planner sees exactly the model the decoder would run.
Pure apart from reading that one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpcmac.errors import UsageError
from hpcmac.plan.gguf_header import GGML_TYPES, Header, read_header


@dataclass(frozen=True)
class LayerCost:
    """Parameters of one layer: always read per token, and its routed experts."""

    dense: float          # attention, norms, router, shared experts, dense MLP
    expert: float         # one routed expert (0 for a dense layer)
    n_experts: int = 0
    k_active: int = 0


@dataclass(frozen=True)
class ModelShape:
    """The per-token cost of a decoder-only model (global)."""

    name: str
    arch: str
    layers: tuple[LayerCost, ...]
    hidden: int
    vocab: int
    n_heads: int
    n_kv_heads: int
    embed: float                    # parameters of the embedding (one row read per token)
    head: float                     # parameters of the output head (all read per token)
    kv_per_token_layer: int         # KV cache elements one token adds to one layer (average)
    #: per layer, (cache elements one token adds, fixed cache elements per sequence: a
    #: linear-attention layer's conv and recurrent states), as the decoder's cache holds them
    layer_cache: tuple[tuple[int, int], ...]
    bits: float                     # bits per weight in memory
    source_bits: str = "as stored"  # where ``bits`` came from
    tied: bool = False              # the head is the embedding (held once)
    #: bits per weight of the embedding and head where they differ from ``bits``: the
    #: loader keeps them in a checkpoint's bfloat16 (``hpcmac.llm.model.spec.BF16_KEPT``)
    edge_bits: float | None = None
    #: floats per token one pipeline stage hands the next (0: the hidden size;
    #: DeepSeek-V4's ``hc_mult`` residual streams: the config's ``residual_width``)
    residual: int = 0

    @property
    def link_width(self) -> int:
        """Floats per token on a pipeline hop."""
        return self.residual or self.hidden

    @property
    def table_bits(self) -> float:
        """Bits per weight of the embedding and the head in memory."""
        return self.bits if self.edge_bits is None else self.edge_bits

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def params(self) -> float:
        return sum(lc.dense + lc.expert * lc.n_experts for lc in self.layers) + self.embed \
            + (0.0 if self.tied else self.head)

    def active_params(self) -> float:
        """Parameters one token reads (routed experts: only the active ones)."""
        return sum(lc.dense + lc.expert * lc.k_active for lc in self.layers) + self.head

    def layer_bytes_read(self, i: int, batch: int = 1) -> float:
        """Bytes layer ``i`` streams for one step of ``batch`` sequences (decode)."""
        lc = self.layers[i]
        touched = 0.0
        if lc.n_experts:
            # experts hit by at least one of batch * k independent picks
            touched = lc.n_experts * (1.0 - (1.0 - lc.k_active / lc.n_experts) ** batch)
        return (lc.dense + lc.expert * touched) * self.bits / 8

    def cache_elements(self, lo: int, hi: int, batch: int, context: int) -> int:
        """Cache elements layers ``[lo, hi)`` hold for ``batch`` sequences of ``context``
        tokens (what decode reads of it each step, too)."""
        return sum(batch * (context * tok + fixed) for tok, fixed in self.layer_cache[lo:hi])

    def layer_bytes_held(self, i: int) -> float:
        lc = self.layers[i]
        return (lc.dense + lc.expert * lc.n_experts) * self.bits / 8

    def with_bits(self, bits: float, why: str, edge_bits: float | None = None) -> ModelShape:
        """Every weight at ``bits``, the embedding and head at ``edge_bits`` (None: too)."""
        from dataclasses import replace

        return replace(self, bits=bits, source_bits=why, edge_bits=edge_bits)


def layer_costs(cfg) -> tuple[LayerCost, ...]:
    """Parameter counts of every layer of a ``hpcmac.llm`` ModelConfig: its family's
    matrices (:func:`hpcmac.llm.model.arch.layer_tensors`; norms and biases, under 0.01%,
    left out), a routed expert as its three stacks' share of one expert."""
    from hpcmac.llm.model.arch import layer_tensors
    from hpcmac.llm.model.spec import is_routed

    out = []
    for i in range(cfg.n_layers):
        dense = expert = 0
        for t in layer_tensors(cfg, i):
            if t.kind == "vector":
                continue
            n = 1
            for s in t.shape:
                n *= s
            if is_routed(t):
                expert += n // t.shape[0]
            else:
                dense += n
        if expert:
            out.append(LayerCost(float(dense), float(expert), cfg.n_experts,
                                 cfg.n_experts_per_tok))
        else:
            out.append(LayerCost(float(dense), 0.0))
    return tuple(out)


def _kv_elements(cfg) -> int:
    """Cache elements one token adds to one layer, on average (as the decoder's cache
    holds them)."""
    from hpcmac.llm.model.cache import KVCache

    return KVCache.token_bytes(cfg) // 4


def _layer_cache(cfg) -> tuple[tuple[int, int], ...]:
    """Per layer, (elements per token, fixed elements per sequence) of the decoder's cache
    (:func:`hpcmac.llm.model.cache.layer_bytes`, float32)."""
    from hpcmac.llm.model import arch
    from hpcmac.llm.model.cache import layer_bytes

    out = []
    for i in range(cfg.n_layers):
        tok, fixed = layer_bytes(cfg.at(i), arch.layer(cfg, i))
        out.append((tok // 4, fixed // 4))
    return tuple(out)


def from_config(cfg, name: str, bits: float, source_bits: str,
                edge_bits: float | None = None) -> ModelShape:
    emb = float(cfg.vocab * cfg.hidden)
    return ModelShape(name=name, arch=cfg.arch, layers=layer_costs(cfg), hidden=cfg.hidden,
                      vocab=cfg.vocab, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                      embed=emb, head=emb, kv_per_token_layer=_kv_elements(cfg),
                      layer_cache=_layer_cache(cfg), bits=bits,
                      source_bits=source_bits, tied=bool(cfg.tie_embeddings),
                      edge_bits=edge_bits, residual=cfg.residual_width)


_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "float8_e4m3fn": 8}


def _hf_bits(raw: dict) -> tuple[float, str]:
    q = raw.get("quantization") or raw.get("quantization_config") or {}
    if isinstance(q, dict) and q.get("bits"):
        gs = int(q.get("group_size", 64) or 64)
        if q.get("mode") == "mxfp4":  # an E8M0 byte per group of 32, no bias (MLX)
            return float(q["bits"]) + 8.0 / gs, f"quantization mxfp4, groups of {gs}"
        # affine groups: a 16-bit scale and a 16-bit bias per group (MLX)
        return float(q["bits"]) + 32.0 / gs, f"quantization {q['bits']} bits, groups of {gs}"
    if isinstance(q, dict) and q.get("quant_method") == "compressed-tensors":
        # pack-quantized integers, held as MLX affine (a 16-bit scale and bias per group);
        # the Kimi releases quantize the routed experts, nearly all the weights
        groups = q.get("config_groups") or {}
        w = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
        bits, gs = int(w.get("num_bits", 4)), int(w.get("group_size", 32))
        return bits + 32.0 / gs, f"compressed-tensors int{bits}, groups of {gs}"
    if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
        # gpt-oss: the experts (nearly all the weights) MXFP4, an E8M0 byte per 32
        return 4.25, "mxfp4 experts"
    if isinstance(q, dict) and q.get("quant_method") == "fp8":
        # e4m3 codes, held with a float32 scale per row and block of inputs
        b = (q.get("weight_block_size") or [128])[0]
        return 8.0 + 32.0 / b, f"fp8 e4m3, blocks of {b}"
    dt = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return float(_DTYPE_BITS.get(dt, 16)), f"torch_dtype {dt}"


def _edge_bits(raw: dict) -> float | None:
    """Bits of the embedding and head as the loader holds them, where not ``_hf_bits``'s:
    a bfloat16 checkpoint's in their 16 bits (spec.BF16_KEPT), the releases quantized by
    ``quant_method`` (fp8, mxfp4, compressed-tensors: tables left in floats) in 16 if
    bfloat16, else widened to 32; MLX's quantized folders quantize them too (None)."""
    q = raw.get("quantization") or raw.get("quantization_config") or {}
    if isinstance(q, dict) and q.get("bits"):
        return None
    dt = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    if dt == "bfloat16":
        return 16.0
    return 32.0 if isinstance(q, dict) and q.get("quant_method") else None


def from_hf_json(path: Path, name: str) -> ModelShape:
    from hpcmac.io.inputs import parse_json, read_text
    from hpcmac.llm.model.config import config_from_hf

    raw = parse_json(read_text(path, "config"), str(path))  # bounded: no /dev/zero, no FIFO
    if not isinstance(raw, dict):
        raise UsageError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    cfg = config_from_hf(raw, str(path))
    bits, why = _hf_bits(raw)
    return from_config(cfg, name, bits, why, _edge_bits(raw))


def _gguf_config(header: Header):
    """The decoder's ModelConfig, by the decoder's own GGUF mapping, from the header alone."""
    from hpcmac.llm.model.config import GGUFMeta, config_from_gguf

    return config_from_gguf(GGUFMeta(dict(header.fields), header.tensors, str(header.path)))


def from_gguf(path: Path, name: str) -> ModelShape:
    header = read_header(path)
    cfg = _gguf_config(header)
    shape = from_config(cfg, name, 16.0, "")
    total_bits = sum(t.nbytes * 8 for t in header.tensors.values())
    total_n = sum(t.numel for t in header.tensors.values())
    bits = total_bits / max(1, total_n)
    types = sorted({t.ggml_type for t in header.tensors.values()})
    why = "GGUF " + "/".join(GGML_TYPES[t][0] for t in types)
    return shape.with_bits(bits, why)


def load_shape(model: str) -> ModelShape:
    """The shape of ``model``: a folder with config.json, a config.json, a GGUF file
    (its header), or a short name (``smollm2``)."""
    from hpcmac.llm.model.config import resolve_model

    path = resolve_model(model)
    name = path.name if path.name != "config.json" else path.parent.name
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.exists():
            raise UsageError(f"{path}: no config.json (give a model folder, a config.json or "
                             "a GGUF file)")
        return from_hf_json(cfg, name)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic == b"GGUF":
        return from_gguf(path, name)
    return from_hf_json(path, name)
