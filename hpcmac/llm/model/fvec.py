"""Explicit-SIMD matrix-vector products over float32 and bfloat16 panels, as LLVM IR.

Decode reads every weight once per token. A float32 (or bfloat16) weight is held as
:class:`~hpcmac.llm.model.backend.Panels`: (nb, in, r) with ``r = 32`` output columns
contiguous per input, so one panel is a single sequential stream of ``in * r``
values. BLAS ``sgemv`` per panel (numpy's matmul over the stack) reaches 11-12 GB/s
of the 16 GB/s a one-thread BLAS ``sdot`` streams here (measured in a decode step of
the 623 MB Llama of ``hpcmac.bench.llm``). The kernel here streams the panel once, in
order, with a software prefetch ``PREFETCH`` bytes ahead into L2 (as
:mod:`~hpcmac.llm.model.qvec` does for the FP8 codes, further ahead; into L1 for the
others), and keeps the ``r`` outputs of each activation row in vector registers: per
input ``i``, ``x[i]`` broadcast times the panel's row ``i`` added into ``UNROLL``
independent pairs of ``<16 x float>`` accumulators (enough in flight to cover the FMA
latency), summed once per panel.

bfloat16 panels (a ``uint16`` view of the bits; a bfloat16 checkpoint's weights kept
in their 2 bytes) widen in registers: bfloat16 is the high half of a float32, so a
row's 32 values read as 16 32-bit pairs give the even columns by a 16-bit shift and
the odd ones by a mask, into their own accumulators, interleaved back once per panel;
the product is the float32 product of the same values (exact widening; no
half-precision conversion routine, which a generic-CPU JIT lacks). Measured on 24
panels in L2: 0.030 ns a weight against 0.041 for a widening shuffle and a shift per
16; a 65 MB head streams at ``sdot``'s rate either way (1.02-1.05x, load ~20).

Sums run in a different order than BLAS's (``UNROLL`` interleaved partial sums per
output, combined at the end): equal to the float32 product up to float32 summation
error, as any BLAS. Pure: no communication.
"""

from __future__ import annotations

import llvmlite.ir as ir
import numba as nb
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hpcmac.llm.model.qvec import _IR, _c64, _vec

#: inputs per step of the panel loop, each with its own pair of accumulators
UNROLL = 4
#: bytes ahead of the panel being read that are prefetched: on an AMD EPYC Zen 4, a 64 MB
#: float32 matrix, 1 thread, thread CPU time, one process per distance interleaved (load 5):
#: 2 KB 33.2, 4 KB 28.9-33.6, 8 KB 21.1-23.4, 16 KB (qvec's) 20.5-24.1, 32 KB 22.7 GB/s, BLAS
#: sdot 26-29; FP8 codes (qvec.PREFETCH_FP8, two rows a pass) keep 32 KB: 4 KB ran 1.5x slower
PREFETCH = 4096
#: the prefetch's cache level: into L2 (measured on a 131 MB matrix, 1 thread, interleaved:
#: 15.5-16.1 GB/s against 14.9 into L1, with sdot at 15.1-16.9)
LOCALITY = 2
#: output columns per panel the kernel takes (the numpy backend's panel width)
WIDTH = 32

_F32, _I16, _I32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)


