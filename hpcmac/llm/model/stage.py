"""A pipeline stage of the decoder: layers ``[start, end)`` of a checkpoint on one rank.

The whole model on one rank is the stage ``load_stage(path, 0, n_layers, first=True,
last=True)``. A stage loads only its own tensors (plus the embedding on the first
stage and the final norm and head on the last; a tied head loads the embedding
on the last stage). Nothing here communicates: part 2 moves the activations.

Packed batches: ``h`` is (T_total, hidden) for all new tokens of all sequences in
a step, sequence after sequence; :class:`Batch` says for each sequence its cache
slot, how many new tokens it has and the position of the first one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model import arch, spec
from hpcmac.llm.model.arch.base import Step
from hpcmac.llm.model.arch.blocks import norm_weight
from hpcmac.llm.model.backend import QWeight, get_backend, release_freed_memory
from hpcmac.llm.model.cache import KVCache
from hpcmac.llm.model.config import ModelConfig
from hpcmac.llm.model.qkernels import NQWeight
from hpcmac.llm.model.quant import (
    BF16,
    QuantTensor,
    as_float,
    mlx_held_nbytes,
    numpy_held_nbytes,
)
from hpcmac.llm.model.rope import cos_sin, rope_frequencies, softmax_scale
from hpcmac.llm.model.spec import Shard, TensorSpec
from hpcmac.llm.model.weights import open_checkpoint


@dataclass
class Batch:
    """One step over several sequences (local to the stage, same on every stage).

    slots : cache slot of each sequence
    lengths : number of new tokens of each sequence in this step (prefill: the
        prompt or a chunk of it; decode: 1)
    positions : position of each sequence's first new token (tokens already cached)
    """

    slots: list[int]
    lengths: list[int]
    positions: list[int]
    _seqs: list = field(default=None, repr=False)

    def __post_init__(self):
        if not (len(self.slots) == len(self.lengths) == len(self.positions)):
            raise ValueError("Batch: slots, lengths and positions must have the same length")

    @property
    def total(self) -> int:
        """T_total: rows of the packed activations."""
        return int(sum(self.lengths))

    def seqs(self) -> list[tuple[int, int, int, int]]:
        """(slot, row offset, n_new, start position) per sequence."""
        if self._seqs is None:
            offs = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(int)
            self._seqs = [(int(s), int(o), int(n), int(p)) for s, o, n, p in
                          zip(self.slots, offs, self.lengths, self.positions)]
        return self._seqs

    def token_positions(self) -> np.ndarray:
        """(T_total,) position of every packed token."""
        return np.concatenate([np.arange(p, p + n) for p, n in
                               zip(self.positions, self.lengths)]).astype(np.int64)


class Stage:
    """Layers ``[start, end)`` of a model, ready to run (see module docstring)."""

    def __init__(self, config: ModelConfig, start: int, end: int, first: bool, last: bool,
                 backend, layers: list[dict], extra: dict, nbytes: int,
                 shard: Shard | None = None,
                 reduce: Callable[[np.ndarray], np.ndarray] | None = None):
        self.config, self.start, self.end = config, start, end
        self.first, self.last = first, last
        self.backend = backend
        self.layers = layers
        self.extra = extra
        self.nbytes = nbytes
        self.shard = shard or spec.full_shard(config)
        self.reduce = reduce if self.shard.size > 1 else None
        #: the reduce takes and gives MLX arrays, in the graph (MLX backend only)
        self.in_graph = bool(getattr(self.reduce, "in_graph", False)) and backend.name == "mlx"
        self.local = spec.local_config(config, self.shard)
        #: each layer's blocks (its family's :class:`~hpcmac.llm.model.arch.blocks.Layer`)
        self._blocks = [arch.layer(config, i) for i in range(start, end)]
        # each layer's rope and logit scale: one per distinct layer config (Gemma 4's
        # sliding and full layers differ), the layers' index into them
        ropes: dict = {}
        self._rope_of = [ropes.setdefault(id(config.at(i)), (len(ropes), config.at(i)))[0]
                         for i in range(start, end)]
        self._ropes = [(*rope_frequencies(c), softmax_scale(c)) for _, c in ropes.values()]

    @property
    def vocab(self) -> tuple[int, int]:
        """The vocabulary rows ``[lo, hi)`` whose logits :meth:`logits` returns."""
        return self.shard.vocab

    def held(self, extra: bool = True) -> list:
        """Each object the stage's layers hold (and ``extra``: its embedding, final norm and
        head), once by identity, in order: the dicts, lists and tuples walked into (each
        once), None, bools, numbers and strings passed over; arrays, packed weights and
        the rest returned as they are (a tied head that is the embedding's own object
        appears once, a second copy twice)."""
        seen, out = set(), []

        def walk(v):
            if id(v) in seen or isinstance(v, (bool, int, float, str)) or v is None:
                return
            seen.add(id(v))
            if isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)
            else:
                out.append(v)

        walk(self.layers)
        if extra:
            walk(self.extra)
        return out

    def new_cache(self, max_slots: int, max_len: int) -> KVCache:
        """An empty KV cache of this stage's layers (this rank's KV heads)."""
        return KVCache(self.local, self.start, self.end, max_slots, max_len, self.backend,
                       self._blocks)

    def _sum(self, a):
        """The tensor group's sum of a partial result (itself on one rank): inside MLX's
        graph when the reduce callable is (``in_graph``: an MLX group's all_sum), else
        through numpy (one host sync on MLX: the bridge, for MPI transports)."""
        if self.reduce is None:
            return a
        be = self.backend
        if self.in_graph:
            return self.reduce(be.asarray(a))
        return be.asarray(self.reduce(np.ascontiguousarray(be.to_numpy(a), dtype=np.float32)))

    def embed(self, tokens):
        """(T_total,) int token ids -> (T_total, hidden) float32 [first stage].

        Under tensor parallelism each rank looks up the ids in its vocabulary
        rows and the group sums (collective over the tensor group). On the MLX
        backend the lookup is an MLX op, left in the graph (not evaluated), and
        ``tokens`` may be an MLX array (a step's greedy tokens, still on the device:
        they are in the vocabulary by construction, unchecked).
        """
        if "embed" not in self.extra:
            raise RuntimeError("embed() called on a stage without the embedding")
        be = self.backend
        device = be.name == "mlx" and isinstance(tokens, be.mx.array)
        if not device:
            tok = np.asarray(tokens, dtype=np.int64)
            if tok.size and (tok.min() < 0 or tok.max() >= self.config.vocab):
                raise UsageError(f"token id {int(tok.max() if tok.max() >= 0 else tok.min())} "
                                 f"is outside the vocabulary [0, {self.config.vocab})")
            self._tokens = tok  # the next forward's Step.tokens (hash-routed experts)
        scale = self.config.embed_scale
        if be.name == "mlx":
            mx = be.mx
            tok = tokens.astype(mx.int32) if device else mx.array(tok.astype(np.int32))
            out = self._mlx_embed(tok)
            return out * np.float32(scale) if scale != 1.0 else out
        v0, v1 = self.vocab
        if self.reduce is not None:
            loc = tok - v0
            mine = np.nonzero((loc >= 0) & (tok < v1))[0]
            out = np.zeros((tok.size, self.config.hidden), dtype=np.float32)
            if mine.size:
                out[mine] = self._rows(loc[mine])
            out = self.reduce(out)
        else:
            out = self._rows(tok)
        return out * np.float32(scale) if scale != 1.0 else out

    def _mlx_embed(self, tok):
        """The MLX lookup of int32 ids ``tok`` (this rank's vocabulary rows, summed over
        the tensor group), in the graph."""
        mx = self.backend.mx
        v0, v1 = self.vocab
        if self.reduce is not None:
            loc = tok - v0
            mine = (loc >= 0) & (tok < v1)
            rows = self._mlx_rows(mx.where(mine, loc, 0)) * mine[:, None].astype(mx.float32)
            return self._sum(rows)
        return self._mlx_rows(tok)

    def _mlx_rows(self, idx):
        if "embed_q" in self.extra:
            return self.backend.rows_lazy(self.extra["embed_q"], idx)
        if "embed_head" in self.extra:  # the tied head (in, out): the columns of the ids
            rows = self.backend.mx.take(self.extra["head"], idx, axis=1).T
        else:
            rows = self.extra["embed_mx"][idx]
        mx = self.backend.mx
        return rows if rows.dtype == mx.float32 else rows.astype(mx.float32)  # exact widening

    def _rows(self, idx: np.ndarray) -> np.ndarray:
        if "embed_q" in self.extra:  # kept quantized: dequantize the rows looked up
            return self.backend.rows(self.extra["embed_q"], idx)
        if "embed_head" in self.extra:  # the tied head's panels
            return self.extra["head"].rows(idx)
        emb = self.extra["embed_np"]
        return emb.rows(idx) if isinstance(emb, BF16) else np.ascontiguousarray(emb[idx])

    def forward(self, h, batch: Batch, cache: KVCache, lazy: bool = False):
        """Run this stage's layers on packed ``h`` (T_total, hidden); appends to ``cache``.

        Returns numpy, after one evaluation of the step and its cache writes (one host
        sync on MLX); with ``lazy`` (MLX) the output is left in the graph, unevaluated:
        the caller evaluates it with the cache (:meth:`cache_arrays`) in its own sync."""
        be = self.backend
        if h.shape[0] != batch.total:
            raise ValueError(f"forward: h has {h.shape[0]} rows, the batch {batch.total} tokens")
        for slot, _, n, pos in batch.seqs():
            if pos + n > cache.max_len:
                raise UsageError(f"sequence needs {pos + n} positions; the context "
                                 f"(cache) holds {cache.max_len}")
            if pos > cache.lengths[slot]:
                raise ValueError(f"slot {slot}: position {pos} skips past the "
                                 f"{cache.lengths[slot]} cached tokens")
            if cache.recurrent and 0 < pos < cache.lengths[slot]:
                raise ValueError(f"slot {slot}: position {pos} goes back into the "
                                 f"{cache.lengths[slot]} cached tokens; a linear-attention "
                                 "state cannot rewind (restore a snapshot, or start at 0)")
            cache.truncate(slot, pos)  # a step from an earlier position drops what follows
        positions = batch.token_positions()
        x = be.asarray(h)
        seqs = batch.seqs()
        tokens, self._tokens = getattr(self, "_tokens", None), None
        if tokens is not None and len(tokens) != batch.total:
            tokens = None  # embedded for another step
        steps = []
        for inv_freq, att, scale in self._ropes:
            cos, sin = cos_sin(inv_freq, att, positions)
            steps.append(Step(seqs, be.asarray(cos[:, None, :]), be.asarray(sin[:, None, :]),
                              scale, self._sum, tokens))
        for j, (layer, w) in enumerate(zip(self._blocks, self.layers)):
            cfg = self.local.at(self.start + j)  # this rank's heads (all on one rank)
            x = layer.forward(be, cfg, w, x, steps[self._rope_of[j]], cache.k[j], cache.v[j],
                              cache.index[j])
        for slot, _, n, pos in seqs:
            cache.lengths[slot] = pos + n
        if lazy:
            return x
        return be.host(x, *self.cache_arrays(cache))

    def cache_arrays(self, cache: KVCache) -> list:
        """The backend arrays a step writes into ``cache`` (to evaluate with its output)."""
        be = self.backend
        if be.name != "mlx":
            return []
        return [a for a in (*cache.k, *cache.v, *cache.index) if isinstance(a, be.mx.array)]

    def logits(self, h, lazy: bool = False):
        """(n, hidden) -> (n, vocab) float32: final norm and head [last stage].

        Under tensor parallelism: the logits of this rank's vocabulary rows
        (:attr:`vocab`), (n, hi - lo); the caller combines the ranks' parts.
        ``lazy`` (MLX): left in the graph, unevaluated (see :meth:`forward`).
        """
        if "norm" not in self.extra:
            raise RuntimeError("logits() called on a stage without the head")
        be = self.backend
        x = be.rms_norm(be.asarray(h), self.extra["norm"], self.config.norm_eps)
        out = be.linear(x, self.extra["head"])
        cap = self.config.final_logit_softcap
        if cap:  # Gemma: cap * tanh(logits / cap)
            out = be.xp.tanh(out * np.float32(1.0 / cap)) * np.float32(cap)
        return out if lazy else be.host(out)


# -- loading ------------------------------------------------------------------

class _Packing:
    """The backend as the loader hands it to the family's blocks: ``weight`` packs as the
    backend does and corrects the loader's count, made when the tensor was read, by what
    the backend then holds (MLX ``--quantize`` packs a float matrix into fewer bytes)."""

    def __init__(self, be, ld: _Loader):
        self._be, self._ld = be, ld

    def __getattr__(self, name):
        return getattr(self._be, name)

    def weight(self, w):
        out = self._be.weight(w)
        self._ld.nbytes += _packed_delta(w, out)
        return out


def _packed_delta(w, out) -> int:
    """Held minus counted bytes of ``w`` packed into ``out``: nonzero only where a float
    matrix (counted at its float size when read) became a :class:`QWeight`."""
    if isinstance(out, list):  # Blocks of a RowBlocks
        return sum(_packed_delta(a, b) for a, b in zip(w, out)) \
            if isinstance(w, list) and len(w) == len(out) else 0
    if isinstance(out, QWeight) and not isinstance(w, QuantTensor):
        return int(out.nbytes) - int(w.nbytes)
    return 0


class _Loader:
    """Reads a stage's tensors by their :mod:`~hpcmac.llm.model.spec`: checks each
    shape, keeps this rank's slice and counts its bytes, as the backend holds them."""

    def __init__(self, ckpt, backend, cfg: ModelConfig, shard: Shard,
                 keep_quantized: bool = True):
        self.ckpt, self.cfg, self.shard = ckpt, cfg, shard
        self.model_cfg, self.model_shard = cfg, shard
        self.be = _Packing(backend, self)
        self.keep = keep_quantized and hasattr(ckpt, "get_weight")
        self.nbytes = 0
        self.specs: dict[str, TensorSpec] = {}
        #: what was kept quantized: source ("gguf Q4_1", "mlx q4 g64") -> tensors
        self.formats: dict[str, int] = {}

    def layer(self, i: int | None) -> None:
        """Read layer ``i``'s tensors next (its layer type's config and KV heads); None:
        the model's own tensors (embedding, head)."""
        self.cfg = self.model_cfg if i is None else self.model_cfg.at(i)
        self.shard = self.model_shard if i is None else spec.layer_shard(self.model_shard,
                                                                          self.cfg)
        self.specs = {} if i is None else {t.name: t for t in
                                          arch.layer_tensors(self.model_cfg, i)}

    def _read(self, name: str, sp: TensorSpec, keep: bool):
        if spec.is_expert_stack(sp):
            layer, module = int(name.split(".")[2]), name.split(".")[3]
            which = name.rsplit(".", 1)[1]
            w = self.ckpt.experts(layer, which, keep_quant=keep, module=module) if keep else \
                self.ckpt.experts(layer, which, module=module)
            if tuple(w.shape) != sp.shape:
                raise UsageError(f"{self.ckpt.path}: experts '{which}' of layer {layer} have "
                                 f"shape {list(w.shape)}; expected {list(sp.shape)}")
            return w
        found = tuple(self.ckpt.shape(name))
        if found != sp.shape:
            raise UsageError(f"{self.ckpt.path}: tensor {name} has shape {list(found)}; "
                             f"expected {list(sp.shape)}")
        return self.ckpt.get_weight(name) if keep else self.ckpt.get(name)

    def np(self, name: str, sp: TensorSpec | None = None) -> np.ndarray:
        """The tensor ``name`` (this rank's slice) as float32 (dequantized if stored so)."""
        w = as_float(spec.take(self._read(name, sp or self.specs[name], False),
                               sp or self.specs[name], self.cfg, self.shard))
        self._count(w)
        return w

    def raw(self, name: str, sp: TensorSpec | None = None):
        """A matrix (this rank's slice) as stored: a QuantTensor kept quantized, else float32."""
        sp = sp or self.specs[name]
        w = spec.take(self._read(name, sp, self.keep), sp, self.cfg, self.shard)
        self._count(w)
        return w

    def raw16(self, name: str, sp: TensorSpec):
        """As :meth:`raw`, but a matrix of :data:`~hpcmac.llm.model.spec.BF16_KEPT` stored
        in bfloat16 stays in its 2 bytes (a :class:`~hpcmac.llm.model.quant.BF16`; this
        rank's rows), unless weights are not kept as stored or MLX quantizes them."""
        get = getattr(self.ckpt, "get_bf16", None)
        w = get(name) if get is not None and self.keep and not getattr(self.be, "bits", None) \
            else None
        if w is None:
            return self.raw(name, sp)
        if tuple(w.shape) != sp.shape:
            raise UsageError(f"{self.ckpt.path}: tensor {name} has shape {list(w.shape)}; "
                             f"expected {list(sp.shape)}")
        w = spec.take(w, sp, self.cfg, self.shard)
        self._count(w)
        return w

    def raw_t(self, name: str, sp: TensorSpec | None = None):
        """A matrix whose canonical layout is (..., in, out) (gpt-oss's experts) as the
        checkpoint keeps it quantized, in its stored layout (..., out, in): this rank's
        slice, a QuantTensor (float32 where the cut falls off its groups); None when the
        file holds it as floats (or weights are not kept quantized)."""
        get = getattr(self.ckpt, "get_weight_t", None)
        w = get(name) if self.keep and get is not None else None
        if w is None:
            return None
        sp = sp or self.specs[name]
        n = len(sp.shape)
        t = replace(sp, shape=(*sp.shape[:-2], sp.shape[-1], sp.shape[-2]),
                    axis={n - 1: n - 2, n - 2: n - 1}.get(sp.axis, sp.axis))
        if tuple(w.shape) != t.shape:
            raise UsageError(f"{self.ckpt.path}: tensor {name} has shape "
                             f"{list(w.shape)} as stored; expected {list(t.shape)}")
        w = spec.take(w, t, self.cfg, self.shard)
        self._count(w)
        return w

    def _count(self, w) -> None:
        if isinstance(w, QuantTensor) and self.be.name == "numpy":  # as NQWeight holds it
            self.nbytes += numpy_held_nbytes(w)
        elif isinstance(w, QuantTensor) and self.be.name == "mlx":  # as QWeight holds it
            self.nbytes += mlx_held_nbytes(w)
        else:
            self.nbytes += w.nbytes
        if isinstance(w, QuantTensor):
            self.formats[w.source] = self.formats.get(w.source, 0) + 1

    def __call__(self, name: str, sp: TensorSpec | None = None):
        """A vector or a norm weight, as a backend array."""
        return self.be.asarray(self.np(name, sp))

    def w(self, name: str, sp: TensorSpec | None = None):
        """A matrix used by ``backend.linear`` (stored the backend's way)."""
        return self.be.weight(self.raw(name, sp))

    def has_part(self, name: str) -> bool:
        """False for a bias that another rank of the tensor group holds."""
        return spec.part(self.specs[name], self.cfg, self.shard) != (0, 0)


def _load_layer(ld: _Loader, cfg: ModelConfig, i: int) -> dict:
    """Weights of global layer ``i`` in the backend's arrays, projections fused
    (this rank's part of each under tensor parallelism), as its family's blocks read them."""
    ld.layer(i)
    return arch.layer(cfg, i).load(ld, cfg.at(i), i)


def load_stage(path_or_name: str | os.PathLike, start: int, end: int, first: bool = True,
               last: bool = True, backend: str = "numpy", quantize: int | None = None,
               group_size: int = 64, shard: Shard | None = None,
               reduce: Callable[[np.ndarray], np.ndarray] | None = None,
               keep_quantized: bool = True, int8_activations: bool | None = None) -> Stage:
    """Load layers ``[start, end)`` (global indices) of a model folder or GGUF file.

    Parameters
    ----------
    path_or_name : model folder (config.json + safetensors), GGUF file, or a
        short name such as ``smollm2`` (global).
    start, end : half-open global layer range of this stage.
    first : also load the token embedding (this stage embeds).
    last : also load the final norm and the head (this stage makes logits).
    backend : ``numpy`` or ``mlx``.
    quantize, group_size : keep the matrices quantized to ``quantize`` bits
        per weight, one scale and bias per ``group_size`` inputs (MLX only).
    shard : this rank's part under tensor parallelism
        (:func:`hpcmac.llm.model.spec.make_shards`); None: all of it.
    reduce : with a shard of a tensor group: sums a float32 numpy array over
        the group and returns the sum (the same on every rank of the group);
        the stage calls it twice per layer and once per embedding. One whose
        ``in_graph`` is true (MLX backend) takes and returns MLX arrays, unevaluated
        (:class:`~hpcmac.llm.parallel.tensor.GraphSum`).
    keep_quantized : keep weights the checkpoint stores quantized (MLX affine
        safetensors, the exact GGUF types) as they are (default); False
        dequantizes every weight to float32 (the reference the tests compare with).
    int8_activations : numpy backend: multiply quantized weights by activations
        rounded to 8 bits per run of 32 (:mod:`hpcmac.llm.model.qkernels`); None:
        ``HPCMAC_INT8_ACTIVATIONS``, off by default.
    """
    be = get_backend(backend, quantize, group_size, int8_activations)
    ckpt = open_checkpoint(path_or_name)
    cfg = ckpt.config()
    if not (0 <= start <= end <= cfg.n_layers):
        raise UsageError(f"layer range [{start}, {end}) is outside the model's "
                         f"{cfg.n_layers} layers")
    shard = shard or spec.full_shard(cfg)
    fam = arch.of(cfg)
    if shard.size > 1 and "tp" not in fam.layouts:
        raise UsageError(f"{cfg.arch}: tensor parallelism is not supported for this family "
                         "yet (run it whole on one rank)")
    if (start, end) != (0, cfg.n_layers) and "pp" not in fam.layouts:
        raise UsageError(f"{cfg.arch}: pipeline stages are not supported for this family "
                         "yet (run it whole on one rank)")
    if not first:
        for i in range(start, end):
            if getattr(arch.layer(cfg, i), "needs_tokens", False):
                raise UsageError(f"{cfg.arch}: layer {i} routes by token id (hash-routed "
                                 "experts) and needs the stage that embeds; put it on the "
                                 "first pipeline stage")
    if shard.size > 1 and reduce is None:
        raise ValueError("load_stage: a shard of a tensor group needs reduce")
    ld = _Loader(ckpt, be, cfg, shard, keep_quantized)
    extra: dict = {}
    if first or (last and cfg.tie_embeddings):
        emb = ld.raw16("model.embed_tokens.weight", spec.embed_spec(cfg))
        packed = ld.be.weight(emb) if quantize or isinstance(emb, QuantTensor) else None
        if last and cfg.tie_embeddings:
            extra["head"] = packed if packed is not None else be.weight(emb)
        if first:
            extra["embed"] = True
            if isinstance(packed, (QWeight, NQWeight)):  # one quantized copy: lookup, tied head
                extra["embed_q"] = packed
            elif "head" in extra:  # the tied head's copy serves the lookup: one copy held
                extra["embed_head"] = True
            elif be.name == "mlx":  # looked up in MLX's graph (Stage.embed); bfloat16 kept
                extra["embed_mx"] = be.mx.array(emb.bits).view(be.mx.bfloat16) \
                    if isinstance(emb, BF16) else be.mx.array(np.ascontiguousarray(as_float(emb)))
            else:  # float32, or bfloat16 bits widened per row looked up
                emb = emb if isinstance(emb, BF16) else as_float(emb)
                extra["embed_np"] = emb
        del emb, packed  # the stage holds what it needs of them
    layers = [_load_layer(ld, cfg, i) for i in range(start, end)]
    ld.layer(None)
    if last:
        norm, *head = spec.head_tensors(cfg)
        extra["norm"] = norm_weight(ld, cfg, "model.norm.weight", norm)
        if head:
            extra["head"] = ld.be.weight(ld.raw16("lm_head.weight", head[0]))
    stage = Stage(cfg, start, end, first, last, be, layers, extra, ld.nbytes, shard, reduce)
    stage.formats = dict(ld.formats)
    if hasattr(ckpt, "release"):  # the file's pages read while loading leave the RSS
        ckpt.release()
    release_freed_memory()
    return stage
