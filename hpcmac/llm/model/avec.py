"""Explicit-SIMD one-token attention over a KV cache, as LLVM IR.

A decode step's attention reads each KV head's cached keys and values once for its
query heads (:func:`hpcmac.llm.model.fused.attend_one`). Written as numba loops, only
the innermost loop vectorises: each score ends in a horizontal sum, and each value row
loads and stores every output. Here the two passes keep their partial results in
vector registers:

* :func:`scores`: ``s[i, j] = q[i] . K[j]`` for the query heads ``i`` of one KV head,
  ``QB = 4`` query heads against ``KB = 4`` keys at a time: sixteen ``<16 x float>``
  accumulators, each 16 floats of a key row loaded once for the 4 queries, summed over
  the head's dimensions, then reduced together (a transpose tree of shuffles and adds:
  15 adds for the 16 scores, not 16 horizontal sums) into one vector of the 16 scores
  (the block's rows stay in L1 for the query heads past the first 4);
* :func:`weighted_sum`: ``o[i] += sum_j p[i, j] V[j]`` the value rows a block of ``VB``
  at a time; per block, up to ``QB = 4`` query heads times 64 of the dimensions
  (sixteen ``<16 x float>`` accumulators) held in registers over the block's rows, each
  value row's 64 floats loaded once for the query heads;
* :func:`softmax` between them: each row's maximum, ``e^(s - max)`` (:func:`exp`,
  :func:`hpcmac.llm.model.fused.exp32`'s steps) and their sum, the division, 16 lanes
  at a time.

Both prefetch the keys or values ``PREFETCH`` bytes ahead. The head dimension must be
a multiple of 64 (64, 128, 256: :func:`fits`); ``attend_one`` keeps its loops for
others. Sums: each score's ``d`` products in 16 interleaved partial sums (any BLAS's
order, within float32 summation error of the exact sum); the value sum over keys
in key order, one FMA a key, as the loops did. Pure: no communication.
"""

from __future__ import annotations

import math

import llvmlite.ir as ir
import numba as nb
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hpcmac.llm.model.qvec import _IR, _c64, _vec

#: keys a block in :func:`scores` (an accumulator each per query head: QB * KB = 16)
KB = 4
#: value rows a block in :func:`weighted_sum` (64 rows of 128 floats: 32 KB, in L1/L2
#: for the query heads past the first ``QB``)
VB = 64
#: query heads whose scores or outputs the kernels hold in registers together
QB = 4
#: bytes ahead of the rows being read that are prefetched
PREFETCH = 4096

_F32, _I32 = ir.FloatType(), ir.IntType(32)
_F16 = _vec(_F32, 16)


@nb.njit(cache=True, nogil=True)
def fits(d):
    """Whether a head of ``d`` dimensions takes :func:`scores` and :func:`weighted_sum`."""
    return d > 0 and d % 64 == 0


def _reduce16(b, accs):
    """Sixteen ``<16 x float>`` -> one whose lane ``k`` is the sum of ``accs[k]``: halves
    of pairs shuffled together and added, four levels, then one permutation back into
    key order (each level's lanes tracked as labels)."""
    vs = [(a, [k] * 16) for k, a in enumerate(accs)]  # (vector, the key of each lane)
    w = 16  # lanes of one key per group
    while len(vs) > 1:
        h = w // 2
        nxt = []
        for (x, lx), (y, ly) in zip(vs[0::2], vs[1::2]):
            lo = [gi + t for gi in range(0, 16, w) for t in range(h)]
            lo = lo + [16 + i for i in lo]
            hi = [i + h for i in lo]
            both = lx + ly
            sx = b.shuffle_vector(x, y, ir.Constant(_vec(_I32, 16), lo))
            sy = b.shuffle_vector(x, y, ir.Constant(_vec(_I32, 16), hi))
            nxt.append((b.fadd(sx, sy), [both[i] for i in lo]))
        vs, w = nxt, h
    v, lab = vs[0]
    order = [lab.index(k) for k in range(16)]
    return b.shuffle_vector(v, v, ir.Constant(_vec(_I32, 16), order))


