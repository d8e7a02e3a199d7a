"""Checkpoint readers: Hugging Face safetensors folders and GGUF files.

Both expose the same small interface over *canonical* (Hugging Face) tensor
names, so the model never cares where its weights come from:

``ckpt.config()``, ``ckpt.has(name)``, ``ckpt.shape(name)``,
``ckpt.get(name) -> float32 ndarray``, ``ckpt.experts(layer, which) -> (E, out, in)``.

Safetensors files are memory-mapped and only the tensors a caller asks for are
read, so a pipeline stage touches only the bytes of its own layers.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.config import ModelConfig, is_gguf, resolve_model

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


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
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError):
                raise UsageError(f"{index}: expected JSON with a 'weight_map' object") from None
            for name, fname in weight_map.items():
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

    def _header(self, f: Path) -> tuple[int, dict]:
        """(data start offset, tensor table) of one file; checks it is complete."""
        if f not in self._headers:
            if not f.exists():
                raise UsageError(f"{f}: weight file is missing")
            size = f.stat().st_size
            with open(f, "rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise UsageError(f"{f}: truncated (no safetensors header)")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise UsageError(f"{f}: truncated or not safetensors "
                                     f"(header of {n} bytes, file of {size})")
                try:
                    table = json.loads(fh.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise UsageError(f"{f}: corrupt safetensors header") from None
            table.pop("__metadata__", None)
            data_len = size - 8 - n
            for name, info in table.items():
                end = info["data_offsets"][1]
                if end > data_len:
                    raise UsageError(f"{f}: truncated: tensor {name} needs bytes up to "
                                     f"{end}, the file holds {data_len}")
            self._headers[f] = (8 + n, table)
        return self._headers[f]

    def config(self) -> ModelConfig:
        from hpcmac.llm.model.config import load_config

        return load_config(self.path)

    def names(self) -> list[str]:
        return list(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def _info(self, name: str) -> tuple[Path, int, dict]:
        if name not in self._file_of:
            raise UsageError(f"{self.path}: tensor {name} is missing")
        f = self._file_of[name]
        start, table = self._header(f)
        if name not in table:
            raise UsageError(f"{f}: tensor {name} is missing (the index names this file)")
        return f, start, table[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)[2]["shape"])

    def numel(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64))

    def get(self, name: str) -> np.ndarray:
        """The tensor as a float32 array (a fresh copy; only its bytes are read)."""
        f, start, info = self._info(name)
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise UsageError(f"{f}: tensor {name} has dtype {info['dtype']}; "
                             f"expected one of {', '.join(_ST_DTYPES)}")
        if f not in self._maps:
            self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
        lo, hi = info["data_offsets"]
        raw = self._maps[f][start + lo:start + hi].view(dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            return bf16_to_f32(raw)
        return np.array(raw, dtype=np.float32)

    def experts(self, layer: int, which: str) -> np.ndarray:
        """Routed expert weights of one layer, (E, out, in); ``which`` is gate, up or down."""
        prefix = f"model.layers.{layer}.mlp.experts"
        fused = f"{prefix}.gate_up_proj"
        if which in ("gate", "up") and self.has(fused):
            w = self.get(fused)  # (E, 2I, H)
            half = w.shape[1] // 2
            return np.ascontiguousarray(w[:, :half] if which == "gate" else w[:, half:])
        if which == "down" and self.has(f"{prefix}.down_proj"):
            return self.get(f"{prefix}.down_proj")
        e = 0
        mats = []
        while self.has(f"{prefix}.{e}.{which}_proj.weight"):
            mats.append(self.get(f"{prefix}.{e}.{which}_proj.weight"))
            e += 1
        if not mats:
            raise UsageError(f"{self.path}: tensor {prefix}.0.{which}_proj.weight is missing")
        return np.stack(mats)


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


def layer_tensor_names(cfg: ModelConfig, i: int) -> list[str]:
    """Canonical names of the non-expert tensors of layer ``i`` (those that must exist)."""
    p = f"model.layers.{i}."
    names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    a = p + "self_attn."
    if cfg.mla:
        if cfg.q_lora_rank:
            names += [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
        else:
            names += [a + "q_proj.weight"]
        names += [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight",
                  a + "kv_b_proj.weight", a + "o_proj.weight"]
    else:
        names += [a + f"{x}_proj.weight" for x in "qkvo"]
        if cfg.attention_bias:
            names += [a + f"{x}_proj.bias" for x in "qkv"]
        if cfg.o_bias:
            names += [a + "o_proj.bias"]
        if cfg.qk_norm:
            names += [a + "q_norm.weight", a + "k_norm.weight"]
    m = p + "mlp."
    if cfg.is_moe_layer(i):
        names += [m + "gate.weight"]
        if cfg.arch == "deepseek_v3":
            names += [m + "gate.e_score_correction_bias"]
        if cfg.n_shared_experts:
            names += [m + f"shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")]
    else:
        names += [m + f"{x}_proj.weight" for x in ("gate", "up", "down")]
        if cfg.mlp_bias:
            names += [m + f"{x}_proj.bias" for x in ("gate", "up", "down")]
    return names


def stage_tensor_names(cfg: ModelConfig, start: int, end: int, first: bool,
                       last: bool) -> list[str]:
    """Canonical names of the (non-expert) tensors a stage loads."""
    names: list[str] = []
    if first or (last and cfg.tie_embeddings):
        names.append("model.embed_tokens.weight")
    for i in range(start, end):
        names += layer_tensor_names(cfg, i)
    if last:
        names.append("model.norm.weight")
        if not cfg.tie_embeddings:
            names.append("lm_head.weight")
    return names


def stage_nbytes(path_or_ckpt, start: int, end: int, first: bool, last: bool,
                 quantize: int | None = None, group_size: int = 64) -> int:
    """Bytes of weights a stage will hold, from file headers only (nothing is read).

    ``path_or_ckpt``: a model path or short name, or a checkpoint already opened
    with :func:`open_checkpoint`. GGUF tensors are dequantized to float32 at
    load, so a Q4 file's stage takes about 7x its share of the file. With
    ``quantize`` bits (MLX backend), every matrix it keeps quantized (input size
    a multiple of ``group_size``, the embedding too; not MLA's absorbed kv_b)
    counts its quantized bytes. Global: the same on every rank.
    """
    from hpcmac.llm.model.backend import quantized_nbytes

    ckpt = path_or_ckpt if hasattr(path_or_ckpt, "numel") else open_checkpoint(path_or_ckpt)
    cfg = ckpt.config()

    def size(numel: int, inputs: int, matrix: bool) -> int:
        if quantize and matrix and inputs % group_size == 0:
            return quantized_nbytes(numel, quantize, group_size)
        return 4 * numel

    total = 0
    for n in stage_tensor_names(cfg, start, end, first, last):
        shape = tuple(ckpt.shape(n))
        total += size(ckpt.numel(n), shape[-1], len(shape) == 2 and "kv_b_proj" not in n)
    for i in range(start, end):
        if cfg.is_moe_layer(i):
            per = cfg.n_experts * cfg.hidden * cfg.moe_intermediate
            total += 2 * size(per, cfg.hidden, True) + size(per, cfg.moe_intermediate, True)
    return int(total)
