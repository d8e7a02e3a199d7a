"""GGUF files: configuration from metadata, tensors dequantized to float32 on request.

Tensors are addressed by their canonical (Hugging Face) names and translated
to GGUF names by the family's tensor spec (:func:`hpcmac.llm.model.arch.gguf_names`);
the configuration is the family's GGUF mapping
(:func:`hpcmac.llm.model.arch.config_from_gguf`). The header is read by
hpcmac.plan.gguf_header and the file memory-mapped (:class:`GGUFFile`); only the
tensors asked for are dequantized.
Q/K rows that the converter permutes for its rotary layout (the family says:
``gguf_qk_permuted``, Llama) are un-permuted back. A tensor that the file stores in
another layout (the family's spec says: :attr:`~hpcmac.llm.model.spec.TensorSpec.gguf_form`,
gpt-oss's experts split into gate and up, each (out, in)) is put back together in its
canonical layout, kept quantized where its parts are (:meth:`GGUFCheckpoint.get_weight_t`).
A ``rows`` form (the linear attention of Qwen3-Next and Qwen3.5: projections split or their
value heads reordered by the converter) is its parts' rows (or columns) gathered back into
the canonical order, kept quantized where it is a row gather of parts of one exact type.
"""

from __future__ import annotations

import os
from pathlib import Path
from struct import error as struct_error

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.arch import config_from_gguf
from hpcmac.llm.model.arch.fields import GGUFMeta, ModelConfig
from hpcmac.llm.model.quant import QuantTensor, as_float, concat_rows

#: tensor types dequantized here (via gguf.quants)
SUPPORTED_QUANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q4_K", "Q5_K", "Q6_K", "MXFP4")

#: bits of the GGUF types kept quantized (see gguf_quant)
_BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5,
         "MXFP4": 4}
