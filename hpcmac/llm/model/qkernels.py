"""Compiled kernels for quantized weights on the numpy backend (numba).

Decode multiplies one or a few activation rows by every weight once per
token, so it is bound by the bytes of the weights: a 4-bit weight is 1/8 of
float32's, if its codes are turned into products in registers, never into a
float32 matrix in memory. :func:`qmatmul` does that for few rows: per output,
per group, ``scale * sum(q * x) + bias * sum(x)``, in one pass over the codes
(LLVM vectorises the inner loop; no per-element Python, no numpy temporaries).
For more rows (prefill) it dequantizes a tile of outputs at a time into a
float32 buffer of at most 4 MiB (a small model's whole matrix) and hands it to
BLAS, where the dequantization is paid once per tile and amortised over the
rows; one large product runs BLAS near its peak, where 32-row tiles ran it at
about half (a 230-token SmolLM2 prefill: 0.53 s against 0.66-0.86 s).

Storage (:class:`NQWeight`): 4-bit codes as MLX packs them (byte ``k`` holds
codes ``2k`` in its low and ``2k+1`` in its high nibble); 8-bit codes one per
byte; 2, 3, 5 and 6 bits are widened to one byte per code at load (still 4x
smaller than float32). Within a row the bytes are reordered group-major to
byte-major, (groups, bytes) -> (bytes, groups), so that the inner loop runs
across groups: each group's partial sum stays in its own vector lane, and a
row needs one horizontal reduction instead of one per group (a group of 32
4-bit weights is a single 16-byte vector, whose reduction would cost as much
as its products). Scales and biases are float32, one per group.

Reductions run in float32 with reassociation allowed (``fastmath``): the
result differs from float32 BLAS on the dequantized matrix by rounding only.
"""

from __future__ import annotations

import numpy as np

from hpcmac.llm.model.quant import QuantTensor, unpack

#: rows of x above which a product goes through dequantized tiles and BLAS
GEMM_ROWS = 16
#: output rows dequantized per tile on the BLAS path: at least TILE, more while the
#: float32 tile stays within TILE_BYTES
TILE = 32
TILE_BYTES = 4 << 20

_kernels = None


def _compile():
    """The numba kernels, compiled (or loaded from numba's cache) on first use."""
    global _kernels
    if _kernels is not None:
        return _kernels
    import numba as nb

    opts = dict(cache=True, fastmath=True, nogil=True, boundscheck=False)

    @nb.njit(**opts)
    def mv4(xe, xo, xs, q, s, b, y):
        # q (out, hg, G) uint8, byte k of every group side by side; xe/xo (M, hg, G):
        # even/odd inputs laid out the same way. The inner loop runs across the G
        # groups of a row (vectorised), so a group's partial sum needs no horizontal
        # reduction; one reduction per row at the end.
        M = xe.shape[0]
        out, hg, G = q.shape
        t = np.empty(G, np.float32)
        for o in range(out):
            for m in range(M):
                for g in range(G):
                    t[g] = 0.0
                for k in range(hg):
                    for g in range(G):
                        c = np.int32(q[o, k, g])  # int32 first: int64 -> float32 is scalar
                        t[g] += np.float32(c & np.int32(15)) * xe[m, k, g] + \
                            np.float32(c >> np.int32(4)) * xo[m, k, g]
                acc = np.float32(0.0)
                for g in range(G):
                    acc += s[o, g] * t[g] + b[o, g] * xs[m, g]
                y[m, o] = acc

    @nb.njit(**opts)
    def mv8(x, xs, q, s, b, y):  # q (out, gs, G) uint8; x (M, gs, G)
        M = x.shape[0]
        out, gs, G = q.shape
        t = np.empty(G, np.float32)
        for o in range(out):
            for m in range(M):
                for g in range(G):
                    t[g] = 0.0
                for k in range(gs):
                    for g in range(G):
                        t[g] += np.float32(np.int32(q[o, k, g])) * x[m, k, g]
                acc = np.float32(0.0)
                for g in range(G):
                    acc += s[o, g] * t[g] + b[o, g] * xs[m, g]
                y[m, o] = acc

    @nb.njit(**opts)
    def mm4(xe, xo, xs, q, s, b, y):
        # a few rows of x: each weight row's codes become floats once (in L1), then
        # every row of x takes its dot products from them
        M = xe.shape[0]
        out, hg, G = q.shape
        wl = np.empty((hg, G), np.float32)
        wh = np.empty((hg, G), np.float32)
        t = np.empty(G, np.float32)
        for o in range(out):
            for k in range(hg):
                for g in range(G):
                    c = np.int32(q[o, k, g])
                    wl[k, g] = np.float32(c & np.int32(15))
                    wh[k, g] = np.float32(c >> np.int32(4))
            for m in range(M):
                for g in range(G):
                    t[g] = 0.0
                for k in range(hg):
                    for g in range(G):
                        t[g] += wl[k, g] * xe[m, k, g] + wh[k, g] * xo[m, k, g]
                acc = np.float32(0.0)
                for g in range(G):
                    acc += s[o, g] * t[g] + b[o, g] * xs[m, g]
                y[m, o] = acc

    @nb.njit(**opts)
    def mm8(x, xs, q, s, b, y):
        M = x.shape[0]
        out, gs, G = q.shape
        w = np.empty((gs, G), np.float32)
        t = np.empty(G, np.float32)
        for o in range(out):
            for k in range(gs):
                for g in range(G):
                    w[k, g] = np.float32(np.int32(q[o, k, g]))
            for m in range(M):
                for g in range(G):
                    t[g] = 0.0
                for k in range(gs):
                    for g in range(G):
                        t[g] += w[k, g] * x[m, k, g]
                acc = np.float32(0.0)
                for g in range(G):
                    acc += s[o, g] * t[g] + b[o, g] * xs[m, g]
                y[m, o] = acc

    @nb.njit(**opts)
    def deq4(q, s, b, lo, hi, w):  # rows [lo, hi) -> w (hi-lo, in) float32
        _, hg, G = q.shape
        for o in range(lo, hi):
            for g in range(G):
                sc = s[o, g]
                bi = b[o, g]
                for k in range(hg):
                    c = np.int32(q[o, k, g])
                    w[o - lo, g * 2 * hg + 2 * k] = sc * np.float32(c & np.int32(15)) + bi
                    w[o - lo, g * 2 * hg + 2 * k + 1] = sc * np.float32(c >> np.int32(4)) + bi

    @nb.njit(**opts)
    def deq8(q, s, b, lo, hi, w):
        _, gs, G = q.shape
        for o in range(lo, hi):
            for g in range(G):
                sc = s[o, g]
                bi = b[o, g]
                for k in range(gs):
                    w[o - lo, g * gs + k] = sc * np.float32(np.int32(q[o, k, g])) + bi

    _kernels = dict(mv4=mv4, mv8=mv8, mm4=mm4, mm8=mm8, deq4=deq4, deq8=deq8)
    return _kernels