def _kernel_args(context, builder, sig, args):
    """The head of :func:`_scores_ir` and :func:`_wsum_ir` (both called as ``(x, cache,
    base, L, out)``): ``builder``, its :class:`~hpcmac.llm.model.qvec._IR` helpers, then
    ``x``, ``cache`` and ``out`` as arrays and ``base``, ``L`` as given."""
    xt, ct, _, _, ot = sig.args
    xa, ca, base, L, oa = args
    x = context.make_array(xt)(context, builder, xa)
    c = context.make_array(ct)(context, builder, ca)
    o = context.make_array(ot)(context, builder, oa)
    return builder, _IR(builder), x, c, base, L, o


def _over_query_heads(b, g, block, *at):
    """``block(i0, nq, *at)`` over ``g`` query heads: ``QB`` at a time, then the ``g % QB``
    left (one branch for each count, so that ``nq`` is a constant in each block)."""
    full = b.udiv(g, _c64(QB))
    left = b.sub(g, b.mul(full, _c64(QB)))
    with cgutils.for_range(b, full) as lq:
        block(b.mul(lq.index, _c64(QB)), QB, *at)
    i0 = b.mul(full, _c64(QB))
    for nq in range(1, QB):
        with b.if_then(b.icmp_unsigned("==", left, _c64(nq))):
            block(i0, nq, *at)


