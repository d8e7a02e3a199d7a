"""Quantized weights on the numpy backend: storage and compiled products (numba).

Decode multiplies one or a few activation rows by every weight once per
token, so it is bound by the bytes of the weights (and, at one thread, by the
arithmetic per weight): a 4-bit weight is 1/8 of float32's, if its codes are
turned into products in registers, never into a float32 matrix in memory.
:func:`qmatmul` does that for few rows with the explicit-SIMD kernels of
:mod:`hpcmac.llm.model.qvec`: per output, per group,
``scale * sum(q * x) + bias * sum(x)``, in one pass over the codes, the group
sums of x computed once per call; with float32 activations a chunk of codes
becomes scaled floats once for a block of up to 4 rows (short prompts'
prefill, speculative verification). For more rows (long prefill) it dequantizes a tile
of outputs at a time into a float32 buffer of at most 4 MiB (a small model's
whole matrix) and hands it to BLAS, where the dequantization is paid once per
tile and amortised over the rows; one large product runs BLAS near its peak,
where 32-row tiles ran it at about half (a 230-token SmolLM2 prefill: 0.53 s
against 0.66-0.86 s).

Two kinds of activations:

* float32 (the default): the product equals float32 BLAS on the dequantized
  matrix up to the order of the float32 sums (what the exactness tests check);
* 8-bit (``int8=True``; ``--int8-activations``, ``HPCMAC_INT8_ACTIVATIONS=1``):
  each run of 32 activations is rounded to ``dx * round(x / dx)`` with
  ``dx = max|x| / 127``, as llama.cpp does (its Q8_0/Q8_K activations), and
  the codes are multiplied as integers (``vpdpbusd`` where the CPU has VNNI).
  The result is the product of the dequantized matrix with the *rounded*
  activations, up to float32 sums; it differs from the float32 product by at
  most ``sum_g dx_g / 2 * sum_{i in g} |w_oi|`` per output
  (:func:`int8_error_bound`).

Storage (:class:`NQWeight`), as small as the format allows:

* codes: 8 bits one per byte; 2, 3, 5 and 6 bits widened to one byte per code
  (still 4x smaller than float32); 4 bits two per byte, within each run of 32
  codes byte ``j`` holding codes ``j`` (low nibble) and ``j + 16`` (high), as
  GGUF's Q4_0 stores them;
* scales and biases in 16 bits where that is exact, checked on the values:
  float16 (every GGUF ``d`` and ``m``; mlx-community's float16 checkpoints) or
  bfloat16 (bfloat16 checkpoints), else float32;
* no biases at all for the symmetric types, whose bias is a fixed multiple of
  the scale (GGUF Q8_0: ``-128 d``, Q4_0: ``-8 d``, Q5_0: ``-16 d``): the kernel
  derives it. Q8_0 and Q4_0 are then held in exactly the file's bytes.
"""

from __future__ import annotations

import os

import numpy as np

from hpcmac.llm.model.quant import (
    E4M3_VALUES,
    FP4_VALUES,
    QuantTensor,
    compact_scales,
    unpack,
    widen_scales,
)

#: rows of x above which a product goes through dequantized tiles and BLAS: 8-bit
#: activations and FP8 codes (their kernels decode the codes again for each row), and
#: the bfloat16 panels (:mod:`~hpcmac.llm.model.fvec`)
GEMM_ROWS = 32
#: the same for float32 activations on affine and MXFP4 codes (``qvec.F32_BLOCKED``),
#: whose kernel decodes a chunk of codes once for 4 rows: measured on the whole SmolLM2
#: Q4_1 model, one thread (load 25), the kernel took 0.51x the tiles' time at 32 rows
#: and 0.81x at 64 (``python -m hpcmac.bench.llm --rows``)
BLOCK_ROWS = 64
#: output rows dequantized per tile on the BLAS path: at least TILE, more while the
#: float32 tile stays within TILE_BYTES
TILE = 32
TILE_BYTES = 4 << 20
#: the environment switch for 8-bit activations (see the module docstring)
INT8_ENV = "HPCMAC_INT8_ACTIVATIONS"

_kernels = None


