"""MXFP4 (OCP microscaling FP4) as gpt-oss's safetensors store it: decoding to float32.

A tensor ``X`` of shape (..., out, in) is stored as ``X_blocks`` (..., out, in/32, 16)
uint8, two 4-bit E2M1 codes a byte (the low nibble first), and ``X_scales`` (..., out,
in/32) uint8, one power-of-two scale per 32 inputs (E8M0: 2^(s - 127)). Every value is
exact in float32. Pure.
"""

from __future__ import annotations

import numpy as np

#: the 16 E2M1 values by code (sign bit 3)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
GROUP = 32


def logical_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """(..., out, in) of blocks (..., out, in/32, 16)."""
    return (*blocks_shape[:-2], blocks_shape[-2] * blocks_shape[-1] * 2)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Float32 (..., out, in) of ``blocks`` (..., out, G, 16) uint8 and ``scales``
    (..., out, G) uint8; ValueError when the shapes disagree."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"expected uint8 blocks and scales, found {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"blocks {list(blocks.shape)} and scales {list(scales.shape)}: "
                         f"expected (..., G, {GROUP // 2}) and (..., G)")
    out = np.empty((*blocks.shape[:-1], GROUP), dtype=np.float32)  # (..., G, 32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out *= np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127)[..., None]
    return out.reshape(logical_shape(blocks.shape))
