"""Quantized weights kept quantized: one in-memory form, MLX's, in three modes.

A :class:`QuantTensor` is a weight (..., out, in) stored as MLX stores it
(``mx.quantize``, mlx-lm's ``-q``, mlx-community checkpoints): integer codes
``q`` in ``[0, 2**bits)`` packed little-endian into ``uint32`` words along the
input axis, and one scale per ``group`` inputs along each row. The ``mode`` says
what a code means:

* ``affine`` (MLX's default): a float32 ``scale`` and ``bias`` per group,

      w[..., o, i] = scales[..., o, i // group] * q[..., o, i] + biases[..., o, i // group]

  computed in float32 (the product, then the sum, each rounded once: exactly what
  ``mx.dequantize`` does);
* ``mxfp4`` (OCP microscaling FP4: gpt-oss's ``*_blocks``/``*_scales``, MLX's
  ``mode: mxfp4``, GGUF's MXFP4): 4-bit E2M1 codes (:data:`FP4_VALUES`), groups
  of 32, ``scales`` uint8 E8M0, ``w = FP4_VALUES[q] * 2**(scale - 127)`` (exact);
* ``fp8`` (DeepSeek's FP8 releases: e4m3 with a float32 ``weight_scale_inv`` per
  128 x 128 block): 8-bit E4M3 codes (:data:`E4M3_VALUES`), groups of 128 along a
  row, ``scales`` float32 per row and group (the block's scale repeated over its 128
  rows), ``w = E4M3_VALUES[q] * scale`` (one rounding, as the release's own
  dequantization in float32).

``biases`` is None in the two float modes. Both backends take this form: MLX multiplies the
packed words with ``mx.quantized_matmul``; numpy repacks them for its compiled
kernels (:mod:`hpcmac.llm.model.qkernels`). GGUF block formats that map onto it
without a second rounding are converted by :mod:`hpcmac.llm.model.gguf_quant`.

Pure numpy: no MLX, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcmac.errors import UsageError

#: bits per weight and group sizes of MLX's affine quantization
BITS = (2, 3, 4, 5, 6, 8)
GROUPS = (32, 64, 128)
#: the 16 E2M1 values by code (sign bit 3): MXFP4's codes
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def e8m0(scales: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 scale bytes -> float32 2^(s - 127), exact (subnormal for s = 0; 255,
    NaN in the format, gives inf)."""
    return np.ldexp(np.float32(1.0), np.asarray(scales).astype(np.int32) - 127)


def _e4m3_values() -> np.ndarray:
    """float32 of each of the 256 E4M3 ("fn": no infinities, S.1111.111 NaN) codes."""
    c = np.arange(256, dtype=np.int32)
    e, m = (c >> 3) & 15, (c & 7).astype(np.float32)
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((c & 127) == 127, np.nan, mag)
    return np.where(c & 128, -mag, mag).astype(np.float32)


#: the float32 value of each E4M3 code: FP8's codes
E4M3_VALUES = _e4m3_values()

#: MLX quantization modes we read ("affine" is MLX's default and mlx-lm's -q; "mxfp4" is
#: mlx-lm's ``--q-mode mxfp4``: 4 bits, groups of 32)
MODES = ("affine", "mxfp4")
#: the in-memory modes (see the module docstring): (bits, group) of the float ones
FLOAT_MODES = {"mxfp4": (4, 32), "fp8": (8, 128)}