def aligned(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A C-contiguous copy of ``a`` whose data starts on an ``align``-byte boundary (a
    cache line). The kernels read 64 bytes of codes at a time: from a heap array that
    is only 16-byte aligned, three of every four loads span two cache lines
    (measured: 8-bit activations on Q8_0 ran ~25% slower in a loaded model than on the
    same matrices allocated page-aligned)."""
    if a.ctypes.data % align == 0 and a.flags.c_contiguous:
        return a
    buf = np.empty(a.nbytes + align, np.uint8)
    off = -buf.ctypes.data % align
    out = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def int8_default() -> bool:
    """Whether ``HPCMAC_INT8_ACTIVATIONS`` asks for 8-bit activations (default: no)."""
    return os.environ.get(INT8_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _compile():
    """The numba kernels, compiled (or loaded from numba's cache) on first use."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import numba as nb

    from hpcmac.llm.model.qvec import F32_BLOCKED, mv_f32, mv_i8, quantize_x

    opts = dict(cache=True, nogil=True, boundscheck=False)

    @nb.njit(**opts)  # no fastmath: scale * q + bias rounded as MLX's dequantize does
    def deq(q, s, b, kind, table, w):  # q rows (n, bytes); s, b (n, G) f32 -> w (n, K)
        n, K = w.shape
        group = K // s.shape[1]
        for o in range(n):
            for c in range(K // 32):
                g = c * 32 // group
                sc = s[o, g]
                bi = b[o, g]
                if kind == 1 or kind == 2:  # byte j: codes j (low nibble) and j + 16 (high)
                    for j in range(16):
                        byte = np.int32(q[o, c * 16 + j])
                        w[o, c * 32 + j] = sc * table[byte & np.int32(15)] + bi
                        w[o, c * 32 + 16 + j] = sc * table[byte >> np.int32(4)] + bi
                else:
                    for j in range(32):
                        w[o, c * 32 + j] = sc * table[np.int32(q[o, c * 32 + j])] + bi

    _kernels = dict(mv_f32=mv_f32, mv_i8=mv_i8, quantize_x=quantize_x, deq=deq,
                    f32_blocked=F32_BLOCKED)
    return _kernels


#: the value of each code, by kernel kind (see :mod:`~hpcmac.llm.model.qvec`): the affine
#: integers; E2M1 doubled; E4M3 over 2^8 (the scales carry the factors 1/2 and 2^8)
_TABLES = {0: np.arange(256, dtype=np.float32), 1: np.arange(256, dtype=np.float32),
           2: np.concatenate([FP4_VALUES * 2, np.zeros(240, np.float32)]),
           3: E4M3_VALUES / np.float32(256)}


def _mode_scales(t: QuantTensor) -> tuple[int, np.ndarray]:
    """(kernel kind, scales as the kernel reads them) of a float-mode tensor: MXFP4's
    E8M0 s as the bfloat16 bits of 2^(s - 128) (exact, subnormals too); FP8's float32
    scales times 2^8 (exact)."""
    if t.mode == "mxfp4":
        f = np.ldexp(np.float32(1.0), np.asarray(t.scales).astype(np.int32) - 128)
        return 2, np.ascontiguousarray((f.astype(np.float32).view(np.uint32)
                                        >> np.uint32(16)).astype(np.uint16))
    return 3, np.ascontiguousarray(np.asarray(t.scales, np.float32) * np.float32(256))


class NQWeight:
    """A quantized weight (out, in) for the numpy backend (see the module docstring).

    ``kind``: what a code means to the kernels (:mod:`~hpcmac.llm.model.qvec`): 0, 1
    affine (bytes, nibbles), 2 MXFP4, 3 FP8."""

    __slots__ = ("q", "scales", "biases", "bias_c", "bits", "group", "n", "k", "source",
                 "kind", "limits")

    def __init__(self, t: QuantTensor):
        #: :func:`row_limit` for float32 and for 8-bit activations, set by the first
        #: :func:`qmatmul` (None until then): the choice made once a weight, not a call
        self.limits = None
        if t.ndim != 2:
            raise ValueError("NQWeight: expected a 2-D weight")
        self.n, self.k = t.shape
        self.bits, self.group, self.source = t.bits, t.group, t.source
        self.kind = 1 if t.bits == 4 else 0
        if t.mode != "affine":
            self.kind, self.scales = _mode_scales(t)
            self.bias_c = 0.0
            self.biases = np.empty((0, self.scales.shape[1]), self.scales.dtype)
        if t.bits == 8:
            self.q = aligned(np.asarray(t.words).view(np.uint8).reshape(self.n, self.k))
        else:
            codes = unpack(t.words, t.bits, self.k)  # (out, in) one byte per code
            if t.bits == 4:  # runs of 32: byte j = code j | code j + 16 << 4
                c = codes.reshape(self.n, -1, 2, 16)
                codes = (c[:, :, 0] | (c[:, :, 1] << np.uint8(4))).reshape(self.n, -1)
            self.q = aligned(codes)
        if t.mode != "affine":
            return
        self.scales, b, self.bias_c = compact_scales(t.scales, t.biases, t.bits)
        # derived biases: an empty array tells the kernels to use bias_c * scale
        self.biases = b if b is not None else np.empty((0, self.scales.shape[1]),
                                                       self.scales.dtype)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scales.nbytes + self.biases.nbytes)

    def scales_biases(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 scales and biases of rows ``[lo, hi)``."""
        s = widen_scales(self.scales[lo:hi])
        if not self.biases.shape[0]:
            return s, s * np.float32(self.bias_c)
        return s, widen_scales(self.biases[lo:hi])

    def dequantize_rows(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` as float32 (hi - lo, in)."""
        w = out if out is not None else np.empty((hi - lo, self.k), np.float32)
        s, b = self.scales_biases(lo, hi)
        _compile()["deq"](self.q[lo:hi], s, b, self.kind, _TABLES[self.kind], w)
        return w

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` dequantized (an embedding lookup): (len(idx), in) float32."""
        out = np.empty((len(idx), self.k), np.float32)
        for j, i in enumerate(np.asarray(idx, np.int64)):
            self.dequantize_rows(int(i), int(i) + 1, out[j:j + 1])
        return out


def row_limit(w: NQWeight, int8: bool = False) -> int:
    """The most activation rows :func:`qmatmul` multiplies by ``w`` through the kernels:
    ``BLOCK_ROWS`` for float32 activations on the kinds whose kernel takes blocks of rows
    (``qvec.F32_BLOCKED``: affine and MXFP4 codes), ``GEMM_ROWS`` for the rest."""
    int8 = int8 and w.kind < 2
    return BLOCK_ROWS if not int8 and w.kind in _compile()["f32_blocked"] else GEMM_ROWS


def kernel_matmul(x: np.ndarray, w: NQWeight, int8: bool = False) -> np.ndarray:
    """``x @ W.T`` through the explicit-SIMD kernels whatever the rows (see :func:`qmatmul`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    int8 = int8 and w.kind < 2
    y = np.empty((x.shape[0], w.n), np.float32)
    _compile()["mv_i8" if int8 else "mv_f32"](w.q, w.scales, w.biases, x, y, w.group,
                                              w.kind, w.bias_c)
    return y


def tiled_matmul(x: np.ndarray, w: NQWeight) -> np.ndarray:
    """``x @ W.T`` through dequantized tiles and BLAS whatever the rows (see :func:`qmatmul`)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], w.n), np.float32)
    tile = max(TILE, min(w.n, TILE_BYTES // (4 * w.k)))
    buf = np.empty((min(tile, w.n), w.k), np.float32)
    for lo in range(0, w.n, tile):
        hi = min(lo + tile, w.n)
        t = w.dequantize_rows(lo, hi, buf[:hi - lo])
        np.matmul(x, t.T, out=y[:, lo:hi])
    return y


def qmatmul(x: np.ndarray, w: NQWeight, int8: bool = False) -> np.ndarray:
    """``x @ W.T`` for a quantized weight: x (M, in) float32 -> (M, out) float32.

    ``int8``: round the activations to 8 bits per run of 32 first (see the module
    docstring); only up to ``GEMM_ROWS`` rows (decode), and affine codes only: more rows
    (prefill) and the MXFP4 and FP8 codes multiply float32. The kernels take up to
    :func:`row_limit` rows (``BLOCK_ROWS`` for float32 activations on affine and MXFP4
    codes, ``GEMM_ROWS`` for the rest); more go through dequantized tiles and BLAS.
    """
    lim = w.limits
    if lim is None:
        lim = w.limits = (row_limit(w), row_limit(w, True))
    if x.shape[0] <= lim[1 if int8 else 0]:
        return kernel_matmul(x, w, int8)
    return tiled_matmul(x, w)


def quantize_activations(x: np.ndarray, group: int = 32):
    """The 8-bit activations the ``int8`` kernels multiply: codes (M, K) int8, scales
    (M, K/32) float32 and the group sums of ``dx * xq`` (M, K/group)."""
    return _compile()["quantize_x"](np.ascontiguousarray(x, dtype=np.float32), group)


def int8_error_bound(x: np.ndarray, w: NQWeight) -> np.ndarray:
    """Per output, the most 8-bit activations can move ``x @ W.T`` (M, out):
    ``sum_c dx_c / 2 * sum_{i in c} |w_oi|`` (each rounded activation is within half
    its chunk's step of the true one; float32 summation error not included)."""
    _, dx, _ = quantize_activations(x, w.group)
    aw = np.abs(w.dequantize_rows(0, w.n)).reshape(w.n, -1, 32).sum(axis=-1)  # (out, C)
    return (dx.astype(np.float64) / 2) @ aw.T.astype(np.float64)