def _scores_ir(context, builder, sig, args):
    b, h, q, c, base, L, s = _kernel_args(context, builder, sig, args)
    g, d = cgutils.unpack_tuple(b, q.shape, 2)
    chunks = b.udiv(d, _c64(16))
    accs = [[cgutils.alloca_once(b, _F16) for _ in range(KB)] for _ in range(QB)]
    zero = ir.Constant(_F16, None)

    def block(i0, nq, j):
        """Scores of query heads ``i0 .. i0 + nq - 1`` against keys ``j .. j + KB - 1``:
        each 16 floats of a key row loaded once for the ``nq`` queries."""
        for u in range(nq):
            for k in range(KB):
                b.store(zero, accs[u][k])
        with cgutils.for_range(b, chunks) as lc:
            t = b.mul(lc.index, _c64(16))
            kv = [h.load(c.data, b.add(b.add(base, b.mul(b.add(j, _c64(k)), d)), t), _F16)
                  for k in range(KB)]
            for u in range(nq):
                qv = h.load(q.data, b.add(b.mul(b.add(i0, _c64(u)), d), t), _F16)
                for k in range(KB):
                    b.store(h.fma(kv[k], qv, b.load(accs[u][k])), accs[u][k])
        vs = [b.load(accs[u][k]) for u in range(nq) for k in range(KB)]
        out = _reduce16(b, vs + [zero] * (16 - len(vs)))  # lane u KB + k: query u, key k
        for u in range(nq):
            part = b.shuffle_vector(out, out, ir.Constant(_vec(_I32, KB),
                                                          list(range(u * KB, (u + 1) * KB))))
            dst = b.gep(s.data, [b.add(b.mul(b.add(i0, _c64(u)), L), j)])
            b.store(part, b.bitcast(dst, _vec(_F32, KB).as_pointer()), align=1)

    nblk = b.udiv(L, _c64(KB))
    with cgutils.for_range(b, nblk) as lb:
        j = b.mul(lb.index, _c64(KB))
        kb = b.add(base, b.mul(j, d))  # the block's first key row
        with cgutils.for_range(b, b.mul(_c64(KB), chunks)) as lp:  # one line a 64 bytes
            h.prefetch(c.data, b.add(kb, b.add(_c64(PREFETCH // 4), b.mul(lp.index, _c64(16)))))
        _over_query_heads(b, g, block, j)
    with cgutils.for_range(b, b.sub(L, b.mul(nblk, _c64(KB)))) as lr:  # the last keys
        j = b.add(b.mul(nblk, _c64(KB)), lr.index)
        kr = b.add(base, b.mul(j, d))
        acc = accs[0][0]
        with cgutils.for_range(b, g) as lq:
            b.store(zero, acc)
            with cgutils.for_range(b, chunks) as lc:
                t = b.mul(lc.index, _c64(16))
                qv = h.load(q.data, b.add(b.mul(lq.index, d), t), _F16)
                kv = h.load(c.data, b.add(kr, t), _F16)
                b.store(h.fma(kv, qv, b.load(acc)), acc)
            b.store(h.hsum(b.load(acc)), b.gep(s.data, [b.add(b.mul(lq.index, L), j)]))
    return context.get_dummy_value()


def _wsum_ir(context, builder, sig, args):
    b, h, p, c, base, L, o = _kernel_args(context, builder, sig, args)
    g, d = cgutils.unpack_tuple(b, o.shape, 2)
    accs = [[cgutils.alloca_once(b, _F16) for _ in range(4)] for _ in range(QB)]
    nblk = b.udiv(b.add(L, _c64(VB - 1)), _c64(VB))
    ngrp = b.udiv(d, _c64(64))

    def block(i0, nq, j0, n):
        """Query heads ``i0 .. i0 + nq - 1`` over value rows ``j0 .. j0 + n - 1``."""
        with cgutils.for_range(b, ngrp) as lg:
            t0 = b.mul(lg.index, _c64(64))
            for u in range(nq):
                for k in range(4):
                    off = b.add(b.add(b.mul(b.add(i0, _c64(u)), d), t0), _c64(16 * k))
                    b.store(h.load(o.data, off, _F16), accs[u][k])
            with cgutils.for_range(b, n) as lj:
                j = b.add(j0, lj.index)
                row = b.add(b.add(base, b.mul(j, d)), t0)
                for k in range(4):  # the 4 lines of 16 floats read from this row
                    h.prefetch(c.data, b.add(row, _c64(PREFETCH // 4 + 16 * k)))
                vs = [h.load(c.data, b.add(row, _c64(16 * k)), _F16) for k in range(4)]
                for u in range(nq):
                    pv = h.splat(b.load(b.gep(p.data, [b.add(b.mul(b.add(i0, _c64(u)), L),
                                                             j)])), 16)
                    for k in range(4):
                        b.store(h.fma(vs[k], pv, b.load(accs[u][k])), accs[u][k])
            for u in range(nq):
                for k in range(4):
                    off = b.add(b.add(b.mul(b.add(i0, _c64(u)), d), t0), _c64(16 * k))
                    dst = b.bitcast(b.gep(o.data, [off]), _F16.as_pointer())
                    b.store(b.load(accs[u][k]), dst, align=1)

    with cgutils.for_range(b, nblk) as lb:
        j0 = b.mul(lb.index, _c64(VB))
        n = b.sub(L, j0)
        n = b.select(b.icmp_unsigned("<", n, _c64(VB)), n, _c64(VB))
        _over_query_heads(b, g, block, j0, n)
    return context.get_dummy_value()


#: e^x = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 in two parts (ln 2's high part has
#: 9 significant bits, so n * _LN2_HI is exact for |n| < 2^15), e^r by its Taylor series to
#: r^7 (|r| <= ln 2 / 2: the first term left out, r^8 / 8!, is 5e-9 of e^r)
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.1219444005469057e-4)
_HALF, _ONE = np.float32(0.5), np.float32(1.0)
_C2, _C3, _C4, _C5, _C6, _C7 = (np.float32(1.0 / math.factorial(k)) for k in range(2, 8))
#: below this e^x is under float32's smallest normal: 0 (a softmax's term that small is
#: nothing to a sum that holds its maximum's e^0 = 1); above, 2^n would overflow: the
#: value there (2.2e38) is returned
_EXP_LO, _EXP_HI = np.float32(-87.33), np.float32(88.3)


def _const(ty, v: float):
    """The float32 ``v`` as a constant of ``ty`` (a float, or splatted over a vector)."""
    c = ir.Constant(_F32, float(np.float32(v)))
    return ir.Constant(ty, [c] * ty.count) if isinstance(ty, ir.VectorType) else c


def _exp(b, h, x):
    """``e^x`` of a float32 or a float32 vector ``x``: :func:`hpcmac.llm.model.fused.exp32`'s
    range reduction and polynomial (its constants), each multiply-add one FMA (the
    reduction's two steps then exact or rounded once, as good as exp32's, no worse)."""
    ty = x.type
    vec = isinstance(ty, ir.VectorType)
    ity = _vec(_I32, ty.count) if vec else _I32
    suffix = f"v{ty.count}f32" if vec else "f32"
    lo, hi = _const(ty, _EXP_LO), _const(ty, _EXP_HI)
    xc = b.select(b.fcmp_ordered(">", x, hi), hi, x)
    xc = b.select(b.fcmp_ordered("<", xc, lo), lo, xc)
    n = b.call(h.fn(f"llvm.floor.{suffix}", ty, [ty]),
               [h.fma(xc, _const(ty, _LOG2E), _const(ty, _HALF))])
    nn = b.fneg(n)
    r = h.fma(nn, _const(ty, _LN2_LO), h.fma(nn, _const(ty, _LN2_HI), xc))
    p = _const(ty, _C7)
    for c in (_C6, _C5, _C4, _C3, _C2, _ONE, _ONE):
        p = h.fma(p, r, _const(ty, c))
    bits = b.shl(b.add(b.fptosi(n, ity), ir.Constant(ity, [ir.Constant(_I32, 127)] * ty.count)
                       if vec else ir.Constant(_I32, 127)),
                 ir.Constant(ity, [ir.Constant(_I32, 23)] * ty.count) if vec else
                 ir.Constant(_I32, 23))
    e = b.fmul(p, b.bitcast(bits, ty))
    return b.select(b.fcmp_ordered(">", xc, lo), e, _const(ty, 0.0))


def _rowmap(b, ptr, n, body):
    """``body(pointer, type)`` over ``n`` float32 from ``ptr``: 16 at a time, then one."""
    nv = b.udiv(n, _c64(16))
    with cgutils.for_range(b, nv) as lv:
        body(b.bitcast(b.gep(ptr, [b.mul(lv.index, _c64(16))]), _F16.as_pointer()), _F16)
    with cgutils.for_range(b, b.sub(n, b.mul(nv, _c64(16)))) as lt:
        body(b.gep(ptr, [b.add(b.mul(nv, _c64(16)), lt.index)]), _F32)


def _softmax_ir(context, builder, sig, args):
    st, kt = sig.args
    b = builder
    h = _IR(b)
    s = context.make_array(st)(context, builder, args[0])
    k = context.make_array(kt)(context, builder, args[1])
    g, L = cgutils.unpack_tuple(b, s.shape, 2)
    mx = cgutils.alloca_once(b, _F16)
    den = cgutils.alloca_once(b, _F16)
    with cgutils.for_range(b, g) as lq:
        row = b.gep(s.data, [b.mul(lq.index, L)])
        sink = b.load(b.gep(k.data, [lq.index]))
        b.store(h.splat(sink, 16), mx)

        def top(ptr, ty):
            x = b.load(ptr, align=1)
            if ty is _F32:
                x = h.splat(x, 16)
            m = b.load(mx)
            b.store(b.select(b.fcmp_ordered(">", x, m), x, m), mx)

        _rowmap(b, row, L, top)
        m = b.load(mx)
        for w in (8, 4, 2, 1):  # the lanes' maximum, in every lane
            sh = b.shuffle_vector(m, m, ir.Constant(_vec(_I32, 16), [(k + w) % 16
                                                                      for k in range(16)]))
            m = b.select(b.fcmp_ordered(">", sh, m), sh, m)
        top1 = b.extract_element(m, ir.Constant(_I32, 0))
        b.store(ir.Constant(_F16, None), den)

        def ex(ptr, ty):
            e = _exp(b, h, b.fsub(b.load(ptr, align=1), m if ty is _F16 else top1))
            b.store(e, ptr, align=1)
            if ty is _F32:
                e = b.insert_element(ir.Constant(_F16, None), e, ir.Constant(_I32, 0))
            b.store(b.fadd(b.load(den), e), den)

        _rowmap(b, row, L, ex)
        tot = h.hsum(b.load(den))
        has = b.fcmp_ordered(">", sink, ir.Constant(_F32, float("-inf")))
        tot = b.select(has, b.fadd(tot, _exp(b, h, b.fsub(sink, top1))), tot)
        tot16 = h.splat(tot, 16)

        def div(ptr, ty):
            b.store(b.fdiv(b.load(ptr, align=1), tot16 if ty is _F16 else tot), ptr, align=1)

        _rowmap(b, row, L, div)
    return context.get_dummy_value()


def _exp_ir(context, builder, sig, args):
    xt, yt = sig.args
    b = builder
    h = _IR(b)
    x = context.make_array(xt)(context, builder, args[0])
    y = context.make_array(yt)(context, builder, args[1])
    n = cgutils.unpack_tuple(b, x.shape, 1)[0]
    nv = b.udiv(n, _c64(16))
    with cgutils.for_range(b, nv) as lv:
        off = b.mul(lv.index, _c64(16))
        dst = b.bitcast(b.gep(y.data, [off]), _F16.as_pointer())
        b.store(_exp(b, h, h.load(x.data, off, _F16)), dst, align=1)
    with cgutils.for_range(b, b.sub(n, b.mul(nv, _c64(16)))) as lt:
        off = b.add(b.mul(nv, _c64(16)), lt.index)
        b.store(_exp(b, h, b.load(b.gep(x.data, [off]))), b.gep(y.data, [off]))
    return context.get_dummy_value()


def _check(arrs):
    if any(not isinstance(a, types.Array) or a.dtype != types.float32 or a.layout != "C"
           for a in arrs):
        raise TypeError("float32 C-contiguous arrays")


@intrinsic
def _scores(typingctx, q, cache, base, L, s):
    _check((q, cache, s))
    return types.void(q, cache, types.int64, types.int64, s), _scores_ir


@intrinsic
def _wsum(typingctx, p, cache, base, L, o):
    _check((p, cache, o))
    return types.void(p, cache, types.int64, types.int64, o), _wsum_ir


@intrinsic
def _softmax(typingctx, s, sinks):
    _check((s, sinks))
    return types.void(s, sinks), _softmax_ir


@intrinsic
def _exp_into(typingctx, x, y):
    _check((x, y))
    return types.void(x, y), _exp_ir


@nb.njit(cache=True, nogil=True, boundscheck=False)
def softmax(s, sinks):
    """Each row ``i`` of the scores ``s`` (g, L) float32 -> its softmax in place, the logit
    ``sinks[i]`` (g,) (-inf: none) joining its denominator: numpy's order (the maximum,
    ``e^(s - max)``, the sum, one division each), the exponential :func:`exp`, the sum in
    16 partial sums."""
    if sinks.shape[0] != s.shape[0]:
        raise ValueError("avec.softmax: a sink a row")
    _softmax(s, sinks)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def exp(x):
    """``e^x`` of each of ``x`` (n,) float32, as :func:`softmax` computes it: within 1 ulp
    over float32's normal results, 0 below them (tested)."""
    if x.ndim != 1:
        raise ValueError("avec.exp: a vector")
    y = np.empty_like(x)
    _exp_into(x, y)
    return y


@nb.njit(cache=True, nogil=True, boundscheck=False)
def _rows(cache, slot, h, j0, L, d):
    """The element offset of key ``j0`` of KV head ``h`` in ``slot`` of a (slots, KV,
    max_len, d) cache, after checking the rows ``j0 .. j0 + L - 1`` lie in it."""
    S, KV, T, dd = cache.shape
    if dd != d or not fits(d) or not (0 <= slot < S and 0 <= h < KV and 0 <= j0 and
                                 j0 + L <= T and L >= 0):
        raise ValueError("avec: rows outside the cache, or d not a multiple of 64")
    return ((slot * KV + h) * T + j0) * d


@nb.njit(cache=True, nogil=True, boundscheck=False)
def scores(q, ck, slot, h, j0, L, s):
    """``s[i, j] = q[i] . ck[slot, h, j0 + j]`` for q (g, d), s (g, L) float32."""
    if s.shape[0] != q.shape[0] or s.shape[1] != L:
        raise ValueError("avec.scores: s must be (g, L)")
    _scores(q, ck, np.int64(_rows(ck, slot, h, j0, L, q.shape[1])), np.int64(L), s)


@nb.njit(cache=True, nogil=True, boundscheck=False)
def weighted_sum(p, cv, slot, h, j0, L, o):
    """``o[i] += sum_j p[i, j] cv[slot, h, j0 + j]`` for p (g, L), o (g, d) float32."""
    if p.shape[0] != o.shape[0] or p.shape[1] != L:
        raise ValueError("avec.weighted_sum: p must be (g, L)")
    _wsum(p, cv, np.int64(_rows(cv, slot, h, j0, L, o.shape[1])), np.int64(L), o)