def check_format(what: str, bits, group, mode: str = "affine") -> None:
    """One-line UsageError unless (bits, group, mode) is a format we keep quantized."""
    if mode not in MODES:
        raise UsageError(f"{what}: quantization mode {mode!r} is not supported; "
                         f"supported: {', '.join(MODES)} (bits {BITS}, groups {GROUPS})")
    if mode in FLOAT_MODES:
        if (bits, group) != FLOAT_MODES[mode]:
            b, g = FLOAT_MODES[mode]
            raise UsageError(f"{what}: mode {mode!r} with bits {bits}, group_size {group}: "
                             f"expected bits {b}, group_size {g}")
        return
    if bits not in BITS:
        raise UsageError(f"{what}: {bits}-bit quantization is not supported; "
                         f"supported bits: {', '.join(map(str, BITS))}")
    if group not in GROUPS:
        raise UsageError(f"{what}: quantization group size {group} is not supported; "
                         f"supported: {', '.join(map(str, GROUPS))}")


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes (..., n) -> MLX's packed words (..., n * bits / 32) uint32.

    Codes are laid end to end, little-endian, ``bits`` each: code ``j`` holds
    bits ``[j*bits, (j+1)*bits)`` of the row's bit string. ``n * bits`` must be
    a multiple of 32 (always so for the group sizes above).
    """
    q = np.asarray(q)
    n = q.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"pack: {n} codes of {bits} bits do not fill whole uint32 words")
    if bits == 8:
        return np.ascontiguousarray(q.astype(np.uint8)).view(np.uint32)
    if bits in (2, 4):
        per = 8 // bits
        q8 = q.astype(np.uint8).reshape(*q.shape[:-1], n // per, per)
        byte = np.zeros(q8.shape[:-1], np.uint8)
        for j in range(per):
            byte |= q8[..., j] << np.uint8(j * bits)
        return np.ascontiguousarray(byte).view(np.uint32)
    # 3, 5, 6 bits: through the bit string, a row block at a time
    shift = np.arange(bits, dtype=np.uint8)
    bitstr = ((q.astype(np.uint8)[..., None] >> shift) & np.uint8(1)).reshape(*q.shape[:-1], -1)
    return np.ascontiguousarray(np.packbits(bitstr, axis=-1, bitorder="little")).view(np.uint32)


def unpack(words: np.ndarray, bits: int, n: int) -> np.ndarray:
    """MLX's packed words (..., n * bits / 32) -> integer codes (..., n) uint8."""
    b = np.ascontiguousarray(words).view(np.uint8)
    if bits == 8:
        return b[..., :n]
    if bits in (2, 4):
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        out = np.empty((*b.shape[:-1], b.shape[-1], per), np.uint8)
        for j in range(per):
            out[..., j] = (b >> np.uint8(j * bits)) & mask
        return out.reshape(*b.shape[:-1], -1)[..., :n]
    bitstr = np.unpackbits(b, axis=-1, bitorder="little")[..., :n * bits]
    bitstr = bitstr.reshape(*b.shape[:-1], n, bits)
    weight = (1 << np.arange(bits)).astype(np.uint8)
    return (bitstr * weight).sum(axis=-1, dtype=np.uint8)


@dataclass
class QuantTensor:
    """A weight (..., out, in) held in MLX's format (see the module docstring).

    words : (..., out, in * bits / 32) uint32, packed codes
    scales : (..., out, in / group): float32 (affine, fp8) or uint8 E8M0 (mxfp4)
    biases : (..., out, in / group) float32 (affine), None (mxfp4, fp8)
    bits, group : bits per weight, inputs per scale
    source : where it came from, for ``info`` (e.g. ``"mlx q4 g64"``, ``"gguf Q4_1"``)
    mode : ``affine``, ``mxfp4`` or ``fp8``
    """

    words: np.ndarray
    scales: np.ndarray
    biases: np.ndarray | None
    bits: int
    group: int
    source: str = ""
    mode: str = "affine"

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.words.shape[:-1], self.words.shape[-1] * 32 // self.bits)

    @property
    def ndim(self) -> int:
        return self.words.ndim

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes + self.scales.nbytes +
                   (0 if self.biases is None else self.biases.nbytes))

    @property
    def format(self) -> tuple:
        """(mode, bits, group): tensors of one format concatenate into one."""
        return self.mode, self.bits, self.group

    def codes(self) -> np.ndarray:
        """The integer codes (..., out, in) uint8."""
        return unpack(self.words, self.bits, self.shape[-1])

    def dequantize(self) -> np.ndarray:
        """float32 (..., out, in), bit for bit what ``mx.dequantize`` gives (fp8: what
        the release's float32 dequantization gives, ``float(code) * scale``)."""
        codes = self.codes()
        if self.mode == "mxfp4":
            q, s = FP4_VALUES[codes], e8m0(self.scales)
        elif self.mode == "fp8":
            q, s = E4M3_VALUES[codes], self.scales
        else:
            q, s = codes.astype(np.float32), self.scales
        q = q.reshape(*q.shape[:-1], -1, self.group)  # (..., out, G, group)
        w = s[..., None] * q
        if self.biases is not None:
            w += self.biases[..., None]
        return w.reshape(self.shape)

    def map(self, fn) -> QuantTensor:
        """The same format with ``fn`` applied to words, scales and biases alike (a
        selection along a leading axis)."""
        return QuantTensor(fn(self.words), fn(self.scales),
                           None if self.biases is None else fn(self.biases),
                           self.bits, self.group, self.source, self.mode)

    def __getitem__(self, key) -> QuantTensor:
        """Leading-axis selection (rows, or experts of a stack); never cuts the input axis."""
        if isinstance(key, tuple):
            raise TypeError("QuantTensor: index the leading axis only; use .cols(lo, hi) "
                            "for input columns (on group boundaries)")
        return self.map(lambda a: a[key])

    def cols(self, lo: int, hi: int) -> QuantTensor:
        """Input columns ``[lo, hi)``; both must fall on group boundaries."""
        if lo % self.group or hi % self.group:
            raise ValueError(f"cols: [{lo}, {hi}) does not fall on groups of {self.group}")
        wpg = self.group * self.bits // 32  # words per group
        g0, g1 = lo // self.group, hi // self.group
        return QuantTensor(np.ascontiguousarray(self.words[..., g0 * wpg:g1 * wpg]),
                           np.ascontiguousarray(self.scales[..., g0:g1]),
                           None if self.biases is None else
                           np.ascontiguousarray(self.biases[..., g0:g1]),
                           self.bits, self.group, self.source, self.mode)