#: bytes of scale and bias per 32 weights as the numpy backend holds them: the float16
#: ``d`` alone for the symmetric types (bias derived), ``d`` and ``m`` for Q4_1/Q5_1,
#: float32 for the K types (``d * sc`` needs up to 17 significant bits), MXFP4's E8M0 byte
#: as a bfloat16 (see quant.float_mode_nbytes)
_GROUP_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q5_0": 2, "Q4_1": 4, "Q5_1": 4, "Q4_K": 8, "Q5_K": 8,
                "MXFP4": 2}

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
        self._cfg: ModelConfig | None = None
        self._gguf: dict[str, str] | None = None
        self._forms: dict[str, tuple] | None = None
        #: the repack cache's entry of this file (None: off or not cached; False: not yet asked)
        self._cache = False

    # -- metadata ------------------------------------------------------------
    def config(self) -> ModelConfig:
        """Model configuration from the GGUF metadata by the family's mapping (checked:
        ModelConfig.check, and block_count against the layers the tensors hold)."""
        if self._cfg is None:
            fields = {k: f.contents() for k, f in self.reader.fields.items()}
            self._cfg = config_from_gguf(GGUFMeta(fields, self._tensors, str(self.path)))
        return self._cfg

    def _qk_permuted(self) -> bool:
        from hpcmac.llm.model import arch

        return arch.of(self.config()).gguf_qk_permuted

    def gguf_name(self, name: str) -> str | None:
        """The GGUF tensor name of a canonical name (None when the model has no such tensor)."""
        if self._gguf is None:
            from hpcmac.llm.model.arch import gguf_names

            self._gguf = gguf_names(self.config())
        return self._gguf.get(name)

    def gguf_form(self, name: str) -> tuple | None:
        """The family's :attr:`~hpcmac.llm.model.spec.TensorSpec.gguf_form` of a canonical
        name (None: stored as it is, under :meth:`gguf_name`)."""
        if self._forms is None:
            from hpcmac.llm.model.arch import gguf_forms

            self._forms = gguf_forms(self.config())
        return self._forms.get(name)

    def _parts(self, name: str, form: tuple) -> list:
        """The GGUF tensors of a formed tensor: ``[a]`` (``t``); ``[a, b]`` or ``[fused]``
        (``pairs``, ``pairs_t``: the fused one where the file holds that instead); every
        part of a ``rows`` form."""
        kind, *names = form
        if kind == "rows":
            return [self._tensor(name, n) for n in names[3:]]
        if kind == "t":
            return [self._tensor(name, names[0])]
        a, b, fused = names
        if a not in self._tensors and fused in self._tensors:
            return [self._tensors[fused]]
        return [self._tensor(name, a), self._tensor(name, b)]

    def _combine(self, form: tuple, parts: list):
        """A formed tensor from its parts as read (float32 arrays or QuantTensors, GGUF's
        (..., out, in)), in the layout :meth:`get_weight_t` returns: (..., out, in) rows
        interleaved for ``pairs_t`` (the last two axes not yet swapped), the vector
        interleaved for ``pairs``; a ``rows`` form gathered (its post-step applied)."""
        if form[0] == "rows":
            return self._gather(form, parts)
        if form[0] == "t":
            return parts[0]
        if len(parts) == 1:  # fused: a's rows (or entries), then b's
            w = parts[0]
            half = w.shape[-2 if form[0] == "pairs_t" else -1] // 2
            cut = (lambda a, lo, hi: a[..., lo:hi, :]) if form[0] == "pairs_t" else \
                (lambda a, lo, hi: a[..., lo:hi])
            if isinstance(w, QuantTensor):
                parts = [w.map(lambda a, lo=lo: cut(a, lo, lo + half)) for lo in (0, half)]
            else:
                parts = [cut(w, 0, half), cut(w, half, 2 * half)]
        axis = -2 if form[0] == "pairs_t" else -1

        def weave(a, b):
            ax = a.ndim + axis
            out = np.stack([a, b], axis=ax + 1)
            return np.ascontiguousarray(out.reshape(*a.shape[:ax], 2 * a.shape[ax],
                                                    *a.shape[ax + 1:]))

        a, b = parts
        if isinstance(a, QuantTensor) and isinstance(b, QuantTensor) and a.format == b.format:
            return QuantTensor(weave(a.words, b.words), weave(a.scales, b.scales),
                               None if a.biases is None else weave(a.biases, b.biases),
                               a.bits, a.group, a.source, a.mode)
        return weave(as_float(a), as_float(b))

    def _gather(self, form: tuple, parts: list):
        """A ``rows`` form's canonical tensor from its parts as read (float32, or
        QuantTensors of one format where the form keeps them: rows gathered, no post-step)."""
        _, axis, index, post = form[:4]
        idx, _ = index(self.config())
        if all(isinstance(p, QuantTensor) for p in parts):
            w = concat_rows(parts)
            return w if idx is None else w.map(lambda a: a[idx])
        w = np.concatenate([as_float(p) for p in parts], axis=axis)
        if idx is not None:
            w = np.take(w, idx, axis=axis)
        if post == "neg_log":  # llama.cpp stores -exp(A_log)
            w = np.log(-w)
        elif post == "conv":  # (C, K) as stored; canonical (C, 1, K)
            w = w[:, None, :]
        return np.ascontiguousarray(w, dtype=np.float32)

    def _formed_shape(self, name: str, form: tuple) -> tuple[int, ...]:
        parts = self._parts(name, form)
        if form[0] == "rows":
            _, axis, index, post = form[:4]
            idx, counts = index(self.config())
            shapes = [[int(s) for s in reversed(t.shape)] for t in parts]
            shape = list(shapes[0])
            shape[axis] = sum(sh[axis] for sh in shapes)
            if [sh[axis] for sh in shapes] == list(counts) and idx is not None:
                shape[axis] = len(idx)
            if post == "conv":
                shape.insert(1, 1)
            return tuple(shape)
        shape = [int(s) for s in reversed(parts[0].shape)]
        if form[0] != "t" and len(parts) == 1:
            shape[-2 if form[0] == "pairs_t" else -1] //= 2
        if form[0] != "t":
            shape[-2 if form[0] == "pairs_t" else -1] *= 2
        if form[0] != "pairs":
            shape[-1], shape[-2] = shape[-2], shape[-1]
        return tuple(shape)

    def get_weight_t(self, name: str):
        """A tensor whose canonical layout is (..., in, out) and that the file stores as
        (..., out, in) (a ``t`` or ``pairs_t`` form: gpt-oss's experts), kept quantized as
        stored: a QuantTensor (..., out, in); None when its parts are not of a type kept
        quantized (then :meth:`get` gives the float32 canonical tensor)."""
        form = self.gguf_form(name)
        if form is None or form[0] not in ("t", "pairs_t") or not self._kept_quantized(name):
            return None
        return self._combine(form, [self._keep(t, tuple(int(s) for s in reversed(t.shape)))
                                    for t in self._parts(name, form)])

    def _formed(self, name: str, form: tuple) -> np.ndarray:
        """A formed tensor as float32 in its canonical layout."""
        w = self._combine(form, [self._dequant(t) for t in self._parts(name, form)])
        return w if form[0] in ("pairs", "rows") else np.ascontiguousarray(w.swapaxes(-1, -2))

    def quant_layout(self, name: str) -> tuple[int, int] | None:
        """(group, the canonical axis its groups run along) of a formed tensor kept
        quantized (its groups run along the stored rows: the canonical axis -2); None
        otherwise (the other quantized tensors' groups run along the canonical rows)."""
        form = self.gguf_form(name)
        if form is None or form[0] == "rows" or not self._kept_quantized(name):
            return None
        return (32, len(self.shape(name)) - 2)

    def _kept_quantized(self, name: str) -> bool:
        """Whether :meth:`get_weight_t` keeps ``name`` quantized (from the header alone)."""
        from hpcmac.llm.model.gguf_quant import EXACT

        form = self.gguf_form(name)
        if form is None or form[0] == "pairs" or \
                (form[0] == "rows" and (form[1] != 0 or form[3] is not None)):
            return False
        types = {t.type_name for t in self._parts(name, form)}
        return len(types) == 1 and types <= set(EXACT)

    # -- tensors -------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        form = self.gguf_form(name)
        if form is not None and form[0] == "rows":
            return all(n in self._tensors for n in form[4:])
        if form is not None:
            kind, *names = form
            return all(n in self._tensors for n in names[:2 if kind != "t" else 1]) or \
                (kind != "t" and names[2] in self._tensors)
        g = self.gguf_name(name)
        return g is not None and g in self._tensors

    def _tensor(self, name: str, gname: str | None = None):
        g = gname or self.gguf_name(name)
        if g is None or g not in self._tensors:
            raise UsageError(f"{self.path}: tensor {g or name} is missing")
        return self._tensors[g]

    def shape(self, name: str) -> tuple[int, ...]:
        if name.endswith("self_attn.kv_b_proj.weight") and \
                self.gguf_name(name) not in self._tensors:
            return self.shape_of_kv_b(name)
        form = self.gguf_form(name)
        if form is not None:
            return self._formed_shape(name, form)
        return tuple(int(s) for s in reversed(self._tensor(name).shape))

    def numel(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64))

    def release(self) -> None:
        """Forget the file's pages read so far (the reader stays usable)."""
        from hpcmac.llm.model.backend import release_mapped

        release_mapped(self.reader.data)

    def stored_nbytes(self, name: str) -> int:
        """Bytes ``name`` takes in memory as :meth:`get_weight` returns it."""
        from hpcmac.llm.model.gguf_quant import EXACT
        from hpcmac.llm.model.quant import held_nbytes

        if self._kept_quantized(name):
            t = self._parts(name, self.gguf_form(name))[0]
            return held_nbytes(self.numel(name), _BITS[t.type_name], 32,
                               _GROUP_BYTES[t.type_name])
        g = self.gguf_name(name)
        if g in self._tensors and self._tensors[g].type_name in EXACT:
            t = self._tensors[g]
            return held_nbytes(self.numel(name), _BITS[t.type_name], 32,
                               _GROUP_BYTES[t.type_name])
        return 4 * self.numel(name)

    def experts_nbytes(self, layer: int, module: str = "mlp") -> int | None:
        """Bytes of one layer's routed experts as held (None: not all kept quantized;
        ``module``: a safetensors name, unused)."""
        held = [self.experts_held(layer, w, module) for w in ("gate", "up", "down")]
        return None if None in held else sum(h[0] for h in held)

    def experts_held(self, layer: int, which: str, module: str = "mlp"
                     ) -> tuple[int, int] | None:
        """(bytes as held, group 32) of one layer's routed ``which`` experts when of a type
        kept quantized; None otherwise."""
        from hpcmac.llm.model.gguf_quant import EXACT
        from hpcmac.llm.model.quant import held_nbytes

        t = self._tensors.get(f"blk.{layer}.ffn_{which}_exps.weight")
        if t is None or t.type_name not in EXACT:
            return None
        return held_nbytes(int(np.prod(t.shape)), _BITS[t.type_name], 32,
                           _GROUP_BYTES[t.type_name]), 32

    def _keep(self, t, shape: tuple[int, ...]):
        """A tensor as kept in memory: a QuantTensor for the exact types (read from the
        repack cache, :mod:`~hpcmac.llm.model.gguf_cache`, when it holds it), else float32."""
        from hpcmac.llm.model.gguf_quant import EXACT, to_quant

        if t.type_name not in EXACT:
            return self._dequant(t)
        if self._cache is False:
            from hpcmac.llm.model import gguf_cache

            self._cache = gguf_cache.for_file(self.path)
        qt = self._cache.get(t.name, t.type_name, shape) if self._cache else None
        if qt is None:
            qt = to_quant(t.data, t.type_name, shape)
            if self._cache:
                self._cache.put(t.name, t.type_name, shape, qt)
        return qt

    def get_weight(self, name: str):
        """The tensor as stored: a QuantTensor for the exact GGUF types, else float32."""
        if name.endswith("self_attn.kv_b_proj.weight") and \
                self.gguf_name(name) not in self._tensors:
            return self._kv_b_from_split(name)
        form = self.gguf_form(name)
        if form is not None and form[0] == "rows" and self._kept_quantized(name):
            return self._gather(form, [self._keep(t, tuple(int(s) for s in reversed(t.shape)))
                                       for t in self._parts(name, form)])
        if form is not None:  # float32 canonical (kept quantized: get_weight_t)
            return self._formed(name, form)
        t = self._tensor(name)
        w = self._keep(t, self.shape(name))
        if self._qk_permuted() and (name.endswith("self_attn.q_proj.weight")
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
        if name.endswith("self_attn.kv_b_proj.weight") and \
                self.gguf_name(name) not in self._tensors:
            return self._kv_b_from_split(name)
        form = self.gguf_form(name)
        if form is not None:
            return self._formed(name, form)
        w = self._dequant(self._tensor(name))
        if self._qk_permuted():
            cfg = self.config()
            if name.endswith("self_attn.q_proj.weight"):
                w = unpermute_rows(w, cfg.n_heads)
            elif name.endswith("self_attn.k_proj.weight"):
                w = unpermute_rows(w, cfg.n_kv_heads)
        return w

    def _kv_b_from_split(self, name: str) -> np.ndarray:
        """kv_b_proj (H*(nope+v), r) rebuilt from attn_k_b (H, r, nope) and attn_v_b (H, v, r)."""
        base = self.gguf_name(name)[:-len("attn_kv_b.weight")]
        k_b = self._dequant(self._tensor(name, base + "attn_k_b.weight"))
        v_b = self._dequant(self._tensor(name, base + "attn_v_b.weight"))
        kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # (H, nope+v, r)
        return np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))

    def shape_of_kv_b(self, name: str) -> tuple[int, ...]:
        cfg = self.config()
        return (cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)

    def experts(self, layer: int, which: str, keep_quant: bool = False, module: str = "mlp"):
        """Routed expert weights of one layer, (E, out, in) (``keep_quant``: as stored;
        ``module`` is a safetensors name, GGUF names are the same for every family)."""
        t = self._tensor("", f"blk.{layer}.ffn_{which}_exps.weight")
        if keep_quant:
            return self._keep(t, tuple(int(s) for s in reversed(t.shape)))
        return self._dequant(t)
