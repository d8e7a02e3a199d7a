"""The factorisation's precisions: which array type the LU runs in, which GEMM it uses.

* ``numpy`` backend, ``float32``: the whole LU in float32 with the BLAS's
  SGEMM (hpcmac.linalg's LU on a float32 matrix).
* ``mlx`` backend: the matrix and the panels stay float32 on the CPU; the
  trailing update ``C -= L U`` runs in MLX with L and U rounded to the
  precision asked for (``float32``, ``bfloat16`` or ``float16``). MLX's
  matmul returns its inputs' type (on Apple GPUs Metal accumulates half
  types in float32 and rounds the result once); the product is then
  subtracted from C in float32. On Linux this runs on MLX's CPU build, much
  slower than numpy's SGEMM: there it shows the numerics, not the speed.

Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hpcmac.errors import UsageError

PRECISIONS = ("float32", "bfloat16", "float16")
BACKENDS = ("numpy", "mlx")

#: bits of the significand (with the implicit one): what each precision keeps of a value
SIGNIFICAND_BITS = {"float64": 53, "float32": 24, "bfloat16": 8, "float16": 11}


def check_choice(backend: str, precision: str) -> None:
    """UsageError (one line) for a combination this build cannot run."""
    if backend not in BACKENDS:
        raise UsageError(f"--backend: expected one of {', '.join(BACKENDS)}, found {backend!r}")
    if precision not in PRECISIONS:
        raise UsageError(f"--precision: expected one of {', '.join(PRECISIONS)}, "
                         f"found {precision!r}")
    if backend == "numpy" and precision != "float32":
        raise UsageError(f"--precision {precision}: the numpy backend factors in float32 only "
                         f"(BLAS has no {precision} GEMM); use --backend mlx")
    if backend == "mlx":
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            raise UsageError("--backend mlx: MLX is not installed (pip install 'hpcmac[mlx]')"
                             ) from None


def mlx_gemm(precision: str) -> Callable:
    """``gemm(c, l, u, poll)`` for ``hpcmac.linalg.lu``: ``c -= l @ u`` through MLX.

    ``l`` and ``u`` are rounded to ``precision`` and multiplied by MLX in that
    precision; the product is subtracted from ``c`` (float32, in place).
    """
    import mlx.core as mx

    dt = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[precision]

    def gemm(c: np.ndarray, l: np.ndarray, u: np.ndarray, poll=None) -> None:
        if c.size and l.shape[1]:
            lo = mx.array(l).astype(dt)  # (m, jb)
            up = mx.array(u).astype(dt)  # (jb, n)
            prod = mx.matmul(lo, up).astype(mx.float32)  # (m, n)
            c -= np.asarray(prod)
        if poll is not None:
            poll()

    return gemm