def same_format(parts) -> bool:
    """Whether every part is a QuantTensor of one (mode, bits, group)."""
    return all(isinstance(p, QuantTensor) for p in parts) and \
        len({p.format for p in parts}) == 1


class RowBlocks(list):
    """Weights stacked along the output axis that cannot be one array: parts of
    different formats (a mixed-precision checkpoint's 6-bit V beside 4-bit Q
    and K). Each part stays as stored; backends multiply each and concatenate."""


def concat_rows(parts: list, axis: int = 0):
    """Stack weights along an output axis (Q, K, V into QKV; gate and up).

    Float32 parts give one float32 array; quantized parts of one format one
    QuantTensor; anything mixed a :class:`RowBlocks` of the parts as stored
    (2-D weights; a mixed expert stack is dequantized to float32).
    """
    if same_format(parts):
        p0 = parts[0]
        src = p0.source if len({p.source for p in parts}) == 1 else "mixed"
        b = None if p0.biases is None else np.concatenate([p.biases for p in parts], axis=axis)
        return QuantTensor(np.concatenate([p.words for p in parts], axis=axis),
                           np.concatenate([p.scales for p in parts], axis=axis),
                           b, p0.bits, p0.group, src, p0.mode)
    if any(isinstance(p, QuantTensor) for p in parts) and parts[0].ndim == 2 and axis == 0:
        return RowBlocks(parts)
    return np.concatenate([as_float(p) for p in parts], axis=axis)


def stack(parts: list[QuantTensor]) -> QuantTensor:
    """Quantized weights of one format stacked along a new first axis (experts)."""
    p0 = parts[0]
    return QuantTensor(np.stack([p.words for p in parts]), np.stack([p.scales for p in parts]),
                       None if p0.biases is None else np.stack([p.biases for p in parts]),
                       p0.bits, p0.group, p0.source, p0.mode)


