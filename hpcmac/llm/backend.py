"""Compute backends for the decoder: numpy (float32, default) and MLX.

The model is written once against the small set of operations here. Scalars
passed into them are Python floats, so float32 arrays stay float32 (a numpy
float64 scalar would silently promote a whole decode step to float64).
"""

from __future__ import annotations

import numpy as np

from hpcmac.errors import UsageError

BACKENDS = ("numpy", "mlx")


class NumpyBackend:
    """float32 numpy on the CPU; matrix products go to the BLAS numpy links."""

    name = "numpy"
    xp = np
    #: below this many rows a product is blocked over weight rows, so each block is
    #: read from memory once and reused from cache for every row of x (BLAS gemm
    #: packs the whole weight matrix when x has a few rows, which is 3-4x slower)
    small_m = 16
    block_rows = 96

    def asarray(self, a) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    def index(self, a) -> np.ndarray:
        return np.asarray(a, dtype=np.int64)

    def to_numpy(self, a) -> np.ndarray:
        return a

    def zeros(self, shape) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    def linear(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``x @ w.T``: x (M, in), w (out, in) -> (M, out)."""
        m = x.shape[0]
        if m == 1 or m >= self.small_m or w.shape[0] <= 2 * self.block_rows:
            return x @ w.T
        out = np.empty((m, w.shape[0]), dtype=np.float32)
        r = self.block_rows
        for i in range(0, w.shape[0], r):
            np.matmul(x, w[i:i + r].T, out=out[:, i:i + r])
        return out

    def sigmoid(self, x):
        return 0.5 * np.tanh(0.5 * x) + 0.5

    def silu(self, x):
        return x * (0.5 * np.tanh(0.5 * x) + 0.5)

    def softmax(self, x, axis: int = -1):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        return e

    def rms_norm(self, x, w, eps: float):
        ms = np.einsum("...i,...i->...", x, x)[..., None] * (1.0 / x.shape[-1])
        return x * (1.0 / np.sqrt(ms + eps)) * w

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


class MLXBackend:
    """MLX arrays: Metal on Apple silicon, CPU elsewhere (float32)."""

    name = "mlx"

    def __init__(self):
        import mlx.core as mx

        self.mx = mx
        self.xp = mx

    def asarray(self, a):
        return self.mx.array(np.ascontiguousarray(a, dtype=np.float32))

    def index(self, a):
        return self.mx.array(np.asarray(a, dtype=np.int32))

    def to_numpy(self, a) -> np.ndarray:
        return np.array(a, dtype=np.float32, copy=False) if isinstance(a, np.ndarray) \
            else np.array(a)

    def zeros(self, shape):
        return self.mx.zeros(shape, dtype=self.mx.float32)

    def linear(self, x, w):
        return x @ w.T

    def sigmoid(self, x):
        return self.mx.sigmoid(x)

    def silu(self, x):
        return x * self.mx.sigmoid(x)

    def softmax(self, x, axis: int = -1):
        return self.mx.softmax(x, axis=axis, precise=True)

    def rms_norm(self, x, w, eps: float):
        return self.mx.fast.rms_norm(x, w, eps)

    def where(self, cond, a, b):
        return self.mx.where(self.mx.array(cond) if isinstance(cond, np.ndarray) else cond, a, b)

    def index_add(self, out, idx, y):
        return out.at[idx].add(y)

    def set(self, arr, key, value):
        arr[key] = value
        return arr

    def eval(self, *arrays) -> None:
        self.mx.eval(*arrays)


def get_backend(name: str):
    """A backend by name: ``numpy`` or ``mlx``."""
    if name == "numpy":
        return NumpyBackend()
    if name == "mlx":
        try:
            return MLXBackend()
        except ImportError:
            raise UsageError("--backend mlx: mlx is not installed (pip install 'mlx[cpu]' "
                             "on Linux, 'mlx' on macOS)") from None
    raise UsageError(f"--backend {name!r}: expected one of {', '.join(BACKENDS)}")