class NQWeight:
    """A quantized weight (out, in) for the numpy backend (see the module docstring)."""

    __slots__ = ("q", "scales", "biases", "bits", "group", "n", "k", "source")

    def __init__(self, t: QuantTensor):
        if t.ndim != 2:
            raise ValueError("NQWeight: expected a 2-D weight")
        self.n, self.k = t.shape
        self.bits, self.group, self.source = t.bits, t.group, t.source
        if t.bits in (4, 8):
            q = np.ascontiguousarray(t.words).view(np.uint8)
        else:  # 2, 3, 5, 6 bits: one byte per code
            q = unpack(t.words, t.bits, self.k)
        per_group = q.shape[1] // (self.k // t.group)  # bytes of one group
        # (out, G, bytes) -> (out, bytes, G): byte k of every group side by side
        self.q = np.ascontiguousarray(q.reshape(self.n, -1, per_group).transpose(0, 2, 1))
        self.scales = np.ascontiguousarray(t.scales, dtype=np.float32)
        self.biases = np.ascontiguousarray(t.biases, dtype=np.float32)

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scales.nbytes + self.biases.nbytes)

    @property
    def packed4(self) -> bool:
        return self.bits == 4

    def dequantize_rows(self, lo: int, hi: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``[lo, hi)`` as float32 (hi - lo, in)."""
        kern = _compile()
        w = out if out is not None else np.empty((hi - lo, self.k), np.float32)
        (kern["deq4"] if self.packed4 else kern["deq8"])(self.q, self.scales, self.biases,
                                                         lo, hi, w)
        return w

    def take(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` dequantized (an embedding lookup): (len(idx), in) float32."""
        out = np.empty((len(idx), self.k), np.float32)
        for j, i in enumerate(np.asarray(idx, np.int64)):
            self.dequantize_rows(int(i), int(i) + 1, out[j:j + 1])
        return out


def qmatmul(x: np.ndarray, w: NQWeight) -> np.ndarray:
    """``x @ W.T`` for a quantized weight: x (M, in) float32 -> (M, out) float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m = x.shape[0]
    kern = _compile()
    y = np.empty((m, w.n), np.float32)
    if m <= GEMM_ROWS:
        xg = x.reshape(m, -1, w.group)  # (M, G, group)
        xs = np.ascontiguousarray(xg.sum(axis=-1, dtype=np.float32))
        name = ("mv" if m == 1 else "mm") + ("4" if w.packed4 else "8")
        if w.packed4:  # (M, G, group/2) even and odd inputs -> (M, group/2, G)
            kern[name](np.ascontiguousarray(xg[:, :, 0::2].transpose(0, 2, 1)),
                       np.ascontiguousarray(xg[:, :, 1::2].transpose(0, 2, 1)),
                       xs, w.q, w.scales, w.biases, y)
        else:
            kern[name](np.ascontiguousarray(xg.transpose(0, 2, 1)), xs, w.q, w.scales,
                       w.biases, y)
        return y
    tile = max(TILE, min(w.n, TILE_BYTES // (4 * w.k)))
    buf = np.empty((min(tile, w.n), w.k), np.float32)
    for lo in range(0, w.n, tile):
        hi = min(lo + tile, w.n)
        t = w.dequantize_rows(lo, hi, buf[:hi - lo])
        np.matmul(x, t.T, out=y[:, lo:hi])
    return y