class BF16:
    """A float matrix (out, in) held in the checkpoint's bfloat16: its bits as ``uint16``
    (``bits``), 2 bytes a weight. The FP8, MXFP4 and INT4 releases store their embedding
    and head so (:data:`~hpcmac.llm.model.spec.BF16_KEPT`); widened in registers by
    the kernels (:mod:`~hpcmac.llm.model.fvec`), exactly: a bfloat16 is the high half
    of a float32."""

    __slots__ = ("bits",)

    def __init__(self, bits: np.ndarray):
        if bits.dtype != np.uint16:
            raise TypeError("BF16: expected the bits as uint16")
        self.bits = np.ascontiguousarray(bits)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.bits.shape

    @property
    def ndim(self) -> int:
        return self.bits.ndim

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes)

    def dequantize(self) -> np.ndarray:
        """float32, exactly."""
        return (self.bits.astype(np.uint32) << np.uint32(16)).view(np.float32)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` as float32 (len(idx), in) (an embedding lookup)."""
        return (self.bits[idx].astype(np.uint32) << np.uint32(16)).view(np.float32)


def as_float(w) -> np.ndarray:
    """A float32 array of ``w`` (dequantized when quantized, widened when bfloat16)."""
    return w.dequantize() if isinstance(w, (QuantTensor, BF16)) else np.asarray(w, np.float32)


def quantized_nbytes(numel: int, bits: int, group: int) -> int:
    """Bytes of ``numel`` weights held quantized by MLX: packed codes, a float32 scale and
    bias per group."""
    return numel * bits // 8 + (numel // group) * 8


def held_nbytes(numel: int, bits: int, group: int, group_bytes: int) -> int:
    """Bytes of ``numel`` weights as the numpy backend holds them: codes (4 and 8 bits
    packed, the other widths one byte a code) and ``group_bytes`` of scale and bias per
    group (see :func:`compact_scales`)."""
    return (numel * bits // 8 if bits in (4, 8) else numel) + (numel // group) * group_bytes


def compact_scales(scales: np.ndarray, biases: np.ndarray, bits: int):
    """Scales and biases (float32) in the smallest storage that holds them exactly.

    Returns ``(scales, biases, c)``: when every bias is ``c * scale`` with
    ``c = -2**(bits-1)`` exactly (GGUF's symmetric Q8_0, Q4_0, Q5_0) the biases
    are not kept (None) and are derived; the arrays kept are float16 bits (as
    int16: GGUF's ``d`` and ``m``, float16 checkpoints) or bfloat16 bits (as
    uint16) when every value converts back exactly, else float32.
    """
    s = np.asarray(scales, np.float32)
    b = np.asarray(biases, np.float32)
    c = np.float32(-(1 << (bits - 1)))
    if np.array_equal(b, s * c):
        return narrowest(s)[0], None, float(c)
    s16, b16 = narrowest(s, b)
    return s16, b16, 0.0


def narrowest(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """float32 arrays in the smallest storage holding every value exactly, the same for
    all: float16 bits (as int16), bfloat16 bits (as uint16), else float32."""
    f16 = [a.astype(np.float16) for a in arrays]
    if all(np.array_equal(h.astype(np.float32), a) for h, a in zip(f16, arrays)):
        return tuple(np.ascontiguousarray(h).view(np.int16) for h in f16)
    if all(not np.any(a.view(np.uint32) & np.uint32(0xFFFF)) for a in arrays):
        return tuple(np.ascontiguousarray((a.view(np.uint32) >> np.uint32(16)).astype(np.uint16))
                     for a in arrays)
    return tuple(np.ascontiguousarray(a, dtype=np.float32) for a in arrays)


def widen_scales(a: np.ndarray) -> np.ndarray:
    """Stored scales/biases (see :func:`compact_scales`) back to float32, exactly."""
    if a.dtype == np.int16:
        return a.view(np.float16).astype(np.float32)
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return a


def float_mode_nbytes(numel: int, mode: str, backend: str = "numpy") -> int:
    """Bytes of ``numel`` weights held in a float mode: the codes, and per group the
    scale as the backend keeps it (mxfp4: the E8M0 byte on MLX, its bfloat16 on numpy;
    fp8: float32)."""
    bits, group = FLOAT_MODES[mode]
    scale = 4 if mode == "fp8" else (1 if backend == "mlx" else 2)
    return numel * bits // 8 + (numel // group) * scale


def mlx_held_nbytes(t: QuantTensor) -> int:
    """Bytes the MLX backend holds for ``t``: the packed words, and scales and biases both
    (``mx.quantized_matmul`` needs biases) in the narrowest exact storage, one for a whole
    expert stack (``mx.gather_qmm`` takes the stack as one array)."""
    if t.mode in FLOAT_MODES:
        return float_mode_nbytes(int(np.prod(t.shape)), t.mode, "mlx")
    s, b = narrowest(np.asarray(t.scales, np.float32), np.asarray(t.biases, np.float32))
    return int(t.words.nbytes + s.nbytes + b.nbytes)


def numpy_held_nbytes(t: QuantTensor) -> int:
    """Bytes the numpy backend holds for ``t`` (per 2-D matrix, as it stores them)."""
    if t.mode in FLOAT_MODES:
        return float_mode_nbytes(int(np.prod(t.shape)), t.mode)
    if t.ndim == 3:
        return sum(numpy_held_nbytes(t[e]) for e in range(t.shape[0]))
    s, b, _ = compact_scales(t.scales, t.biases, t.bits)
    numel = int(np.prod(t.shape))
    return held_nbytes(numel, t.bits, t.group, 0) + s.nbytes + (0 if b is None else b.nbytes)