def _emit(context, builder, sig, args):
    """``y[m, b * 32 + j] = sum_i x[m, i] * p[b, i, j]`` for p (nb, K, 32) float32 or
    uint16 (bfloat16 bits), x (M, K) float32, y (M, nb * 32) float32."""
    pt, xt, yt = sig.args
    pa, xa, ya = args
    b = builder
    h = _IR(b)
    p = context.make_array(pt)(context, builder, pa)
    x = context.make_array(xt)(context, builder, xa)
    y = context.make_array(yt)(context, builder, ya)
    nbk, K, r = cgutils.unpack_tuple(b, p.shape, 3)
    M = cgutils.unpack_tuple(b, x.shape, 2)[0]
    bf16 = pt.dtype == types.uint16
    ety = _I16 if bf16 else _F32
    esize = 2 if bf16 else 4
    f16 = _vec(_F32, 16)
    accs = [cgutils.alloca_once(b, f16) for _ in range(2 * UNROLL)]
    panel = b.mul(K, _c64(WIDTH))  # elements per panel

    def row(pbase, i):
        """Row ``i`` of the panel at element ``pbase``: two ``<16 x float>``, columns 0-15
        and 16-31 (float32), or for bfloat16 the even and the odd columns: the row's 64
        bytes read as 16 pairs, the low value shifted into the high half, the high one
        masked (two integer operations a 32, no widening shuffle)."""
        off = b.add(pbase, b.mul(i, _c64(WIDTH)))
        if bf16:
            v = h.load(p.data, off, _vec(_I32, 16))
            return [b.bitcast(b.shl(v, ir.Constant(_vec(_I32, 16), [16] * 16)), f16),
                    b.bitcast(b.and_(v, ir.Constant(_vec(_I32, 16), [-65536] * 16)), f16)]
        return [h.load(p.data, b.add(off, _c64(k)), _vec(ety, 16)) for k in (0, 16)]

    def step(pbase, xrow, i, pairs):
        """Inputs ``i .. i + len(pairs) - 1`` into accumulator pairs ``pairs``."""
        for u, a in enumerate(pairs):
            iu = b.add(i, _c64(u))
            xb = h.splat(b.load(b.gep(x.data, [b.add(xrow, iu)])), 16)
            lo, hi = row(pbase, iu)
            b.store(h.fma(lo, xb, b.load(accs[2 * a])), accs[2 * a])
            b.store(h.fma(hi, xb, b.load(accs[2 * a + 1])), accs[2 * a + 1])

    steps = b.udiv(K, _c64(UNROLL))
    with cgutils.for_range(b, nbk) as lb:
        pbase = b.mul(lb.index, panel)
        with cgutils.for_range(b, M) as lm:
            xrow = b.mul(lm.index, K)
            for a in accs:
                b.store(ir.Constant(f16, None), a)
            with cgutils.for_range(b, steps) as ls:
                i = b.mul(ls.index, _c64(UNROLL))
                # one prefetch per cache line of the UNROLL rows read this step
                lines = UNROLL * WIDTH * esize // 64
                for k in range(lines):
                    h.prefetch(p.data, b.add(b.add(pbase, b.mul(i, _c64(WIDTH))),
                                             _c64((PREFETCH + 64 * k) // esize)), LOCALITY)
                step(pbase, xrow, i, range(UNROLL))
            with cgutils.for_range(b, b.sub(K, b.mul(steps, _c64(UNROLL)))) as lt:
                step(pbase, xrow, b.add(b.mul(steps, _c64(UNROLL)), lt.index), [0])
            tots = []
            for k in (0, 1):
                tot = b.load(accs[k])
                for a in range(1, UNROLL):
                    tot = b.fadd(tot, b.load(accs[2 * a + k]))
                tots.append(tot)
            # bfloat16: the even and odd columns interleaved back
            idx = [j for c in range(16) for j in (c, 16 + c)] if bf16 else list(range(32))
            out = b.shuffle_vector(tots[0], tots[1], ir.Constant(_vec(_I32, 32), idx))
            yo = b.add(b.mul(lm.index, b.mul(nbk, _c64(WIDTH))), b.mul(lb.index, _c64(WIDTH)))
            dst = b.bitcast(b.gep(y.data, [yo]), _vec(_F32, 32).as_pointer())
            b.store(out, dst, align=1)
    return context.get_dummy_value()


@intrinsic
def _pgemv(typingctx, p, x, y):
    if not (isinstance(p, types.Array) and p.dtype in (types.float32, types.uint16)):
        raise TypeError("panels: float32, or bfloat16 bits as uint16")
    if any(a.layout != "C" for a in (p, x, y)) or x.dtype != types.float32 or \
            y.dtype != types.float32:
        raise TypeError("panels, x, y: C-contiguous; x and y float32")
    return types.void(p, x, y), _emit


@nb.njit(cache=True, nogil=True, boundscheck=False)
def panel_gemv(p, x, y):
    """y (M, nb * 32) = x (M, K) float32 times the panels p (nb, K, 32) (float32 or
    bfloat16 bits): see the module docstring. Checks the shapes (the IR does not)."""
    if p.shape[2] != WIDTH or x.shape[1] != p.shape[1] or y.shape[0] != x.shape[0] \
            or y.shape[1] != p.shape[0] * WIDTH:
        raise ValueError("panel_gemv: shapes do not match")
    _pgemv(p, x, y)


def matvec(x: np.ndarray, p: np.ndarray) -> np.ndarray:
    """``x`` (M, K) float32 times panels ``p`` (nb, K, 32): (M, nb * 32) float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], p.shape[0] * WIDTH), np.float32)
    panel_gemv(p, x, y)
    return y


def widened_matmul(x: np.ndarray, p: np.ndarray, tile_bytes: int = 4 << 20) -> np.ndarray:
    """``x`` (M, K) float32 times bfloat16 panels ``p`` (nb, K, 32) uint16 for many rows
    (prefill): panels widened to float32 a tile of at most ``tile_bytes`` at a time, each
    multiplied by BLAS (the widening paid once per tile, amortised over the rows)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    nbk, K, r = p.shape
    m = x.shape[0]
    y = np.empty((m, nbk * r), np.float32)
    step = max(1, tile_bytes // (4 * K * r))
    for b0 in range(0, nbk, step):
        t = (p[b0:b0 + step].astype(np.uint32) << np.uint32(16)).view(np.float32)
        y[:, b0 * r:(b0 + t.shape[0]) * r] = np.matmul(x, t).transpose(1, 0, 2).reshape(m, -1)
    return y

