"""FP8 E4M3 weights with block scales, as DeepSeek V3.x, Kimi K2, GLM-4.x-FP8, MiniMax M2
and Qwen3-FP8 publish them.

A linear weight ``W`` (out, in) is stored as ``W.weight`` F8_E4M3 (out, in) and
``W.weight_scale_inv`` float32 (ceil(out/b), ceil(in/b)), ``b`` the config's
``quantization_config.weight_block_size`` (128 x 128), so that
``w[o, i] = float(code[o, i]) * scale_inv[o // b, i // b]`` in float32 (what the
releases' own dequantization computes). Kept 8-bit in memory as a
:class:`~hpcmac.llm.model.quant.QuantTensor` of mode ``fp8``: the codes as they
are, and the block's scale repeated over its rows (one float32 per row and 128
inputs: 1.03 bytes a weight). Pure.
"""

from __future__ import annotations

import numpy as np

from hpcmac.llm.model.quant import E4M3_VALUES, QuantTensor

__all__ = ["BLOCK", "E4M3_VALUES", "E4M3_MAX", "from_blocks", "quantize"]
BLOCK = 128


#: the largest finite E4M3 value
E4M3_MAX = 448.0


def from_blocks(codes: np.ndarray, scale_inv: np.ndarray, block: int = BLOCK,
                source: str = "fp8 e4m3 b128"):
    """An FP8 weight (out, in) uint8 codes and its block scales as a QuantTensor (mode
    ``fp8``, groups of ``block`` inputs); ValueError unless ``in`` is a multiple of the
    block and the scales' shape is (ceil(out/block), in/block)."""
    out, inp = codes.shape
    want = (-(-out // block), inp // block)
    if inp % block or tuple(scale_inv.shape) != want:
        raise ValueError(f"codes {list(codes.shape)} and scales {list(scale_inv.shape)}: "
                         f"expected in a multiple of {block} and scales {list(want)}")
    scales = np.repeat(np.asarray(scale_inv, np.float32), block, axis=0)[:out]
    words = np.ascontiguousarray(codes).view(np.uint8).view(np.uint32)
    return QuantTensor(words, np.ascontiguousarray(scales), None, 8, block, source, "fp8")


def dequantize(codes: np.ndarray, scale_inv: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """float32 (out, in) of FP8 codes and block scales, any shape (a last partial block
    too): ``E4M3_VALUES[code] * scale_inv[o // b, i // b]``, one float32 rounding (what
    :meth:`QuantTensor.dequantize` gives for a weight kept 8-bit)."""
    out, inp = codes.shape
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), block, 0), block, 1)
    return E4M3_VALUES[codes] * s[:out, :inp]


def quantize(w: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 (out, in) -> (E4M3 codes (out, in) uint8, scale_inv (ceil(out/b), ceil(in/b))
    float32) as DeepSeek's release does: per block ``s = amax / 448``, codes
    ``float8_e4m3fn(w / s)`` (round to nearest even, by torch)."""
    import torch

    out, inp = w.shape
    nb0, nb1 = -(-out // block), -(-inp // block)
    pad = np.zeros((nb0 * block, nb1 * block), np.float32)
    pad[:out, :inp] = w
    blk = pad.reshape(nb0, block, nb1, block)
    amax = np.abs(blk).max(axis=(1, 3))
    s = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    x = torch.from_numpy(np.ascontiguousarray(blk / s[:, None, :, None]).reshape(pad.shape))
    codes = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()[:out, :inp]
    return np.ascontiguousarray(codes), s
