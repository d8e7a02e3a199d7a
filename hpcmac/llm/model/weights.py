"""Checkpoint readers: Hugging Face safetensors folders and GGUF files.

Both expose the same small interface over *canonical* (Hugging Face) tensor
names, so the model never cares where its weights come from:

``ckpt.config()``, ``ckpt.has(name)``, ``ckpt.shape(name)``,
``ckpt.get(name) -> float32 ndarray``, ``ckpt.experts(layer, which) -> (E, out, in)``.
``ckpt.get_weight(name)`` and ``ckpt.experts(..., keep_quant=True)`` give a
weight as stored: a :class:`~hpcmac.llm.model.quant.QuantTensor` when the file
holds it quantized in a form we keep (MLX affine and mxfp4 safetensors as mlx-lm
and mlx-community write them; FP8 e4m3 with block scales; the exact GGUF block
types and MXFP4), float32 otherwise; ``ckpt.stored_nbytes(name)`` is what that
takes in memory. gpt-oss's MXFP4 experts are stored (E, out, in) where their
canonical layout is transformers' (E, in, out): ``ckpt.get_weight_t(name)``
gives them kept 4-bit in the stored layout.

Safetensors files are memory-mapped and only the tensors a caller asks for are
read, so a pipeline stage touches only the bytes of its own layers.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.io.inputs import decode_text, parse_json, read_text
from hpcmac.llm.model.backend import release_mapped
from hpcmac.llm.model.config import ModelConfig, is_gguf, resolve_model
from hpcmac.llm.model.quant import (
    BF16,
    FLOAT_MODES,
    QuantTensor,
    as_float,
    check_format,
    float_mode_nbytes,
    held_nbytes,
    quantized_nbytes,
    same_format,
    stack,
)

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
              "I64": np.int64}  # I64: DeepSeek-V4's token-to-expert table (read as floats)
#: every dtype a safetensors header may declare, with its item size
_ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
#: safetensors' own bound on the JSON header
MAX_ST_HEADER = 100 << 20


def check_safetensors_table(table, data_len: int, where: str) -> dict:
    """The tensor table of a safetensors header, every entry checked against the format and
    the file: a dtype it names, a shape of integers >= 0, ``data_offsets`` [begin, end]
    inside the data and exactly shape x item size long. Pure; UsageError for the first
    problem."""
    if not isinstance(table, dict):
        raise UsageError(f"{where}: safetensors header: expected a JSON object, found "
                         f"{type(table).__name__}")
    table = dict(table)
    table.pop("__metadata__", None)
    for name, info in table.items():
        at = f"{where}: tensor {name!r}"
        if not isinstance(info, dict):
            raise UsageError(f"{at}: expected an object with dtype, shape, data_offsets")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ST_SIZES:
            raise UsageError(f"{at}: dtype {dtype!r} is not a safetensors dtype")
        if not isinstance(shape, list) or len(shape) > 8 or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48
                for d in shape):
            raise UsageError(f"{at}: shape {shape!r}: expected a list of at most 8 "
                             "integers >= 0")
        if not (isinstance(offs, list) and len(offs) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offs)):
            raise UsageError(f"{at}: data_offsets {offs!r}: expected [begin, end]")
        lo, hi = offs
        if not 0 <= lo <= hi <= data_len:
            raise UsageError(f"{at}: data_offsets [{lo}, {hi}]: expected 0 <= begin <= end <= "
                             f"{data_len} (the data in the file)")
        want = _ST_SIZES[dtype]
        for d in shape:
            want *= d
        if hi - lo != want:
            raise UsageError(f"{at}: {hi - lo} bytes for shape {shape} of {dtype} "
                             f"({want} expected)")
    return table


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) to float32: the high half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


class SafetensorsCheckpoint:
    """A Hugging Face folder: ``config.json`` + one or many ``*.safetensors`` files."""

    def __init__(self, folder: Path):
        self.path = Path(folder)
        index = self.path / "model.safetensors.index.json"
        self._file_of: dict[str, Path] = {}
        if index.exists():
            doc = parse_json(read_text(index, "index", 64 << 20), str(index))
            weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(weight_map, dict):
                raise UsageError(f"{index}: expected JSON with a 'weight_map' object")
            for name, fname in weight_map.items():
                if not isinstance(fname, str) or Path(fname).name != fname or \
                        not fname.endswith(".safetensors"):
                    raise UsageError(f"{index}: weight_map[{name!r}]: expected a .safetensors "
                                     f"file name in {self.path}, found {fname!r}")
                self._file_of[name] = self.path / fname
            files = sorted(set(self._file_of.values()))
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise UsageError(f"{self.path}: no model.safetensors or "
                                 "model.safetensors.index.json found")
        self._headers: dict[Path, tuple[int, dict]] = {}
        self._maps: dict[Path, np.memmap] = {}
        if not index.exists():
            for f in files:
                for name in self._header(f)[1]:
                    self._file_of[name] = f
        #: canonical name -> stored name, where they differ: a multimodal folder holds its
        #: text model under ``language_model.`` (Kimi K2.5, LLaVA-style) or
        #: ``model.language_model.`` (Qwen3.5, its head at ``lm_head``)
        self._stored: dict[str, str] = {}
        embed = "model.embed_tokens.weight"
        for stored, canon in (("language_model.", ""), ("model.language_model.", "model.")):
            if embed not in self._file_of and stored + embed[len(canon):] in self._file_of:
                for name in [n for n in self._file_of if n.startswith(stored)]:
                    self._stored[canon + name[len(stored):]] = name
                    self._file_of[canon + name[len(stored):]] = self._file_of.pop(name)
        if "lm_head.weight" not in self._file_of and "head.weight" in self._file_of and \
                "model.embed_tokens.weight" in self._file_of:  # DeepSeek-V4's reference name
            self._stored["lm_head.weight"] = "head.weight"
            self._file_of["lm_head.weight"] = self._file_of.pop("head.weight")
        #: gpt-oss's MXFP4 tensors: name -> (its _blocks, its _scales)
        self._mxfp4 = {n[:-len("_blocks")]: (n, n[:-len("_blocks")] + "_scales")
                       for n in self._file_of
                       if n.endswith("_blocks") and n[:-len("blocks")] + "scales" in self._file_of}
        #: compressed-tensors' packed integer weights (Kimi K2 Thinking): X.weight ->
        #: X.weight_packed (with X.weight_scale)
        self._packed = {n[:-len("_packed")]: n for n in self._file_of
                        if n.endswith(".weight_packed")}
        self._sanitized: bool | None = None  # see mlx_lm_sanitized
        #: latent attention as mlx-lm's sanitize stores it (DeepSeek V3/V3.2, GLM-4.7-Flash,
        #: Kimi): no kv_b_proj, its per-head halves embed_q (H, r, nope) and unembed_out
        #: (H, v, r), quantized or not: X.kv_b_proj.weight -> (X.embed_q, X.unembed_out)
        self._mla_split = {}
        for n in self._file_of:
            if n.endswith(".self_attn.embed_q.weight"):
                base = n[:-len("embed_q.weight")]
                if base + "unembed_out.weight" in self._file_of and \
                        base + "kv_b_proj.weight" not in self._file_of:
                    self._mla_split[base + "kv_b_proj.weight"] = (n, base + "unembed_out.weight")
        #: gpt-oss's experts as mlx-lm's sanitize stores them (mlx-community's folders):
        #: ``experts.{gate,up,down}_proj.weight`` (E, out, in), quantized or not, and
        #: ``.bias``; read under transformers' names (gate_up_proj (E, in, 2I) with gate and
        #: up columns interleaved, down_proj (E, in, out), their _bias): canonical -> parts
        self._oss_split: dict[str, tuple[str, ...]] = {}
        for n in self._file_of:
            if n.endswith(".mlp.experts.gate_proj.weight"):
                e = n[:-len("gate_proj.weight")]
                parts = {"gate_up_proj": (e + "gate_proj.weight", e + "up_proj.weight"),
                         "gate_up_proj_bias": (e + "gate_proj.bias", e + "up_proj.bias"),
                         "down_proj": (e + "down_proj.weight",),
                         "down_proj_bias": (e + "down_proj.bias",)}
                for canon, stored in parts.items():
                    if e + canon not in self._file_of and all(
                            x in self._file_of for x in stored):
                        self._oss_split[e + canon] = stored

    def _header(self, f: Path) -> tuple[int, dict]:
        """(data start offset, tensor table) of one file; checks it is complete."""
        if f not in self._headers:
            if not f.exists():
                raise UsageError(f"{f}: weight file is missing")
            if not f.is_file():
                raise UsageError(f"{f}: expected a regular file")
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise UsageError(f"{f}: truncated (no safetensors header)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8 or n > MAX_ST_HEADER:
                    raise UsageError(f"{f}: truncated or not safetensors "
                                     f"(header of {n} bytes, file of {size})")
                text = decode_text(fh.read(n), f"{f}: safetensors header")
            table = check_safetensors_table(parse_json(text, f"{f}: safetensors header"),
                                            size - 8 - n, str(f))
            self._headers[f] = (8 + n, table)
        return self._headers[f]

    def config(self) -> ModelConfig:
        from hpcmac.llm.model.config import load_config

        return load_config(self.path)

    # -- MLX-quantized tensors (mlx-lm's -q, mlx-community) ---------------------
    def _quant_config(self) -> dict:
        """config.json's ``quantization`` (or ``quantization_config``) object, {} if none."""
        if not hasattr(self, "_qcfg"):
            self._qcfg = {}
            f = self.path / "config.json"
            try:
                raw = parse_json(read_text(f, "config"), str(f)) if f.exists() else {}
                raw = raw if isinstance(raw, dict) else {}
            except UsageError:
                raw = {}
            q = raw.get("quantization", raw.get("quantization_config")) \
                if isinstance(raw, dict) else None
            if isinstance(q, dict):
                self._qcfg = q
        return self._qcfg

    def is_quantized(self, name: str) -> bool:
        """Whether ``name`` (a ``.weight``) is stored quantized: MLX's (it has ``.scales``),
        FP8 (it has ``.weight_scale_inv``) or compressed-tensors' (``.weight_packed``)."""
        return name.endswith(".weight") and (
            self.has(name[:-len("weight")] + "scales") or self.is_fp8(name) or
            name in self._packed)

    def is_fp8(self, name: str) -> bool:
        """Whether ``name`` is an FP8 weight with block scales (``.weight_scale_inv``)."""
        return name.endswith(".weight") and name + "_scale_inv" in self._file_of

    def fp8_block(self) -> int:
        """The FP8 block size, checked: config.json's ``weight_block_size`` (square)."""
        from hpcmac.llm.model.arch import check_fp8

        q = self._quant_config()
        check_fp8(q, f"{self.path / 'config.json'}: quantization_config")
        return q["weight_block_size"][0]

    def quant_params(self, name: str) -> tuple[int, int]:
        """(bits, group) of a quantized ``name``, checked: config.json's per-layer entry
        for its module, else the global ``quantization``; one line if unsupported."""
        return self.quant_format(name)[1:]

    def quant_format(self, name: str) -> tuple[str, int, int]:
        """(mode, bits, group) of a quantized ``name`` (see :meth:`quant_params`)."""
        if self.is_fp8(name):
            return "fp8", 8, self.fp8_block()
        if name in self._packed:  # symmetric integers: affine, bias -2^(bits-1) scale
            from hpcmac.llm.model.arch import compressed_format

            return ("affine", *compressed_format(
                self._quant_config(), f"{self.path / 'config.json'}: quantization_config"))
        base = name[:-len(".weight")]
        q = self._quant_config()
        if not q:
            raise UsageError(f"{self.path}: tensor {name} has scales but config.json has no "
                             "'quantization' (bits, group_size) to read them with")
        p = q.get(base, q.get(self._stored.get(name, name)[:-len(".weight")]))
        if not isinstance(p, dict):
            p = q
        # a per-layer entry is mlx.nn's to_quantized arguments: its mode defaults to affine
        bits, group, mode = p.get("bits", q.get("bits")), \
            p.get("group_size", q.get("group_size")), p.get("mode", "affine")
        check_format(f"{self.path}: tensor {name}", bits, group, mode)
        return mode, int(bits), int(group)

    def _raw(self, name: str) -> np.ndarray:
        """A tensor's bytes as stored, memory-mapped (no copy), in its own dtype."""
        f, start, info = self._info(name)
        dtype = dict(_ST_DTYPES, U32=np.uint32, U8=np.uint8, F8_E4M3=np.uint8,
                     I32=np.uint32).get(info["dtype"])  # I32: compressed-tensors' packed words
        if dtype is None:
            raise UsageError(f"{f}: tensor {name} has dtype {info['dtype']}; "
                             f"expected one of {', '.join(_ST_DTYPES)} (or U32 codes)")
        if f not in self._maps:
            self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        lo, hi = info["data_offsets"]
        want = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(dtype).itemsize
        if hi - lo != want:
            raise UsageError(f"{f}: tensor {name}: {hi - lo} bytes for shape {info['shape']} "
                             f"of {info['dtype']} ({want} expected)")
        return self._maps[f][start + lo:start + hi].view(dtype).reshape(info["shape"])

    def _float(self, name: str) -> np.ndarray:
        """A float tensor as float32 (a fresh array)."""
        f, _, info = self._info(name)
        if info["dtype"] not in _ST_DTYPES:
            raise UsageError(f"{f}: tensor {name} has dtype {info['dtype']}; "
                             f"expected one of {', '.join(_ST_DTYPES)}")
        raw = self._raw(name)
        out = bf16_to_f32(raw) if info["dtype"] == "BF16" else np.array(raw, dtype=np.float32)
        if name.endswith(_MLX_SHIFTED_NORMS) and self.mlx_lm_sanitized():
            # mlx-lm stored 1 + w; Hugging Face's w (x - 1 is exact in float32 for x >= 0.5,
            # so the forward's 1 + w is the stored value again)
            out -= np.float32(1.0)
        return out

    def bf16_kept(self, name: str) -> bool:
        """Whether ``name`` is one of :data:`~hpcmac.llm.model.spec.BF16_KEPT` and stored
        in bfloat16: held in its 2 bytes (:meth:`get_bf16`)."""
        from hpcmac.llm.model.spec import BF16_KEPT

        return name in BF16_KEPT and name in self._file_of and \
            self._info(name)[2]["dtype"] == "BF16"

    def get_bf16(self, name: str) -> BF16 | None:
        """A matrix kept in the checkpoint's bfloat16 (:meth:`bf16_kept`): its bits copied
        out of the file; None for any other."""
        return BF16(np.array(self._raw(name))) if self.bf16_kept(name) else None

    def _fp8(self, name: str):
        """An FP8 weight kept 8-bit (a QuantTensor of mode fp8), or float32 when its input
        size is not a multiple of the block (such a weight is dequantized)."""
        from hpcmac.llm.model import fp8

        f, _, info = self._info(name)
        if info["dtype"] != "F8_E4M3":
            raise UsageError(f"{f}: tensor {name} has a weight_scale_inv but dtype "
                             f"{info['dtype']}; expected F8_E4M3")
        codes, sinv = self._raw(name), self._float(name + "_scale_inv")
        block = self.fp8_block()
        if codes.ndim != 2:
            raise UsageError(f"{f}: tensor {name}: expected a 2-D FP8 weight, found shape "
                             f"{list(codes.shape)}")
        want = [-(-d // block) for d in codes.shape]
        if list(sinv.shape) != want:
            raise UsageError(f"{f}: tensor {name}_scale_inv has shape {list(sinv.shape)}; "
                             f"expected {want} (blocks of {block} x {block})")
        if codes.shape[1] % block:  # a last partial block of inputs: float32
            return fp8.dequantize(codes, sinv, block)
        return fp8.from_blocks(np.array(codes), sinv, block, f"fp8 e4m3 b{block}")

    def _packed_int(self, name: str) -> QuantTensor:
        """A compressed-tensors pack-quantized weight as MLX affine, exactly: its words are
        MLX's (codes ``q + 2^(bits-1)`` little-endian in 32-bit words), ``w = s * q`` is
        ``s * code + (-2^(bits-1) s)``, every product and sum exact (a 16-bit scale)."""
        _, bits, group = self.quant_format(name)
        words = self._raw(self._packed[name])
        scales = self._float(name + "_scale")
        want = (*words.shape[:-1], words.shape[-1] * 32 // bits // group)
        if tuple(scales.shape) != want:
            raise UsageError(f"{self.path}: tensor {name}_scale has shape {list(scales.shape)};"
                             f" expected {list(want)} for {bits}-bit codes in groups of {group}")
        return QuantTensor(np.ascontiguousarray(words), scales,
                           scales * np.float32(-(1 << (bits - 1))), bits, group,
                           f"compressed-tensors int{bits} g{group}")

    def _quant(self, name: str) -> QuantTensor:
        base = name[:-len("weight")]
        if self.is_fp8(name):
            return self._fp8(name)
        if name in self._packed:
            return self._packed_int(name)
        mode, bits, group = self.quant_format(name)
        words = self._raw(name)
        if words.dtype != np.uint32:
            raise UsageError(f"{self.path}: tensor {name} is quantized (it has scales) but is "
                             f"{words.dtype}, expected U32 packed codes")
        if mode == "mxfp4":  # uint8 E8M0 scales, no biases
            scales, biases = self._raw(base + "scales"), None
            if scales.dtype != np.uint8:
                raise UsageError(f"{self.path}: tensor {base}scales is {scales.dtype}; "
                                 "expected U8 (E8M0) scales for mode mxfp4")
        else:
            scales, biases = self._float(base + "scales"), None
            if self.has(base + "biases"):
                biases = self._float(base + "biases")
        inputs = words.shape[-1] * 32 // bits
        want = (*words.shape[:-1], inputs // group)
        if inputs % group or tuple(scales.shape) != want or (
                biases is not None and tuple(biases.shape) != want):
            got = list(scales.shape) if tuple(scales.shape) != want else list(biases.shape)
            raise UsageError(f"{self.path}: tensor {base}scales/biases has shape {got}; "
                             f"expected {list(want)} for {bits}-bit codes of {inputs} inputs "
                             f"in groups of {group}")
        if mode == "mxfp4":
            return QuantTensor(np.ascontiguousarray(words), np.array(scales), None, bits,
                               group, "mlx mxfp4", "mxfp4")
        if biases is None:
            raise UsageError(f"{self.path}: tensor {base}biases is missing (affine "
                             "quantization needs scales and biases)")
        return QuantTensor(np.ascontiguousarray(words), scales, biases, bits, group,
                           f"mlx q{bits} g{group}")

    def names(self) -> list[str]:
        return list(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of or name in self._mxfp4 or name in self._packed or \
            name in self._mla_split or name in self._oss_split

    def _oss_stored(self, name: str):
        """A gpt-oss expert tensor of mlx-lm's layout (:attr:`_oss_split`) in the stored
        orientation: gate_up_proj (E, 2I, D), the gate and up rows interleaved (2j, 2j+1)
        as transformers' columns are; down_proj (E, D, I); the biases (E, 2I) interleaved
        and (E, D). A QuantTensor where the parts are kept quantized, else float32."""
        parts = [self.get_weight(n) for n in self._oss_split[name]]
        if len(parts) == 1:
            return parts[0]
        g, u = parts
        if isinstance(g, QuantTensor) != isinstance(u, QuantTensor) or \
                tuple(g.shape) != tuple(u.shape):
            raise UsageError(f"{self.path}: tensors {' and '.join(self._oss_split[name])}: "
                             "expected the same shape and format")

        def pairs(a, b):  # (..., n, k) twice -> (..., 2n, k), rows a0 b0 a1 b1 ...
            if a.ndim == 2 and name.endswith("_bias"):  # (E, I): columns
                return np.stack([a, b], axis=-1).reshape(*a.shape[:-1], -1)
            return np.stack([a, b], axis=-2).reshape(*a.shape[:-2], -1, a.shape[-1])

        if isinstance(g, QuantTensor):
            if g.format != u.format:
                raise UsageError(f"{self.path}: tensors {' and '.join(self._oss_split[name])}"
                                 ": expected one quantization format")
            return QuantTensor(pairs(g.words, u.words), pairs(g.scales, u.scales),
                               None if g.biases is None else pairs(g.biases, u.biases),
                               g.bits, g.group, g.source, g.mode)
        return np.ascontiguousarray(pairs(g, u))

    def _kv_b_from_split(self, name: str) -> np.ndarray:
        """kv_b_proj (H*(nope+v), r), float32, rebuilt from mlx-lm's embed_q (H, r, nope)
        and unembed_out (H, v, r) (each dequantized if stored quantized; hpcmac holds
        kv_b_proj in floats: it is absorbed per head, never multiplied as stored)."""
        k_name, v_name = self._mla_split[name]
        k_b, v_b = self.get(k_name), self.get(v_name)
        if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
            raise UsageError(f"{self.path}: tensors {k_name} {list(k_b.shape)} and {v_name} "
                             f"{list(v_b.shape)}: expected (H, r, nope) and (H, v, r)")
        kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # (H, nope+v, r)
        return np.ascontiguousarray(kv.reshape(-1, kv.shape[-1]))

    # -- MXFP4 (gpt-oss's experts) -------------------------------------------------
    def get_weight_t(self, name: str) -> QuantTensor | None:
        """A tensor whose canonical layout is (..., in, out) (transformers' gpt-oss expert
        parameters), kept 4-bit as stored: a QuantTensor (..., out, in) of mode mxfp4;
        None when the file holds it as floats."""
        from hpcmac.llm.model import mxfp4

        if name in self._oss_split and not name.endswith("_bias"):
            w = self._oss_stored(name)
            return w if isinstance(w, QuantTensor) else None
        if name not in self._mxfp4:
            return None
        bname, sname = self._mxfp4[name]
        try:
            return mxfp4.from_blocks(self._raw(bname), self._raw(sname), "mxfp4 blocks")
        except ValueError as exc:
            raise UsageError(f"{self.path}: tensor {bname} / {sname}: {exc}") from None

    def _mxfp4_get(self, name: str) -> np.ndarray:
        """An MXFP4 tensor decoded to float32, laid out as transformers' gpt-oss expert
        parameter: the stored (E, out, in) with its last two axes swapped, (E, in, out)."""
        return np.ascontiguousarray(self.get_weight_t(name).dequantize().swapaxes(-1, -2))

    def quant_layout(self, name: str) -> tuple[int, int] | None:
        """(group, the canonical axis its groups run along) of a tensor kept quantized;
        None for a float one. A tensor-parallel cut of that axis off the groups makes
        the loader dequantize it (see :func:`hpcmac.llm.model.spec.take`)."""
        if name in self._mxfp4 or (name in self._oss_split and
                                   self.is_quantized(self._oss_split[name][0])):
            return (32 if name in self._mxfp4 else
                    self.quant_params(self._oss_split[name][0])[1]), len(self.shape(name)) - 2
        if self.is_quantized(name) and self.stored_nbytes(name) < 4 * self.numel(name):
            return self.quant_params(name)[1], len(self.shape(name)) - 1
        return None

    def _info(self, name: str) -> tuple[Path, int, dict]:
        if name not in self._file_of:
            raise UsageError(f"{self.path}: tensor {name} is missing")
        f = self._file_of[name]
        start, table = self._header(f)
        stored = self._stored.get(name, name)
        if stored not in table:
            raise UsageError(f"{f}: tensor {stored} is missing (the index names this file)")
        info = table[stored]
        if name.endswith(_GDN_CONV) and _mlx_conv(info["shape"]):
            # mlx-lm's sanitized conv (C, K, 1) is Hugging Face's (C, 1, K): the same bytes
            info = {**info, "shape": [info["shape"][0], 1, info["shape"][1]]}
        return f, start, info

    def mlx_lm_sanitized(self) -> bool:
        """Whether the folder holds a Gated DeltaNet model (Qwen3-Next, Qwen3.5) as mlx-lm's
        ``sanitize`` leaves it: its conv1d weights (C, K, 1), and its RMSNorms (not the
        gated one) stored as the forward multiplies by them, ``1 + w``. Both are read here
        as the Hugging Face folder holds them: the conv as (C, 1, K) (the same bytes), each
        such norm as ``w`` (:data:`_MLX_SHIFTED_NORMS`)."""
        if self._sanitized is None:
            self._sanitized = False
            for n, f in self._file_of.items():
                if n.endswith(_GDN_CONV):
                    shape = self._header(f)[1][self._stored.get(n, n)]["shape"]
                    self._sanitized = _mlx_conv(shape)
                    break
        return self._sanitized

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mla_split:  # see _kv_b_from_split
            (h, r, nope), (_, v, _) = (self.shape(n) for n in self._mla_split[name])
            return (h * (nope + v), r)
        if name in self._oss_split:  # see _oss_stored: (E, in, out), the biases (E, out)
            stored, n = self.shape(self._oss_split[name][0]), len(self._oss_split[name])
            if name.endswith("_bias"):
                return (*stored[:-1], stored[-1] * n)
            *lead, out, inp = stored
            return (*lead, inp, out * n)
        if name in self._mxfp4:  # see _mxfp4_get: (E, in, out)
            from hpcmac.llm.model.mxfp4 import logical_shape

            *lead, out, inp = logical_shape(tuple(self._info(self._mxfp4[name][0])[2]["shape"]))
            return (*lead, inp, out)
        shape = tuple(self._info(self._packed.get(name, name))[2]["shape"])
        if self.is_quantized(name) and not self.is_fp8(name):  # (..., out, in), not words
            bits, _ = self.quant_params(name)
            shape = (*shape[:-1], shape[-1] * 32 // bits)
        return shape

    def numel(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64))

    def stored_nbytes(self, name: str) -> int:
        """Bytes ``name`` takes in memory kept as stored, as the numpy backend holds it
        (gpt-oss's MXFP4 experts: as :meth:`get_weight_t` gives them)."""
        if name in self._mxfp4:
            return float_mode_nbytes(self.numel(name), "mxfp4")
        if name in self._oss_split:
            return sum(self.stored_nbytes(n) for n in self._oss_split[name])
        if self.bf16_kept(name):
            return 2 * self.numel(name)
        if self.is_fp8(name):
            block = self.fp8_block()
            return float_mode_nbytes(self.numel(name), "fp8") \
                if self.shape(name)[-1] % block == 0 else 4 * self.numel(name)
        if self.is_quantized(name):  # as the numpy backend holds it (see quant.held_nbytes)
            mode = self.quant_format(name)[0]
            if mode in FLOAT_MODES:
                return float_mode_nbytes(self.numel(name), mode)
            base = name[:-len("weight")]
            size = {"F32": 4, "F16": 2, "BF16": 2}
            parts = ("weight_scale",) if name in self._packed else ("scales", "biases")
            per_group = sum(size.get(self._info(base + p)[2]["dtype"], 4)
                            for p in parts if self.has(base + p))
            return held_nbytes(self.numel(name), *self.quant_params(name), per_group)
        return 4 * self.numel(name)

    def get(self, name: str) -> np.ndarray:
        """The tensor as a float32 array (a fresh copy; only its bytes are read)."""
        return as_float(self.get_weight(name))

    def get_weight(self, name: str):
        """The tensor as stored: a QuantTensor when quantized in a form we keep (MLX
        affine or mxfp4, FP8 with block scales, compressed-tensors integers), else float32
        (gpt-oss's MXFP4 experts decoded, in their canonical layout: see
        :meth:`get_weight_t` for them kept 4-bit)."""
        if name in self._mxfp4:
            return self._mxfp4_get(name)
        if name in self._mla_split:
            return self._kv_b_from_split(name)
        if name in self._oss_split:  # transformers' orientation, (E, in, out)
            w = as_float(self._oss_stored(name))
            return w if name.endswith("_bias") else np.ascontiguousarray(w.swapaxes(-1, -2))
        if self.is_quantized(name):
            return self._quant(name)
        return self._float(name)

    def experts(self, layer: int, which: str, keep_quant: bool = False, module: str = "mlp"):
        """Routed expert weights of one layer, (E, out, in); ``which`` is gate, up or down.

        ``keep_quant``: a QuantTensor stack when mlx-lm stored them quantized
        (``switch_mlp``), else float32. ``module``: the layer's submodule holding them
        (``mlp``; ``block_sparse_moe`` for Mixtral and MiniMax, whose experts are
        ``w1`` (gate), ``w3`` (up), ``w2`` (down); ``experts``: directly under the layer,
        Gemma 4's ``experts.gate_up_proj``).
        """
        switch = f"model.layers.{layer}.{module}.switch_mlp.{which}_proj.weight"
        if self.has(switch):  # mlx-lm's stacked experts
            w = self.get_weight(switch)
            return w if keep_quant else as_float(w)
        prefix = _experts_prefix(layer, module)
        fused = f"{prefix}.gate_up_proj"
        if which in ("gate", "up") and self.has(fused):
            w = self.get(fused)  # (E, 2I, H)
            half = w.shape[1] // 2
            return np.ascontiguousarray(w[:, :half] if which == "gate" else w[:, half:])
        if which == "down" and self.has(f"{prefix}.down_proj"):
            return self.get(f"{prefix}.down_proj")
        leaf = f"{which}_proj"
        if not self.has(f"{prefix}.0.{leaf}.weight"):
            leaf = {"gate": "w1", "up": "w3", "down": "w2"}[which] if \
                self.has(f"{prefix}.0.w1.weight") else leaf  # Mixtral's names
        e = 0
        mats = []
        while self.has(f"{prefix}.{e}.{leaf}.weight"):
            name = f"{prefix}.{e}.{leaf}.weight"
            mats.append(self.get_weight(name) if keep_quant else self.get(name))
            e += 1
        if not mats:
            raise UsageError(f"{self.path}: tensor {prefix}.0.{leaf}.weight is missing")
        if same_format(mats):  # kept quantized (an FP8 release's experts)
            return stack(mats)
        return np.stack([as_float(m) for m in mats])

    def release(self) -> None:
        """Forget the pages read so far (see :func:`release_mapped`)."""
        for m in self._maps.values():
            release_mapped(m)

    def experts_nbytes(self, layer: int, module: str = "mlp") -> int | None:
        """Bytes of one layer's routed experts as held, when stored quantized (None: not
        all three projections are)."""
        held = [self.experts_held(layer, w, module) for w in ("gate", "up", "down")]
        return None if None in held else sum(h[0] for h in held)

    def experts_held(self, layer: int, which: str, module: str = "mlp"
                     ) -> tuple[int, int] | None:
        """(bytes as held, group) of one layer's routed ``which`` projection (gate, up,
        down) when stored quantized: mlx-lm's stacked ``switch_mlp``, or a release's
        experts one tensor each (FP8, compressed-tensors); None otherwise."""
        switch = f"model.layers.{layer}.{module}.switch_mlp.{which}_proj.weight"
        if self.has(switch) and self.is_quantized(switch):
            return self.stored_nbytes(switch), self.quant_params(switch)[1]
        prefix = _experts_prefix(layer, module)
        for leaf in (f"{which}_proj", {"gate": "w1", "up": "w3", "down": "w2"}[which]):
            first = f"{prefix}.0.{leaf}.weight"
            if self.has(first) and (self.is_fp8(first) or first in self._packed):
                total, e = 0, 0
                while self.has(f"{prefix}.{e}.{leaf}.weight"):
                    total += self.stored_nbytes(f"{prefix}.{e}.{leaf}.weight")
                    e += 1
                return total, self.quant_params(first)[1]
        return None


def _experts_prefix(layer: int, module: str) -> str:
    """Where a layer's routed experts are: under ``module`` (``mlp``...), or, for
    ``experts``, directly under the layer (Gemma 4)."""
    if module == "experts":
        return f"model.layers.{layer}.experts"
    return f"model.layers.{layer}.{module}.experts"


#: a Gated DeltaNet layer's conv weight (Hugging Face (C, 1, K), mlx-lm's sanitized (C, K, 1))
_GDN_CONV = ".linear_attn.conv1d.weight"
#: the RMSNorms mlx-lm's sanitize of Qwen3-Next and Qwen3.5 stores as 1 + w
_MLX_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                      "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def _mlx_conv(shape) -> bool:
    """Whether a conv1d weight's shape is mlx-lm's (C, K, 1), K > 1."""
    return len(shape) == 3 and shape[2] == 1 and shape[1] > 1


def open_checkpoint(path_or_name: str | os.PathLike):
    """A :class:`SafetensorsCheckpoint` or :class:`~hpcmac.llm.model.gguf_loader.GGUFCheckpoint`."""
    path = resolve_model(path_or_name)
    if is_gguf(path):
        from hpcmac.llm.model.gguf_loader import GGUFCheckpoint

        return GGUFCheckpoint(path)
    if path.is_file():
        raise UsageError(f"{path}: expected a model folder with config.json or a GGUF file "
                         "(the file does not start with the GGUF magic)")
    return SafetensorsCheckpoint(path)


def stage_nbytes(path_or_ckpt, start: int, end: int, first: bool, last: bool,
                 quantize: int | None = None, group_size: int = 64, shard=None) -> int:
    """Bytes of weights a stage will hold, from file headers only (nothing is read).

    ``path_or_ckpt``: a model path or short name, or a checkpoint already opened
    with :func:`open_checkpoint`. Tensors stored quantized in a form we keep
    (MLX affine and mxfp4, FP8 with block scales, gpt-oss's MXFP4 experts, the
    exact GGUF types) count their quantized bytes as the numpy backend holds
    them, unless a tensor-parallel cut falls off their groups (then float32, as
    loaded); other GGUF types are dequantized to float32 at load (4 bytes a weight); the
    embedding and head stored in bfloat16 count 2 bytes a weight (held so). With
    ``quantize`` bits (MLX backend), every matrix it keeps quantized (input size
    a multiple of ``group_size``, the embedding too; not MLA's absorbed kv_b)
    counts its quantized bytes. ``shard``: this rank's part under tensor
    parallelism (:class:`hpcmac.llm.model.spec.Shard`; its share of each
    tensor). Every tensor's shape is checked against the model's description
    (:func:`hpcmac.llm.model.arch.stage_tensors`), as the loader does. Global: the same on
    every rank.
    """
    from hpcmac.llm.model import arch, spec

    ckpt = path_or_ckpt if hasattr(path_or_ckpt, "numel") else open_checkpoint(path_or_ckpt)
    cfg = ckpt.config()
    shard = shard or spec.full_shard(cfg)
    stored = getattr(ckpt, "stored_nbytes", None)
    held = getattr(ckpt, "experts_held", None)
    total = 0
    for t in arch.stage_tensors(cfg, start, end, first, last):
        if t.name.startswith("model.layers."):  # its layer type's shapes and KV heads
            lcfg = cfg.at(int(t.name.split(".")[2]))
            lshard = spec.layer_shard(shard, lcfg)
        else:
            lcfg, lshard = cfg, shard
        shape = spec.local_shape(t, lcfg, lshard)
        numel = int(np.prod(shape, dtype=np.int64))
        frac = numel / max(1, int(np.prod(t.shape, dtype=np.int64)))
        if spec.is_expert_stack(t):
            parts = t.name.split(".")
            kept = held(int(parts[2]), parts[-1], parts[3]) if held is not None else None
            if kept is not None:  # kept quantized unless cut off its groups
                nbytes, group = kept
                if spec.cut_on_groups(t, lcfg, lshard, group, len(t.shape) - 1):
                    total += nbytes * numel // int(np.prod(t.shape, dtype=np.int64))
                else:
                    total += 4 * numel
                continue
        else:
            found = tuple(ckpt.shape(t.name))
            if found != t.shape:
                raise UsageError(f"{ckpt.path}: tensor {t.name} has shape {list(found)}; "
                                 f"expected {list(t.shape)}")
            bf16 = getattr(ckpt, "bf16_kept", lambda _: False)(t.name)
            if bf16 and not quantize:  # in its 2 bytes (stage._Loader.raw16)
                total += 2 * numel
                continue
            if stored is not None and t.kind == "matrix" and not bf16 and \
                    stored(t.name) < 4 * ckpt.numel(t.name):
                layout = getattr(ckpt, "quant_layout", lambda _: None)(t.name)
                if layout is None or spec.cut_on_groups(t, lcfg, lshard, *layout):
                    total += int(stored(t.name) * frac)  # kept quantized as stored
                else:  # cut off its groups: dequantized at load
                    total += 4 * numel
                continue
        if quantize and t.kind == "matrix" and shape[-1] % group_size == 0:
            total += quantized_nbytes(numel, quantize, group_size)
        else:
            total += 4 * numel
    return int(total)
