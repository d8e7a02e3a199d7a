"""MXFP4 (OCP microscaling FP4): E2M1 codes and E8M0 power-of-two scales, per 32 weights.

As gpt-oss's safetensors store it, a tensor ``X`` of shape (..., out, in) is
``X_blocks`` (..., out, in/32, 16) uint8, two 4-bit E2M1 codes a byte (the low
nibble first), and ``X_scales`` (..., out, in/32) uint8, one power-of-two scale
per 32 inputs (E8M0: 2^(s - 127)). Those bytes are MLX's own ``mode="mxfp4"``
layout (4-bit codes packed little-endian, uint8 scales), so :func:`from_blocks`
is a view: the weight stays 4-bit (:class:`~hpcmac.llm.model.quant.QuantTensor`,
mode ``mxfp4``). Every value is exact in float32. Pure.
"""

from __future__ import annotations

import numpy as np

from hpcmac.llm.model.quant import FP4_VALUES, QuantTensor, e8m0

__all__ = ["FP4_VALUES", "GROUP", "e8m0", "from_blocks", "dequantize", "quantize"]
GROUP = 32


def logical_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """(..., out, in) of blocks (..., out, in/32, 16)."""
    return (*blocks_shape[:-2], blocks_shape[-2] * blocks_shape[-1] * 2)


def check(blocks: np.ndarray, scales: np.ndarray) -> None:
    """ValueError unless ``blocks`` (..., out, G, 16) and ``scales`` (..., out, G) are uint8
    of matching shapes."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"expected uint8 blocks and scales, found {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {list(blocks.shape)} and scales {list(scales.shape)}: "
                         f"expected (..., out, G, {GROUP // 2}) and (..., out, G)")


def from_blocks(blocks: np.ndarray, scales: np.ndarray, source: str = "mxfp4") -> QuantTensor:
    """gpt-oss's blocks and scales as a QuantTensor (mode ``mxfp4``) of (..., out, in),
    the bytes as they are (a copy into memory, no decoding)."""
    check(blocks, scales)
    words = np.ascontiguousarray(blocks).reshape(*blocks.shape[:-2], -1).view(np.uint32)
    return QuantTensor(words, np.ascontiguousarray(scales), None, 4, GROUP, source, "mxfp4")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Float32 (..., out, in) of ``blocks`` (..., out, G, 16) uint8 and ``scales``
    (..., out, G) uint8; ValueError when the shapes disagree."""
    return from_blocks(blocks, scales).dequantize()


def quantize(w: np.ndarray):
    """float32 (..., out, in) (in a multiple of 32) -> (codes (..., out, in) uint8, E8M0
    scales (..., out, in/32) uint8): the scale 2^(floor(log2 amax) - 2) as the OCP spec
    and llama.cpp choose it, each code the nearest E2M1 value (fixtures and tests)."""
    g = w.reshape(*w.shape[:-1], -1, GROUP).astype(np.float32)
    amax = np.abs(g).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2 + 127, 0)
    e = np.clip(e, 0, 254).astype(np.uint8)
    x = g / e8m0(e)[..., None]
    codes = np.abs(x[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    return codes.reshape(w.shape), e
