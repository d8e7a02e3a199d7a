"""GGUF quantized blocks mapped onto MLX's affine format with no second rounding.

Each GGUF block type below stores, per run of 32 weights, integer codes and
a scale/offset that are exactly representable as MLX's ``scale * q + bias``
in float32, with the same float32 operations as the reference dequantizer
(``gguf.quants``, ggml's ``dequantize_row_*``) — so the dequantized weights
are equal bit for bit:

==========  =====  =====  ==========================  ===============================
type        bits   group  scale                       bias
==========  =====  =====  ==========================  ===============================
Q8_0        8      32     d                           -128 d   (codes int8 + 128)
Q4_0        4      32     d                           -8 d
Q4_1        4      32     d                           m
Q5_0        5      32     d                           -16 d
Q5_1        5      32     d                           m
Q4_K        4      32     d * sc  (6-bit sub-scale)   -(dmin * m)  (6-bit sub-min)
Q5_K        5      32     d * sc                      -(dmin * m)
==========  =====  =====  ==========================  ===============================

Why exact: ``d`` is float16 (11 significant bits) and the sub-scales have 6,
so every product ``scale * q`` needs at most 11 + 6 + 5 = 22 bits and is
exact in float32; ``-8 d``, ``-16 d``, ``-128 d`` are exact (powers of two);
and where the reference adds an offset (``d q + m``, ``d sc q - dmin m``) MLX
adds the same float32 bias in the same order, one rounding each. For the
symmetric types (``d (q - 8)``) both sides are exact, so they agree.

MXFP4 (ggml type 39: per 32 weights an E8M0 byte ``e``, then 16 bytes of E2M1 codes
in Q4_0's nibble order; the reference multiplies twice the E2M1 value by
2^(e - 128)) is kept in its own mode, not affine: the same codes reordered into
MLX's nibble order and ``e`` as the scale byte (:class:`QuantTensor` mode
``mxfp4``: ``FP4_VALUES[q] * 2^(e - 127)``, the same float32 value, exact).

Not mappable exactly: Q6_K, Q2_K and Q3_K scale runs of **16** weights with
separate 8/4-bit sub-scales, and MLX's smallest group is 32 (two different
scales cannot share one group). Those tensors are dequantized to float32 at
load (:func:`to_quant` returns None), as before.
"""

from __future__ import annotations

import numpy as np

from hpcmac.llm.model.quant import QuantTensor, pack

#: GGUF types kept quantized (exact); others fall back to float32
EXACT = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "MXFP4")
_QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n,) float32 from little-endian float16 bits."""
    return np.ascontiguousarray(b).view(np.float16).reshape(-1).astype(np.float32)


def _nibbles_split(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes of a 32-block (low nibbles = 0..15, high = 16..31) -> (n, 32) codes."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _nibbles_mlx(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes of a 32-block (low nibbles = 0..15, high = 16..31) -> (n, 16) bytes in
    MLX's 4-bit order (byte k holds codes 2k and 2k+1, low nibble first), directly:
    the same bytes as ``pack(_nibbles_split(qs), 4)`` in a quarter of the passes."""
    even, odd = qs[:, 0::2], qs[:, 1::2]
    out = np.empty(qs.shape, np.uint8)
    out[:, :8] = (even & np.uint8(15)) | (odd << np.uint8(4))
    out[:, 8:] = (even >> np.uint8(4)) | (odd & np.uint8(0xF0))
    return out


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes = one uint32 of high bits, bit j for element j -> (n, 32) 0/1 codes."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block, from its 12 bytes."""
    from gguf.quants import Q4_K

    s, m = Q4_K.get_scale_min(sc)
    return s.reshape(sc.shape[0], 8).astype(np.float32), m.reshape(sc.shape[0], 8).astype(
        np.float32)


def _blocks(data: np.ndarray, nbytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, nbytes)


def to_quant(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> QuantTensor | None:
    """A GGUF tensor's raw blocks as a :class:`QuantTensor` of ``shape`` (..., out, in).

    ``data``: the tensor's bytes as stored (any uint8 view of them). Returns
    None for a type that cannot be mapped exactly (see the module docstring).
    """
    if qtype not in EXACT:
        return None
    if qtype == "MXFP4":
        b = _blocks(data, 17)
        words = np.ascontiguousarray(_nibbles_mlx(b[:, 1:]).reshape(*shape[:-1], -1))
        return QuantTensor(words.view(np.uint32), np.ascontiguousarray(
            b[:, 0].reshape(*shape[:-1], shape[-1] // 32)), None, 4, 32, "gguf MXFP4",
            "mxfp4")
    if qtype == "Q8_0":
        b = _blocks(data, 34)
        d = _f16(b[:, :2])
        q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # (n, 32)
        scales, biases, bits = d, d * np.float32(-128.0), 8
    elif qtype == "Q4_0":
        b = _blocks(data, 18)
        d = _f16(b[:, :2])
        q = _nibbles_mlx(b[:, 2:])  # already packed
        scales, biases, bits = d, d * np.float32(-8.0), 4
    elif qtype == "Q4_1":
        b = _blocks(data, 20)
        q = _nibbles_mlx(b[:, 4:])  # already packed
        scales, biases, bits = _f16(b[:, :2]), _f16(b[:, 2:4]), 4
    elif qtype == "Q5_0":
        b = _blocks(data, 22)
        d = _f16(b[:, :2])
        q = _nibbles_split(b[:, 6:]) | (_high_bits(b[:, 2:6]) << np.uint8(4))
        scales, biases, bits = d, d * np.float32(-16.0), 5
    elif qtype == "Q5_1":
        b = _blocks(data, 24)
        q = _nibbles_split(b[:, 8:]) | (_high_bits(b[:, 4:8]) << np.uint8(4))
        scales, biases, bits = _f16(b[:, :2]), _f16(b[:, 2:4]), 5
    else:  # Q4_K, Q5_K: super-blocks of 256 = 8 runs of 32, 6-bit scales and mins
        nb = 144 if qtype == "Q4_K" else 176
        b = _blocks(data, nb)
        n = b.shape[0]
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, mn = _scale_min_k4(b[:, 4:16])
        qs = b[:, -128:].reshape(n, 4, 32)  # chunk c: runs 2c (low nibbles), 2c+1 (high)
        q = np.stack([qs & np.uint8(15), qs >> np.uint8(4)], axis=2).reshape(n, 8, 32)
        bits = 4
        if qtype == "Q5_K":
            qh = b[:, 16:48]  # (n, 32): bit s of byte j is the high bit of run s, element j
            hi = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)
            q = q | (hi << np.uint8(4))
            bits = 5
        scales = (d[:, None] * sc).reshape(-1)  # (n*8,) as the reference: d * sc
        biases = -(dmin[:, None] * mn).reshape(-1)
        q = q.reshape(n * 8, 32)
    out, inp = int(np.prod(shape[:-1])), shape[-1]
    if qtype in ("Q4_0", "Q4_1"):
        words = np.ascontiguousarray(q.reshape(out, inp // 2)).view(np.uint32)
    else:
        words = pack(q.reshape(out, inp), bits)
    words = words.reshape(*shape[:-1], -1)
    return QuantTensor(words, scales.reshape(*shape[:-1], inp // 32).astype(np.float32),
                       biases.reshape(*shape[:-1], inp // 32).astype(np.float32), bits, 32,
                       f"gguf {qtype}")
