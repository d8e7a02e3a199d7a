"""Compute backends for the decoder: numpy (float32, default) and MLX.

The model is written once against the small set of operations here. Scalars
passed into them are Python floats, so float32 arrays stay float32 (a numpy
float64 scalar would silently promote a whole decode step to float64).
"""

from __future__ import annotations

import mmap

import numpy as np

from hpcmac.errors import UsageError
from hpcmac.llm.model.qkernels import NQWeight, qmatmul
from hpcmac.llm.model.quant import (
    BF16,
    BITS,
    GROUPS,
    QuantTensor,
    RowBlocks,
    as_float,
    quantized_nbytes,
)

__all__ = ["quantized_nbytes"]  # re-exported: the planner and tests import it from here

BACKENDS = ("numpy", "mlx")


class Panels:
    """A weight (out, in) stored as contiguous panels (nb, in, r) of r output columns.

    Decode multiplies a few rows of activations by each weight once per token,
    so it is bound by reading the weights. A whole-matrix BLAS gemm with a few
    rows packs the entire weight first (3-4x the memory traffic: 4 sequences
    decoded no faster than 1); a panel of r columns is read once from memory
    and serves every row of x from cache. The last panel is zero-padded. ``w``
    float32, or ``uint16`` bfloat16 bits (a :class:`~hpcmac.llm.model.quant.BF16`'s,
    kept in their 2 bytes and widened by :mod:`~hpcmac.llm.model.fvec`).
    """

    __slots__ = ("p", "n")

    def __init__(self, w: np.ndarray, r: int):
        out, inp = w.shape
        nb = -(-out // r)
        if nb * r != out:
            w = np.concatenate([w, np.zeros((nb * r - out, inp), w.dtype)])
        self.p = np.ascontiguousarray(w.reshape(nb, r, inp).transpose(0, 2, 1))
        self.n = out

    @classmethod
    def of(cls, p: np.ndarray) -> Panels:
        """Panels (nb, in, r) already in this layout, kept as they are (no copy): every
        column a real output, ``nb * r`` of them."""
        w = cls.__new__(cls)
        w.p, w.n = p, p.shape[0] * p.shape[2]
        return w

    @property
    def nbytes(self) -> int:
        return self.p.nbytes

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of the weight (out, in) as float32 (len(idx), in): a tied head's
        panels serve the embedding lookup too (one copy of the matrix held)."""
        r = self.p.shape[2]
        out = self.p[idx // r, :, idx % r]  # (len(idx), in): the index arrays' axis first
        if out.dtype == np.uint16:  # bfloat16 bits: exact widening
            return (out.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return np.ascontiguousarray(out, dtype=np.float32)


class Blocks(list):
    """Backend weights whose outputs are concatenated (a :class:`RowBlocks` as loaded)."""

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self)


class NumpyBackend:
    """float32 numpy on the CPU; matrix products go to the BLAS numpy links."""

    name = "numpy"
    xp = np
    #: columns per panel of a packed weight (see :class:`Panels`); measured here,
    #: 32 is fastest for one row (decode of one sequence), 64 for four rows
    panel = 32

    def __init__(self, int8_activations: bool = False):
        #: quantized weights multiply activations rounded to 8 bits (decode only;
        #: see :mod:`hpcmac.llm.model.qkernels`); float32 weights are unaffected
        self.int8 = bool(int8_activations)

    def asarray(self, a) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def weight(self, w):
        """A weight (out, in) packed for :meth:`linear`; a stack (E, out, in) gives a list.

        A :class:`QuantTensor` stays quantized (:class:`~hpcmac.llm.model.qkernels.NQWeight`,
        multiplied by the compiled kernels)."""
        if isinstance(w, RowBlocks):
            return Blocks([self.weight(p) for p in w])
        if isinstance(w, QuantTensor):
            return [NQWeight(w[e]) for e in range(w.shape[0])] if w.ndim == 3 else NQWeight(w)
        if isinstance(w, BF16):  # bfloat16 panels, 2 bytes a weight
            return Panels(w.bits, self.panel)
        w = np.asarray(w, dtype=np.float32)
        if w.ndim == 3:
            return [Panels(we, self.panel) for we in w]
        return Panels(w, self.panel)

    def index(self, a) -> np.ndarray:
        return np.asarray(a, dtype=np.int64)

    def to_numpy(self, a) -> np.ndarray:
        return a

    def zeros(self, shape) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    def cache_zeros(self, shape) -> np.ndarray:
        """A KV-cache array of zeros whose pages are not transparent huge pages.

        A cache (slots, heads, max_len, head_dim) is touched a few kilobytes at a
        time per (slot, head) as tokens arrive, far apart in memory. Linux with
        transparent huge pages set to ``always`` zeroes a whole 2 MiB page on the
        first touch of each: measured here, the first 35-token prefill of 16
        slots of SmolLM2's 30 layers at 4096 positions took 7.1 s, against 0.09 s
        with 4 KiB pages (``madvise(MADV_NOHUGEPAGE)``). Small arrays and systems
        without the advice get plain zeros.
        """
        n = int(np.prod(shape)) * 4
        advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
        if n < (8 << 20) or advice is None:
            return np.zeros(shape, dtype=np.float32)
        mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mm.madvise(advice)
        except OSError:
            pass
        return np.frombuffer(mm, dtype=np.float32).reshape(shape)

    def rows(self, w, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of a quantized (out, in) weight, dequantized: (len(idx), in) float32."""
        return w.take(idx)

    def linear(self, x: np.ndarray, w: Panels) -> np.ndarray:
        """``x @ W.T`` for a packed weight: x (M, in) -> (M, out)."""
        if isinstance(w, NQWeight):  # kept quantized (first: decode's most calls)
            return qmatmul(x, w, self.int8)
        if isinstance(w, Blocks):
            return np.concatenate([self.linear(x, p) for p in w], axis=-1)
        m = x.shape[0]
        nb, _, r = w.p.shape
        if w.p.dtype == np.uint16:  # bfloat16 panels: widened in registers (few rows), or a
            # float32 tile at a time for BLAS (prefill)
            from hpcmac.llm.model import fvec
            from hpcmac.llm.model.qkernels import GEMM_ROWS

            y = fvec.matvec(x, w.p) if m <= GEMM_ROWS else fvec.widened_matmul(x, w.p)
        elif m == 1:  # one sequence's decode: the streaming kernel (BLAS's per-panel gemv
            # read ~0.7 of sdot's bandwidth, this ~0.9; see hpcmac.llm.model.fvec)
            from hpcmac.llm.model import fvec

            y = fvec.matvec(x, w.p) if r == fvec.WIDTH else \
                np.matmul(x[0], w.p).reshape(1, nb * r)
        else:  # (nb, M, r): a small gemm per panel, looped in C
            y = np.matmul(x, w.p).transpose(1, 0, 2).reshape(m, nb * r)
        return y if w.n == nb * r else y[:, :w.n]

    def sigmoid(self, x):
        return 0.5 * np.tanh(0.5 * x) + 0.5

    def silu(self, x):
        return x * (0.5 * np.tanh(0.5 * x) + 0.5)

    def softmax(self, x, axis: int = -1):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        return e

    def rms_norm(self, x, w, eps: float):
        if x.ndim == 2 and x.shape[0] <= fused_kernels().MAX_ROWS and x.flags.c_contiguous:
            return fused_kernels().rms_norm(x, w, eps)  # decode: one compiled call, not six
        ms = np.einsum("...i,...i->...", x, x)[..., None] * (1.0 / x.shape[-1])
        return x * (1.0 / np.sqrt(ms + eps)) * w

    def add_rms_norm(self, x, a, w, eps: float):
        """``(x + a, rms_norm(x + a))``: a residual add and the norm that follows it."""
        if x.ndim == 2 and x.shape[0] <= fused_kernels().MAX_ROWS and x.flags.c_contiguous and \
                a.flags.c_contiguous:
            return fused_kernels().add_rms_norm(x, a, w, eps)
        x = x + a
        return x, self.rms_norm(x, w, eps)

    def where(self, cond, a, b):
        return np.where(cond, a, b)

    def index_add(self, out, idx, y):
        out[idx] += y  # idx has no repeats within one expert
        return out

    def set(self, arr, key, value):
        arr[key] = value
        return arr

    def eval(self, *arrays) -> None:
        pass

    #: what crossed from the device to the host (see :meth:`MLXBackend.host`): nothing here
    syncs = host_bytes = 0

    def host(self, a, *wait) -> np.ndarray:
        """``a`` as numpy: it is already (the numpy backend has no device)."""
        return a


_FUSED_MODULE = None


def fused_kernels():
    """:mod:`hpcmac.llm.model.fused` (imported on first use: it compiles with numba)."""
    global _FUSED_MODULE
    if _FUSED_MODULE is None:
        from hpcmac.llm.model import fused

        _FUSED_MODULE = fused
    return _FUSED_MODULE


#: weight bits and group sizes MLX's affine quantization takes
QUANT_BITS, QUANT_GROUPS = BITS, GROUPS  # the format's own (hpcmac.llm.model.quant)


def check_quantize(backend: str, bits: int | None, group_size: int = 64) -> None:
    """One-line UsageError unless ``--quantize bits`` / ``--q-group-size`` can be used."""
    if bits is None:
        return
    if bits not in QUANT_BITS:
        raise UsageError(f"--quantize {bits}: expected one of "
                         f"{', '.join(map(str, QUANT_BITS))} bits")
    if group_size not in QUANT_GROUPS:
        raise UsageError(f"--q-group-size {group_size}: expected one of "
                         f"{', '.join(map(str, QUANT_GROUPS))}")
    if backend != "mlx":
        raise UsageError(f"--quantize {bits}: needs --backend mlx (the {backend} backend "
                         "keeps float32 weights)")


class QWeight:
    """A weight (out, in) kept quantized by MLX, multiplied with ``mx.quantized_matmul``:
    affine (``bits`` per weight, one scale and bias per ``group`` inputs) or mxfp4 (MLX's
    own mode: the E2M1 words and E8M0 scales as stored). FP8 (mode ``fp8``): MLX has no
    FP8 matmul; the E4M3 codes (uint8) and the float32 scale per row and 128 inputs are
    held as they are and dequantized at each use (``mx.from_fp8``) before a float32
    matmul."""

    __slots__ = ("wq", "scales", "biases", "bits", "group", "source", "mode")

    def __init__(self, mx, w: np.ndarray | QuantTensor, bits: int, group: int):
        self.mode = w.mode if isinstance(w, QuantTensor) else "affine"
        if self.mode != "affine":  # the codes and scales as stored, no biases
            self.wq = mx.array(np.ascontiguousarray(w.words).view(np.uint8).reshape(w.shape)
                               if self.mode == "fp8" else np.ascontiguousarray(w.words))
            self.scales, self.biases = mx.array(np.ascontiguousarray(w.scales)), None
            self.bits, self.group, self.source = w.bits, w.group, w.source
            mx.eval(self.wq, self.scales)
            return
        if isinstance(w, QuantTensor):  # already quantized: the stored codes, as they are
            from hpcmac.llm.model.quant import narrowest

            # scales and biases in float16/bfloat16 where exact (GGUF's d and m, mlx-community's
            # checkpoints): quantized_matmul gives the same float32 products bit for bit
            s, b = narrowest(np.asarray(w.scales, np.float32), np.asarray(w.biases, np.float32))
            kind = {np.dtype(np.int16): mx.float16, np.dtype(np.uint16): mx.bfloat16}
            self.wq = mx.array(np.ascontiguousarray(w.words))
            self.scales, self.biases = (mx.array(a).view(kind[a.dtype]) if a.dtype in kind
                                        else mx.array(a) for a in (s, b))
            bits, group, self.source = w.bits, w.group, w.source
        else:
            self.wq, self.scales, self.biases = mx.quantize(mx.array(w), group_size=group,
                                                            bits=bits)
            self.source = f"mlx q{bits} g{group}"
        self.bits, self.group = bits, group
        mx.eval(self.wq, self.scales, self.biases)

    @property
    def nbytes(self) -> int:
        return int(self.wq.nbytes + self.scales.nbytes +
                   (0 if self.biases is None else self.biases.nbytes))

    def fp8_float(self, mx, rows=None):
        """The FP8 weight (or its ``rows``) dequantized to float32 (out, in)."""
        wq, sc = (self.wq, self.scales) if rows is None else (self.wq[rows], self.scales[rows])
        w = mx.from_fp8(wq, dtype=mx.float32).reshape(*wq.shape[:-1], -1, self.group)
        return (w * sc[..., None]).reshape(wq.shape)


class MLXBackend:
    """MLX arrays: Metal on Apple silicon, CPU elsewhere (float32).

    With ``bits`` the matrices are kept quantized (as mlx-lm's ``-q``): every
    weight whose input size is a multiple of ``group_size``; the others, the
    norms and the embedding lookup stay float32.
    """

    name = "mlx"

    def __init__(self, bits: int | None = None, group_size: int = 64):
        import mlx.core as mx

        self.mx = mx
        self.xp = mx
        self.bits, self.group_size = bits, group_size
        #: blocking evaluations (each a host sync) and the bytes they brought to the host,
        #: counted by :meth:`host` and :meth:`eval`, the only places the model leaves MLX
        self.syncs = 0
        self.host_bytes = 0

    def host(self, a, *wait) -> np.ndarray:
        """The one counting point of what crosses to the host: evaluates ``a`` with
        ``wait`` (arrays that must be computed too, e.g. the KV cache a step wrote) in one
        blocking evaluation, and returns ``a`` copied into numpy. One sync, ``a.nbytes``
        bytes. A numpy ``a`` is returned as it is, uncounted."""
        if isinstance(a, np.ndarray):
            if wait:
                self.eval(*wait)
            return a
        self.mx.eval(a, *wait)
        out = np.array(a)
        self.syncs += 1
        self.host_bytes += out.nbytes
        return out

    def asarray(self, a):
        """numpy (or a list) -> float32 MLX array, a copy to the device (not a sync); an
        MLX array stays where it is (float32)."""
        if isinstance(a, self.mx.array):
            return a if a.dtype == self.mx.float32 else a.astype(self.mx.float32)
        return self.mx.array(np.ascontiguousarray(a, dtype=np.float32))

    def index(self, a):
        return self.mx.array(np.asarray(a, dtype=np.int32))

    def to_numpy(self, a) -> np.ndarray:
        return np.array(a, dtype=np.float32, copy=False) if isinstance(a, np.ndarray) \
            else self.host(a)

    def zeros(self, shape):
        return self.mx.zeros(shape, dtype=self.mx.float32)

    def weight(self, w):
        """A weight (..., out, in) stored transposed, (..., in, out), or quantized
        (:class:`QWeight`; an expert stack (E, out, in) stays one stack, for
        :meth:`gather_linear`). A :class:`QuantTensor` is kept as stored (never quantized
        a second time)."""
        if isinstance(w, RowBlocks):
            return Blocks([self.weight(p) for p in w])
        if isinstance(w, QuantTensor):
            return QWeight(self.mx, w, w.bits, w.group)
        if isinstance(w, BF16) and not self.bits:  # kept in 2 bytes, (in, out); a float32
            # activation times it is float32 (exact widening)
            return self.mx.array(np.ascontiguousarray(w.bits.T)).view(self.mx.bfloat16)
        w = as_float(w)
        if self.bits and w.shape[-1] % self.group_size == 0:
            return QWeight(self.mx, w, self.bits, self.group_size)
        return self.mx.array(np.ascontiguousarray(np.swapaxes(w, -1, -2)))

    def rows(self, w: QWeight, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` of a quantized (out, in) weight, dequantized: (len(idx), in) float32."""
        return self.host(self.rows_lazy(w, self.mx.array(np.asarray(idx, dtype=np.int32))))

    def rows_lazy(self, w: QWeight, i):
        """:meth:`rows` of an MLX index array ``i``, left in MLX's graph (not evaluated)."""
        f32 = self.mx.float32  # dequantized in float32 (16-bit scales would round the result)
        if w.mode == "fp8":
            out = w.fp8_float(self.mx, i)
        elif w.mode == "mxfp4":  # exact in any float type
            out = self.mx.dequantize(w.wq[i], w.scales[i], None, group_size=w.group,
                                     bits=w.bits, mode="mxfp4").astype(f32)
        else:
            out = self.mx.dequantize(w.wq[i], w.scales[i].astype(f32),
                                     w.biases[i].astype(f32), group_size=w.group, bits=w.bits)
        return out.astype(f32)

    def linear(self, x, wt):
        if isinstance(wt, Blocks):
            return self.mx.concatenate([self.linear(x, p) for p in wt], axis=-1)
        if isinstance(wt, QWeight):
            if wt.mode == "fp8":
                return x @ wt.fp8_float(self.mx).T
            return self.mx.quantized_matmul(x, wt.wq, wt.scales, wt.biases, transpose=True,
                                            group_size=wt.group, bits=wt.bits, mode=wt.mode)
        return x @ wt

    def gather_linear(self, x, wt, idx, sorted_indices: bool = False):
        """``x @ W[idx].T`` for an expert stack: x (..., 1, in), idx expert ids whose shape
        is x's leading axes (or broadcasts with them) -> (..., 1, out). One gathered matmul
        (``mx.gather_mm`` on floats, ``mx.gather_qmm`` on a quantized stack); FP8 (no
        quantized matmul in MLX): the chosen experts dequantized, or all of them when at
        least as many are chosen. ``sorted_indices``: ``idx`` is flat and ascending."""
        mx = self.mx
        if not isinstance(wt, QWeight):
            return mx.gather_mm(x, wt, rhs_indices=idx, sorted_indices=sorted_indices)
        if wt.mode == "fp8":
            if idx.size < wt.wq.shape[0]:  # (n, in, out) the chosen experts, in idx's order
                w = wt.fp8_float(mx, idx.reshape(-1)).swapaxes(-1, -2)
                idx = mx.arange(idx.size, dtype=mx.uint32).reshape(idx.shape)
            else:
                w = wt.fp8_float(mx).swapaxes(-1, -2)
            return mx.gather_mm(x, w, rhs_indices=idx, sorted_indices=sorted_indices)
        return mx.gather_qmm(x, wt.wq, wt.scales, wt.biases, rhs_indices=idx, transpose=True,
                             group_size=wt.group, bits=wt.bits, mode=wt.mode,
                             sorted_indices=sorted_indices)

    def sigmoid(self, x):
        return self.mx.sigmoid(x)

    def silu(self, x):
        return x * self.mx.sigmoid(x)

    def softmax(self, x, axis: int = -1):
        return self.mx.softmax(x, axis=axis, precise=True)

    def rms_norm(self, x, w, eps: float):
        return self.mx.fast.rms_norm(x, w, eps)

    def add_rms_norm(self, x, a, w, eps: float):
        """``(x + a, rms_norm(x + a))``: a residual add and the norm that follows it."""
        x = x + a
        return x, self.rms_norm(x, w, eps)

    def where(self, cond, a, b):
        return self.mx.where(self.mx.array(cond) if isinstance(cond, np.ndarray) else cond, a, b)

    def index_add(self, out, idx, y):
        return out.at[idx].add(y)

    def set(self, arr, key, value):
        arr[key] = value
        return arr

    def eval(self, *arrays) -> None:
        """A blocking evaluation with nothing copied out: counted as a sync (:meth:`host`)."""
        self.mx.eval(*arrays)
        self.syncs += 1


#: glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_allocator_tuned = False


def keep_freed_memory() -> bool:
    """Let glibc's malloc reuse freed memory instead of mapping fresh pages each step.

    A decode step allocates and frees the same arrays again and again (logits,
    the head's output, sampling: hundreds of kilobytes each). By default glibc
    serves anything over 128 KiB with a fresh mmap and unmaps it on free, so
    each step pays page faults on every such array, and it trims the heap's
    top when freed memory there passes a threshold. Measured on SmolLM2 at 2
    ranks with 2 sequences per micro-batch: a stage took 16-18 ms per
    micro-batch instead of 11-12 ms. Arrays under 32 MiB now come from the
    heap, and the heap keeps up to 1 GiB of freed memory at its top;
    :func:`release_freed_memory` (called once a stage is loaded) hands back
    what loading left. Returns whether it applied (glibc only; elsewhere
    nothing changes). Once per process.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        ok = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
            mallopt(_M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
        return False
    _allocator_tuned = ok
    return ok


def release_mapped(arr) -> None:
    """Drop the pages of a memory-mapped file that this process has read from its
    resident set (``madvise(MADV_DONTNEED)``): once a stage has copied what it
    needs, a file's pages would otherwise count in RSS although the kernel may
    reclaim them. Reading the array again simply reads the file again."""
    import mmap

    mm = getattr(arr, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mm is not None and advice is not None:
        try:
            mm.madvise(advice)
        except (OSError, ValueError):
            pass


def release_freed_memory() -> None:
    """Hand the memory loading freed (temporaries of packing, dequantizing) back to the
    OS: glibc's ``malloc_trim``; nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def check_int8_activations(backend: str, on: bool | None) -> None:
    """One-line UsageError if ``--int8-activations`` is asked of a backend without it."""
    if on and backend != "numpy":
        raise UsageError(f"--int8-activations: needs --backend numpy (the {backend} backend "
                         "multiplies float activations)")


def get_backend(name: str, quantize: int | None = None, group_size: int = 64,
                int8_activations: bool | None = None):
    """A backend by name: ``numpy`` or ``mlx`` (``quantize``: bits per weight, MLX only;
    ``int8_activations``: numpy only, None = ``HPCMAC_INT8_ACTIVATIONS``, default off)."""
    if name in BACKENDS:
        check_quantize(name, quantize, group_size)
        check_int8_activations(name, int8_activations)
    if name == "numpy":
        keep_freed_memory()
        if int8_activations is None:
            from hpcmac.llm.model.qkernels import int8_default

            int8_activations = int8_default()
        return NumpyBackend(int8_activations)
    if name == "mlx":
        try:
            return MLXBackend(quantize, group_size)
        except ImportError:
            raise UsageError("--backend mlx: mlx is not installed (pip install 'mlx[cpu]' "
                             "on Linux, 'mlx' on macOS)") from None
    raise UsageError(f"--backend {name!r}: expected one of {', '.join(BACKENDS)}")
