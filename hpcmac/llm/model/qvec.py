"""Explicit-SIMD kernels for quantized matrix-vector products, written as LLVM IR.

Decode multiplies one activation row by every weight once per token. A numba
loop written in Python cannot say "keep these 16 partial sums in one vector
register across the whole row": LLVM vectorises only the innermost loop and
reduces its vector accumulator at that loop's exit, so a per-group scale
forces either a horizontal reduction per group or accumulators in memory (the
first kernel here did the latter: a store-to-load chain per group bounded it
at ~0.07 ns a weight). These kernels are numba intrinsics that emit LLVM IR
with vector types directly (``<32 x i8>``, ``<16 x float>``), so:

* each 32-weight chunk of codes becomes floats (or stays bytes) in registers,
  is multiplied by the activations, folded to one vector and scaled by its
  group's scale into a vector accumulator that lives in a register for the
  whole row; one horizontal sum per row;
* ``R`` rows share each load of the activations;
* with float32 activations, ``MB`` activation rows share each chunk's codes: they
  become floats times the chunk's factor once (4-bit codes: the 16 scaled values
  looked up by ``vpermps`` where the CPU has AVX-512F) and go into each row by two
  FMAs, so a row past the first costs about the FMAs alone (short prompts'
  prefill, speculative decoding's verified rows); a row's sums are the same
  operations in the same order whatever the block, so its product does not depend
  on the rows beside it;
* a software prefetch runs ``PREFETCH`` bytes ahead of the codes (measured
  here: 1.5-2x the memory throughput of the hardware prefetcher alone on a
  matrix far larger than cache);
* the bias term ``sum_g b_g * sum_{i in g} x_i`` is a separate short dot over
  the row's groups (the group sums of x are computed once per token).

The IR is target independent except for one instruction: with 8-bit
activations the 32 byte products of a chunk go to ``vpdpbusd`` (AVX-512 VNNI
or AVX-VNNI: unsigned codes times signed activations, summed in fours into
int32, 32 products per 256-bit instruction; 4-bit codes go two chunks at a time
through the 512-bit form where the CPU has it) when numba compiles for a CPU
that has it; elsewhere the same sums are built from widened multiplies and adds
(LLVM maps them onto what the target has, e.g. NEON on Apple silicon).

What a code means (``kind``, one compiled variant each): 0 an unsigned byte
(affine 8 bits and the widened 2, 3, 5, 6), 1 an unsigned nibble (affine 4 bits),
2 an E2M1 nibble (MXFP4), 3 an E4M3 byte (FP8). The float codes become floats
in registers: an E2M1 nibble is looked up as twice its value, a signed integer
in [-12, 12] (``pshufb`` on x86, a few byte operations elsewhere), so the
scale carries the factor 1/2 (where the CPU has AVX-512F, the 16 doubled values are
instead scaled by the chunk's factor, once, and looked up as floats by ``vpermps``:
:meth:`_IR.nibbles_scaled`, as the affine nibbles are); an E4M3 byte moves into the bits of an IEEE
half (sign to bit 15, exponent and mantissa shifted by 7: the value over 2^8,
subnormals included) and widens to float32 (``vcvtph2ps``), so the scale
carries 2^8 (where the CPU has GFNI, the half's two bytes come from two GF(2) affine
byte maps and an interleave: :meth:`_IR.e4m3x32_gfni`; where it has AVX-512 VBMI and
the groups are a multiple of 64, kind 4: the float32 itself, the value over 2^8, from
two 128-byte table lookups, 64 codes at a time, :meth:`_IR.e4m3x64_vbmi`). All are
exact. 8-bit activations take kinds 0 and 1 only.

Storage the kernels read (see :class:`~hpcmac.llm.model.qkernels.NQWeight`):
codes ``q`` (out, bytes) uint8, one byte per code (8 bits and the widened 2,
3, 5 and 6 bits), or for 4 bits one byte per two codes where, within each run
of 32 codes, byte ``j`` holds code ``j`` in its low and code ``j + 16`` in its
high nibble (GGUF's own Q4_0 order); scales (out, groups) as float32, or as
the bits of float16 (an ``int16`` view: numba has no float16 arrays) or of
bfloat16 (a ``uint16`` view); biases the same, or derived (``bias = c *
scale`` for the symmetric types: an empty array and the constant ``c``).
"""

from __future__ import annotations

import llvmlite.ir as ir
import numba as nb
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: rows of the weight multiplied together (they share the activation loads)
R = 2
#: activation rows multiplied together by the float32 kernel (they share each chunk's
#: codes, turned into floats once): R * MB * 2 vector accumulators
MB = 4
#: the code kinds (see above) whose float32 kernel takes MB activation rows at a time
#: (affine and E2M1); FP8's kernels and the 8-bit-activation ones decode the codes again
#: for each row (read by :func:`~hpcmac.llm.model.qkernels.qmatmul` for its row limit)
F32_BLOCKED = (0, 1, 2)
#: bytes ahead of the codes being read that are prefetched (measured, see above)
PREFETCH = 16384
#: FP8 rows multiplied together where the CPU has AVX-512 VBMI (kind 4), and the bytes
#: ahead of each row's codes prefetched there
R_FP8 = 2
PREFETCH_FP8 = 32768
#: the FP8 kernels prefetch into L2, not L1 (measured on a decode's 94 MB of FP8 layers,
#: interleaved in one process at load 27-31: 0.64-0.71 of the CPU time with L1 prefetches
#: 16 KB ahead, both kernels; R_FP8 = 4 and distances of 16-64 KB within the noise)
LOCALITY_FP8 = 2

_F32, _I8, _I16, _I32, _I64 = (ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32),
                               ir.IntType(64))


def _vec(t, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _c64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def vnni_width() -> int:
    """Widest ``vpdpbusd`` numba compiles for here: 512 (AVX-512 VNNI), 256 (AVX-VNNI, or
    AVX-512 VNNI with VL) or 0 (none: portable IR)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if config.CPU_NAME not in (None, "host"):
        f = {k[1:]: k[0] == "+" for k in (config.CPU_FEATURES or "").split(",") if k}
    else:
        f = llvm.get_host_cpu_features()
    if f.get("avx512vnni") and f.get("avx512bw"):
        return 512
    if f.get("avxvnni") or (f.get("avx512vnni") and f.get("avx512vl")):
        return 256
    return 0


def has_vnni() -> bool:
    """Whether numba compiles for a CPU with ``vpdpbusd`` (see :func:`vnni_width`)."""
    return vnni_width() > 0


class _IR:
    """Small helpers over an llvmlite IRBuilder."""

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder

    def fn(self, name: str, ret, args):
        return cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, args), name)

    def load(self, ptr, idx, vty):
        """A vector ``vty`` from ``ptr[idx:]`` (element pointer, unaligned)."""
        p = self.b.bitcast(self.b.gep(ptr, [idx]), vty.as_pointer())
        return self.b.load(p, align=1)

    def prefetch(self, ptr, idx, locality: int = 3):
        """A read prefetch of ``ptr[idx]``; ``locality`` 3 into every cache level, 2 into
        L2 and below (x86 ``prefetcht0`` / ``prefetcht1``)."""
        f = self.fn("llvm.prefetch.p0", ir.VoidType(), [ptr.type, _I32, _I32, _I32])
        self.b.call(f, [self.b.gep(ptr, [idx]), ir.Constant(_I32, 0),
                        ir.Constant(_I32, locality), ir.Constant(_I32, 1)])

    def splat(self, x, n: int):
        v = self.b.insert_element(ir.Constant(_vec(x.type, n), None), x, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), [0] * n))

    def halves(self, v):
        n = v.type.count
        lo = self.b.shuffle_vector(v, v, ir.Constant(_vec(_I32, n // 2), list(range(n // 2))))
        hi = self.b.shuffle_vector(v, v, ir.Constant(_vec(_I32, n // 2), list(range(n // 2, n))))
        return lo, hi

    def fold(self, v, n: int):
        """Sum halves of a vector until it has ``n`` lanes."""
        while v.type.count > n:
            lo, hi = self.halves(v)
            v = self.b.fadd(lo, hi) if isinstance(v.type.element, ir.FloatType) else \
                self.b.add(lo, hi)
        return v

    def hsum(self, v):
        return self.b.extract_element(self.fold(v, 1), ir.Constant(_I32, 0))

    def fma(self, a, b, c):
        t = a.type
        name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
        return self.b.call(self.fn(name, t, [t, t, t]), [a, b, c])

    def scale(self, ptr, idx, dtype):
        """One scale/bias as float32 from its storage (float32, float16 or bfloat16 bits)."""
        v = self.b.load(self.b.gep(ptr, [idx]))
        return self.to_f32(v, dtype)

    def to_f32(self, v, dtype):
        if dtype == types.float32:
            return v
        if dtype == types.int16:  # float16 bits
            return self.b.fpext(self.b.bitcast(v, _half_like(v.type)), _f32_like(v.type))
        # bfloat16 bits: the high half of a float32
        w = self.b.shl(self.b.zext(v, _i32_like(v.type)), _const_like(v.type, 16))
        return self.b.bitcast(w, _f32_like(v.type))

    def codes32(self, qp, idx, bits4: bool):
        """32 codes of one chunk as ``<32 x i8>`` (4 bits: 16 bytes, low then high nibbles)."""
        if not bits4:
            return self.load(qp, idx, _vec(_I8, 32))
        by = self.load(qp, idx, _vec(_I8, 16))
        lo = self.b.and_(by, ir.Constant(_vec(_I8, 16), [15] * 16))
        hi = self.b.lshr(by, ir.Constant(_vec(_I8, 16), [4] * 16))
        return self.b.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32))))

    def fp4(self, n):
        """``<16 x i8>`` E2M1 codes (0..15) -> twice their values as signed bytes."""
        b = self.b
        table = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]
        v16 = _vec(_I8, 16)
        if _HAS_PSHUFB:
            f = self.fn("llvm.x86.ssse3.pshuf.b.128", v16, [v16, v16])
            return b.call(f, [ir.Constant(v16, [t & 255 for t in table]), n])
        def c(k):
            return ir.Constant(v16, [k] * 16)

        m = b.and_(n, c(7))  # magnitude code: doubled value m, 6, 8, 12 for m = 5, 6, 7
        usub = self.fn("llvm.usub.sat.v16i8", v16, [v16, v16])
        v = b.add(b.add(m, b.call(usub, [m, c(4)])), b.shl(b.call(usub, [m, c(6)]), c(1)))
        neg = b.sub(c(0), b.lshr(n, c(3)))  # 0 or -1
        return b.sub(b.xor(v, neg), neg)

    def nibbles_scaled(self, by, f, values):
        """``<16 x i8>`` bytes of 4-bit code pairs (low nibble: codes 0-15 of the chunk,
        high: 16-31) -> two ``<16 x float>`` of their ``values`` times the chunk's factor
        ``f``: the 16 values scaled once, then looked up by ``vpermps`` (it reads the low
        4 bits of each index, so the nibbles need no mask): a multiply, a widening, a
        shift and two lookups for 32 codes, against two masks, two widenings, two
        conversions and two multiplies. Each product is ``f * value`` rounded once, as
        the dequantized matrix's ``scale * q`` is (E2M1, doubled, with the 1/2 in ``f``:
        exact, a power-of-two scale times a value of at most 4 bits)."""
        b = self.b
        f16, i16 = _vec(_F32, 16), _vec(_I32, 16)
        tbl = b.fmul(ir.Constant(f16, [float(v) for v in values]), self.splat(f, 16))
        w = b.zext(by, i16)
        perm = self.fn("llvm.x86.avx512.permvar.sf.512", f16, [f16, i16])
        lo = b.call(perm, [tbl, w])
        hi = b.call(perm, [tbl, b.lshr(w, ir.Constant(i16, [4] * 16))])
        return lo, hi

    def e4m3(self, by):
        """``<16 x i8>`` E4M3 codes -> ``<16 x float>`` of their values / 2^8 (exact).

        Through an IEEE half where the CPU converts halves (x86 F16C, every AArch64);
        elsewhere (a generic x86-64, where LLVM would call a half-conversion routine the
        JIT does not link) through the bits of a float32, the value / 2^120 (E4M3's
        subnormals land on float32 subnormals), times 2^112."""
        b = self.b
        wide = _I16 if _HAS_F16 else _I32
        vt = _vec(wide, 16)
        w = b.zext(by, vt)

        def c(k):
            return ir.Constant(vt, [k] * 16)

        if _HAS_F16:  # (w + (w & 0x80)) << 7: the sign carries from bit 14 into bit 15
            h = b.shl(b.add(w, b.and_(w, c(0x80))), c(7))
            return b.fpext(b.bitcast(h, _vec(ir.HalfType(), 16)), _vec(_F32, 16))
        f = b.or_(b.shl(b.and_(w, c(0x7F)), c(20)), b.shl(b.and_(w, c(0x80)), c(24)))
        return b.fmul(b.bitcast(f, _vec(_F32, 16)),
                      ir.Constant(_vec(_F32, 16), [float(2.0 ** 112)] * 16))

    def e4m3x32(self, by):
        """``<32 x i8>`` E4M3 codes -> two ``<16 x float>`` (codes 0-15, 16-31) of their
        values / 2^8, exact, through IEEE halves built 32 at a time (CPUs that convert
        halves; :meth:`e4m3` elsewhere): sign-extended to 16 bits and shifted left by 7,
        the sign lands in bits 14 and 15 and the exponent and mantissa in 7-13; clearing
        bit 14 leaves the half. Three integer operations a 32 codes against eight for
        two :meth:`e4m3` (the FP8 decode kernel was bound by these, not by memory)."""
        b = self.b
        vt = _vec(_I16, 32)
        h = b.and_(b.shl(b.sext(by, vt), ir.Constant(vt, [7] * 32)),
                   ir.Constant(vt, [0xBF80 - 0x10000] * 32))
        h = b.bitcast(h, _vec(ir.HalfType(), 32))
        return tuple(b.fpext(v, _vec(_F32, 16)) for v in self.halves(h))

    def e4m3x32_gfni(self, by):
        """``<32 x i8>`` E4M3 codes -> two ``<16 x float>`` of their values / 2^8, exact,
        in the order of :data:`GFNI_ORDER` (lo: codes 0-7 and 16-23, hi: 8-15 and
        24-31). The halves' bytes come from two GF(2) affine byte maps
        (``vgf2p8affineqb``: the high byte sign, 0, magnitude bits 6..1; the low byte
        magnitude bit 0 in its bit 7), interleaved by ``vpunpck[lh]bw``: four byte
        operations, no shift, mask or lane extract (:meth:`e4m3x32`: a widening, a
        shift, a mask and an extract). Measured: 1.08x that kernel's read rate here."""
        b = self.b
        v32 = _vec(_I8, 32)
        f = self.fn("llvm.x86.vgf2p8affineqb.256", v32, [v32, v32, _I8])

        def affine(rows: list[int]):  # rows[7 - j]: the input bits output bit j takes
            q = sum(r << (8 * k) for k, r in enumerate(rows))
            mat = ir.Constant(v32, [(q >> (8 * (k % 8))) & 255 for k in range(32)])
            return b.call(f, [by, mat, ir.Constant(_I8, 0)])

        hi = affine([0x80, 0, 0x40, 0x20, 0x10, 0x08, 0x04, 0x02])
        lo = affine([0x01, 0, 0, 0, 0, 0, 0, 0])
        out = []
        for part in (range(0, 8), range(8, 16)):  # unpacklo, unpackhi (per 128-bit lane)
            idx = [j for lane in (0, 16) for i in part for j in (lane + i, 32 + lane + i)]
            h = b.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), idx))
            out.append(b.fpext(b.bitcast(h, _vec(ir.HalfType(), 16)), _vec(_F32, 16)))
        return tuple(out)

    def e4m3x64_vbmi(self, by):
        """``<64 x i8>`` E4M3 codes -> four ``<16 x float>`` of their values / 2^8, exact,
        in the order of :data:`VBMI_ORDER`, with no half-precision step: a float32 of an
        E4M3 value has only its high 16 bits set (sign, exponent, 3 mantissa bits), so two
        ``vpermi2b`` look the code's 7 magnitude bits up in two 128-byte tables (the
        float's bytes 3 and 2, :data:`E4M3_BYTES`), the sign is or-ed into byte 3, the
        bytes interleave into words (``vpunpck[lh]bw``) and each 32-bit pair of words
        gives two floats by a shift and a mask. Per 64 codes: two table lookups, one
        or, two interleaves, two shifts, two masks (:meth:`e4m3x32_gfni`: four affine
        maps, four interleaves and four ``vcvtph2ps``)."""
        b = self.b
        v64, i16 = _vec(_I8, 64), _vec(_I32, 16)
        f = self.fn("llvm.x86.avx512.vpermi2var.qi.512", v64, [v64, v64, v64])

        def table(k):
            return ir.Constant(v64, [int(t) for t in E4M3_BYTES[k]])

        hi = b.call(f, [table(0), by, table(1)])  # byte 3 of the float, codes 0-63 / 64-127
        hi = b.or_(hi, b.and_(by, ir.Constant(v64, [0x80] * 64)))
        lo = b.call(f, [table(2), by, table(3)])  # byte 2
        out = []
        for part in (0, 1):
            w = b.bitcast(b.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 64),
                                                              _vbmi_pairs(part))), i16)
            out.append(b.bitcast(b.shl(w, ir.Constant(i16, [16] * 16)), _vec(_F32, 16)))
            out.append(b.bitcast(b.and_(w, ir.Constant(i16, [-65536] * 16)),
                                 _vec(_F32, 16)))
        return tuple(out)

    def dot_u8i8(self, codes, xq, width: int):
        """``<n x u8> . <n x i8>`` (n = 32 or 64) as ``<n/4 x i32>``: lane j sums bytes
        ``4j .. 4j+3``, as ``vpdpbusd`` does (``width``: see :func:`vnni_width`)."""
        n = codes.type.count
        if width:
            w = min(width, 8 * n)  # bits per instruction
            vt = _vec(_I32, w // 32)
            f = self.fn(f"llvm.x86.avx512.vpdpbusd.{w}", vt, [vt, vt, vt])
            parts = []
            for k in range(0, n, w // 8):
                sel = ir.Constant(_vec(_I32, w // 8), list(range(k, k + w // 8)))
                cp = codes if n == w // 8 else self.b.shuffle_vector(codes, codes, sel)
                xp = xq if n == w // 8 else self.b.shuffle_vector(xq, xq, sel)
                parts.append(self.b.call(f, [ir.Constant(vt, None), self.b.bitcast(cp, vt),
                                             self.b.bitcast(xp, vt)]))
            while len(parts) > 1:
                a, c = parts[0], parts[1]
                m = a.type.count
                parts = [self.b.shuffle_vector(a, c, ir.Constant(_vec(_I32, 2 * m),
                                                                 list(range(2 * m))))] + parts[2:]
            return parts[0]
        p = self.b.mul(self.b.zext(codes, _vec(_I32, n)), self.b.sext(xq, _vec(_I32, n)))
        out = None
        for k in range(4):
            t = self.b.shuffle_vector(p, p, ir.Constant(_vec(_I32, n // 4),
                                                        list(range(k, n, 4))))
            out = t if out is None else self.b.add(out, t)
        return out

    def group_dot(self, sp, row_off, sdt, vp, G):
        """``sum_g float(s[row_off + g]) * v[g]`` over ``G`` groups (float32 ``v``)."""
        b = self.b
        acc = cgutils.alloca_once_value(b, ir.Constant(_vec(_F32, 16), None))
        tail = cgutils.alloca_once_value(b, ir.Constant(_F32, 0.0))
        n16 = b.udiv(G, _c64(16))
        with cgutils.for_range(b, n16) as lp:
            g = b.mul(lp.index, _c64(16))
            ety = _F32 if sdt == types.float32 else _I16
            sv = self.to_f32(self.load(sp, b.add(row_off, g), _vec(ety, 16)), sdt)
            b.store(self.fma(sv, self.load(vp, g, _vec(_F32, 16)), b.load(acc)), acc)
        with cgutils.for_range(b, b.sub(G, b.mul(n16, _c64(16))), start=None) as lp:
            g = b.add(b.mul(n16, _c64(16)), lp.index)
            s = self.scale(sp, b.add(row_off, g), sdt)
            b.store(self.fma(s, b.load(b.gep(vp, [g])), b.load(tail)), tail)
        return b.fadd(self.hsum(b.load(acc)), b.load(tail))


def _has_pshufb() -> bool:
    """Whether numba compiles for an x86 CPU with SSSE3's ``pshufb`` (the E2M1 lookup)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if not llvm.get_process_triple().startswith(("x86_64", "i686")):
        return False
    if config.CPU_NAME not in (None, "host"):
        return "+ssse3" in (config.CPU_FEATURES or "")
    return bool(llvm.get_host_cpu_features().get("ssse3"))


def _has_f16() -> bool:
    """Whether numba compiles for a CPU that converts IEEE halves to float32 in hardware
    (x86 F16C; AArch64 always)."""
    import llvmlite.binding as llvm
    from numba.core import config

    triple = llvm.get_process_triple()
    if triple.startswith(("aarch64", "arm64")):
        return True
    if not triple.startswith(("x86_64", "i686")):
        return False
    if config.CPU_NAME not in (None, "host"):
        return "+f16c" in (config.CPU_FEATURES or "")
    return bool(llvm.get_host_cpu_features().get("f16c"))


def _has_gfni() -> bool:
    """Whether numba compiles for an x86 CPU with GFNI and AVX2 (the FP8 decode of
    :meth:`_IR.e4m3x32_gfni`)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if not llvm.get_process_triple().startswith(("x86_64", "i686")):
        return False
    if config.CPU_NAME not in (None, "host"):
        feats = config.CPU_FEATURES or ""
        return "+gfni" in feats and "+avx2" in feats
    f = llvm.get_host_cpu_features()
    return bool(f.get("gfni") and f.get("avx2"))


def _has_avx512f() -> bool:
    """Whether numba compiles for an x86 CPU with AVX-512F (``vpermps`` over 16 floats: the
    E2M1 lookup of :meth:`_IR.nibbles_scaled`)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if not llvm.get_process_triple().startswith(("x86_64", "i686")):
        return False
    if config.CPU_NAME not in (None, "host"):
        return "+avx512f" in (config.CPU_FEATURES or "")
    return bool(llvm.get_host_cpu_features().get("avx512f"))


def _has_vbmi() -> bool:
    """Whether numba compiles for an x86 CPU with AVX-512 VBMI and BW (``vpermi2b`` over
    64 bytes: the FP8 decode of :meth:`_IR.e4m3x64_vbmi`)."""
    import llvmlite.binding as llvm
    from numba.core import config

    if not llvm.get_process_triple().startswith(("x86_64", "i686")):
        return False
    if config.CPU_NAME not in (None, "host"):
        feats = config.CPU_FEATURES or ""
        return all(f in feats for f in ("+avx512f", "+avx512bw", "+avx512vbmi"))
    f = llvm.get_host_cpu_features()
    return bool(f.get("avx512f") and f.get("avx512bw") and f.get("avx512vbmi"))


_HAS_PSHUFB = _has_pshufb()
_HAS_AVX512F = _has_avx512f()
_HAS_F16 = _has_f16()
_HAS_GFNI = _HAS_F16 and _has_gfni()
#: the 16 values a nibble looks up (:meth:`_IR.nibbles_scaled`): affine 4-bit codes, and
#: E2M1 doubled
_NIBBLES = tuple(range(16))
_FP4_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
#: where the GFNI decode leaves code j of a chunk of 32: the FP8 kernel reads the
#: activations in this order (the middle two runs of 8 swapped, as ``vpunpck[lh]bw``
#: interleave per 128-bit lane)
GFNI_ORDER = np.r_[0:8, 16:24, 8:16, 24:32]

_HAS_VBMI = _HAS_AVX512F and _has_vbmi()


def _vbmi_pairs(part: int) -> list[int]:
    """The byte shuffle of ``vpunpcklbw`` (part 0) or ``vpunpckhbw`` (1) of two 512-bit
    vectors (the first's byte, then the second's, per 128-bit lane): word ``w`` of the
    result takes code ``_vbmi_pairs(part)[2 * w]``."""
    half = range(0, 8) if part == 0 else range(8, 16)
    return [j for lane in (0, 16, 32, 48) for i in half for j in (lane + i, 64 + lane + i)]


def _vbmi_order() -> np.ndarray:
    """Which code of a run of 64 lands in lane ``j`` of the four vectors of
    :meth:`_IR.e4m3x64_vbmi` (lane ``16 v + d`` of vector ``v``): vectors 2p and 2p + 1
    are the low and high words of part p's 32-bit pairs."""
    order = []
    for part in (0, 1):
        code = _vbmi_pairs(part)[0::2]  # code of each of the 32 words
        order += [code[2 * d] for d in range(16)] + [code[2 * d + 1] for d in range(16)]
    return np.array(order, np.int64)


def _e4m3_bytes() -> np.ndarray:
    """(4, 64) uint8: bytes 3 (rows 0, 1: magnitude codes 0-63, 64-127) and 2 (rows 2, 3)
    of the float32 of each E4M3 magnitude over 2^8; its low two bytes are zero (checked)."""
    c = np.arange(128)
    e, m = c >> 3, (c & 7).astype(np.float64)
    v = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7.0)) / 256
    v = np.where(c == 127, np.nan, v).astype(np.float32).view(np.uint32)
    assert not np.any(v & np.uint32(0xFFFF))
    return np.stack([(v >> np.uint32(24)).astype(np.uint8),
                     (v >> np.uint32(16)).astype(np.uint8)]).reshape(4, 64)


#: the FP8 kernel reads the activations in this order per run of 64 where the CPU has
#: AVX-512 VBMI (:meth:`_IR.e4m3x64_vbmi`)
VBMI_ORDER = _vbmi_order()
E4M3_BYTES = _e4m3_bytes()


def _half_like(t):
    return _vec(ir.HalfType(), t.count) if isinstance(t, ir.VectorType) else ir.HalfType()


def _f32_like(t):
    return _vec(_F32, t.count) if isinstance(t, ir.VectorType) else _F32


def _i32_like(t):
    return _vec(_I32, t.count) if isinstance(t, ir.VectorType) else _I32


def _const_like(t, v):
    return ir.Constant(_vec(_I32, t.count), [v] * t.count) if isinstance(t, ir.VectorType) \
        else ir.Constant(_I32, v)


def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


def _check_types(q, s, b):
    if not (isinstance(q, types.Array) and q.dtype == types.uint8):
        raise TypeError("codes must be a uint8 array")
    if s.dtype not in (types.float32, types.int16, types.uint16) or b.dtype != s.dtype:
        raise TypeError("scales/biases: float32, or float16/bfloat16 bits as int16/uint16")


def _emit(context, builder, sig, args, int8: bool):
    """The body shared by the float and the 8-bit-activation kernels (see the module
    docstring). Arguments, all local to this call:

    float: q, s, b, x (M, K) f32, xs (M, G) f32, y (M, N) f32, sc, bits4, bc
    int8 : q, s, b, xq (M, K) i8, dx (M, K/32) f32, xs (M, G) f32, y, sc, bits4, bc
    ``xs``: the group sums of the activations (of the rounded ones for int8);
    ``sc`` (R, K/32) f32 scratch: each row's factor per chunk of 32 (its group's
    scale, times the chunk's ``dx`` for int8), filled once per weight row (and block
    of activation rows; int8: per activation row), vectorised;
    ``bc``: the constant of derived biases (used when ``b`` is empty).
    With int8 and 4-bit codes, ``xq`` comes in pairs of chunks as the codes unpack:
    chunk c's first 16, chunk c+1's first 16, c's last 16, c+1's last 16
    (:func:`quantize_x` with ``bits4``); a last odd chunk in plain order.
    """
    if int8:
        qa, sa, ba, xa, dxa, xsa, ya, sca, bits4, bc = args
        qt, st, bt, xt, dxt, xst, yt, sct = sig.args[:8]
    else:
        qa, sa, ba, xa, xsa, ya, sca, bits4, bc = args
        qt, st, bt, xt, xst, yt, sct = sig.args[:7]
    sdt = st.dtype
    bc = builder.fptrunc(bc, _F32) if bc.type != _F32 else bc
    h = _IR(builder)
    b = builder
    q = context.make_array(qt)(context, builder, qa)
    s = context.make_array(st)(context, builder, sa)
    bb = context.make_array(bt)(context, builder, ba)
    x = context.make_array(xt)(context, builder, xa)
    xs = context.make_array(xst)(context, builder, xsa)
    y = context.make_array(yt)(context, builder, ya)
    scr = context.make_array(sct)(context, builder, sca)
    dx = context.make_array(dxt)(context, builder, dxa) if int8 else None
    shp = cgutils.unpack_tuple
    N, nbytes = shp(b, q.shape, 2)
    G = shp(b, s.shape, 2)[1]
    M, K = shp(b, x.shape, 2)
    nb_rows = shp(b, bb.shape, 2)[0]
    derived = b.icmp_unsigned("==", nb_rows, _c64(0))
    chunks = b.udiv(K, _c64(32))
    cpg = b.udiv(chunks, G)  # chunks per group: 1, 2 or 4
    shift = b.select(b.icmp_unsigned("==", cpg, _c64(1)), _c64(0),
                     b.select(b.icmp_unsigned("==", cpg, _c64(2)), _c64(1), _c64(2)))
    kindv = bits4  # the code kind (see the module docstring)
    width = vnni_width() if int8 else 0
    f16 = _vec(_F32, 16)
    accs = [cgutils.alloca_once(b, f16) for _ in range(max(R, R_FP8))]
    accs8 = [cgutils.alloca_once(b, _vec(_F32, 8)) for _ in range(R)]  # one-chunk steps
    # rows_f32's accumulators: weight row r, activation row j, the chunk's two halves
    blk = [[(cgutils.alloca_once(b, f16), cgutils.alloca_once(b, f16)) for _ in range(MB)]
           for _ in range(R)]
    ety = _F32 if sdt == types.float32 else _I16
    done = cgutils.alloca_once(b, _I64)  # chunks filled by the vector loop

    def fill(r: int, o, m):
        """scratch row r = row o's factor per chunk (times dx[m] for int8)."""
        base = b.mul(_c64(r), chunks)
        n16 = b.udiv(chunks, _c64(16))
        b.store(_c64(0), done)
        with b.if_then(b.icmp_unsigned("==", shift, _c64(0))):  # one scale a chunk: 16 at once
            with cgutils.for_range(b, n16) as lp:
                c = b.mul(lp.index, _c64(16))
                v = h.to_f32(h.load(s.data, b.add(b.mul(o, G), c), _vec(ety, 16)), sdt)
                if int8:
                    v = b.fmul(v, h.load(dx.data, b.add(b.mul(m, chunks), c), f16))
                p = b.bitcast(b.gep(scr.data, [b.add(base, c)]), f16.as_pointer())
                b.store(v, p, align=1)
            b.store(b.mul(n16, _c64(16)), done)
        st0 = b.load(done)
        with cgutils.for_range(b, b.sub(chunks, st0)) as lp:
            c = b.add(st0, lp.index)
            v = h.scale(s.data, b.add(b.mul(o, G), b.lshr(c, shift)), sdt)
            if int8:
                v = b.fmul(v, b.load(b.gep(dx.data, [b.add(b.mul(m, chunks), c)])))
            b.store(v, b.gep(scr.data, [b.add(base, c)]))

    def factor(r: int, c, n: int):
        return b.load(b.gep(scr.data, [b.add(b.mul(_c64(r), chunks), c)]))

    def rows_fp8(o0, nr: int):
        """FP8 rows ``[o0, o0 + nr)`` (float32 activations): the products of a group of
        128 summed in a register and scaled once (its float32 scale read as stored),
        no per-chunk factors and no bias term; measured: FP8 decode was bound by the
        kernel's arithmetic, not by memory."""
        gaccs = [cgutils.alloca_once(b, f16) for _ in range(nr)]
        with cgutils.for_range(b, M) as lm:
            m = lm.index
            for r in range(nr):
                b.store(ir.Constant(f16, None), accs[r])
            with cgutils.for_range(b, G) as lg:
                for r in range(nr):
                    b.store(ir.Constant(f16, None), gaccs[r])
                with cgutils.for_range(b, cpg) as lc:
                    c = b.add(b.mul(lg.index, cpg), lc.index)
                    xo = b.add(b.mul(m, K), b.mul(c, _c64(32)))
                    x_lo = h.load(x.data, xo, f16)
                    x_hi = h.load(x.data, b.add(xo, _c64(16)), f16)
                    for r in range(nr):
                        qo = b.add(b.mul(b.add(o0, _c64(r)), nbytes), b.mul(c, _c64(32)))
                        h.prefetch(q.data, b.add(qo, _c64(PREFETCH_FP8)), LOCALITY_FP8)
                        if _HAS_GFNI:  # x in GFNI_ORDER (mv_f32)
                            lo, hi = h.e4m3x32_gfni(h.load(q.data, qo, _vec(_I8, 32)))
                        elif _HAS_F16:
                            lo, hi = h.e4m3x32(h.load(q.data, qo, _vec(_I8, 32)))
                        else:
                            lo = h.e4m3(h.load(q.data, qo, _vec(_I8, 16)))
                            hi = h.e4m3(h.load(q.data, b.add(qo, _c64(16)), _vec(_I8, 16)))
                        b.store(h.fma(lo, x_lo, h.fma(hi, x_hi, b.load(gaccs[r]))), gaccs[r])
                for r in range(nr):
                    sc = h.scale(s.data, b.add(b.mul(b.add(o0, _c64(r)), G), lg.index), sdt)
                    b.store(h.fma(b.load(gaccs[r]), h.splat(sc, 16), b.load(accs[r])),
                            accs[r])
            for r in range(nr):
                b.store(h.hsum(b.load(accs[r])),
                        b.gep(y.data, [b.add(b.mul(m, N), b.add(o0, _c64(r)))]))

    def rows_fp8_vbmi(o0, nr: int):
        """FP8 rows ``[o0, o0 + nr)`` in runs of 64 codes (kind 4: AVX-512 VBMI, groups a
        multiple of 64, the activations in :data:`VBMI_ORDER`; :func:`mv_f32` picks it):
        one 64-byte load and prefetch a row per run, :meth:`_IR.e4m3x64_vbmi`, four FMAs
        into two accumulators a row (two shorter chains), scaled once a group."""
        ga = [[cgutils.alloca_once(b, f16) for _ in range(2)] for _ in range(nr)]
        runs = b.udiv(b.udiv(K, _c64(64)), G)  # runs of 64 per group
        with cgutils.for_range(b, M) as lm:
            m = lm.index
            for r in range(nr):
                b.store(ir.Constant(f16, None), accs[r])
            with cgutils.for_range(b, G) as lg:
                for r in range(nr):
                    for a in ga[r]:
                        b.store(ir.Constant(f16, None), a)
                with cgutils.for_range(b, runs) as lc:
                    c = b.mul(b.add(b.mul(lg.index, runs), lc.index), _c64(64))
                    xo = b.add(b.mul(m, K), c)
                    xv = [h.load(x.data, b.add(xo, _c64(16 * v)), f16) for v in range(4)]
                    for r in range(nr):
                        qo = b.add(b.mul(b.add(o0, _c64(r)), nbytes), c)
                        h.prefetch(q.data, b.add(qo, _c64(PREFETCH_FP8)), LOCALITY_FP8)
                        w = h.e4m3x64_vbmi(h.load(q.data, qo, _vec(_I8, 64)))
                        g0, g1 = ga[r]
                        b.store(h.fma(w[0], xv[0], h.fma(w[2], xv[2], b.load(g0))), g0)
                        b.store(h.fma(w[1], xv[1], h.fma(w[3], xv[3], b.load(g1))), g1)
                for r in range(nr):
                    sc = h.scale(s.data, b.add(b.mul(b.add(o0, _c64(r)), G), lg.index), sdt)
                    g = b.fadd(b.load(ga[r][0]), b.load(ga[r][1]))
                    b.store(h.fma(g, h.splat(sc, 16), b.load(accs[r])), accs[r])
            for r in range(nr):
                b.store(h.hsum(b.load(accs[r])),
                        b.gep(y.data, [b.add(b.mul(m, N), b.add(o0, _c64(r)))]))

    def rows_i8(o0, nr: int, kind: int):
        """Rows ``[o0, o0 + nr)`` for every activation row, 8-bit activations on affine
        codes (``kind`` 0 or 1)."""
        bits4_static = kind == 1
        cb = 16 if bits4_static else 32  # code bytes per chunk
        with cgutils.for_range(b, M) as lm:
            m = lm.index
            for r in range(nr):
                fill(r, b.add(o0, _c64(r)), m)
                b.store(ir.Constant(f16, None), accs[r])
                b.store(ir.Constant(_vec(_F32, 8), None), accs8[r])
            # 4-bit codes: two chunks per 512-bit vpdpbusd (1.5-1.8x faster here);
            # 8-bit codes: one chunk per 256-bit one (64-byte code loads ran the
            # memory-bound Q8_0 decode ~20% slower than 32-byte ones, measured)
            pairs = b.udiv(chunks, _c64(2)) if bits4_static else _c64(0)
            pat = [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4 if bits4_static else \
                [0] * 8 + [1] * 8
            with cgutils.for_range(b, pairs) as lp:
                c = b.mul(lp.index, _c64(2))
                xv = h.load(x.data, b.add(b.mul(m, K), b.mul(c, _c64(32))), _vec(_I8, 64))
                for r in range(nr):
                    qo = b.add(b.mul(b.add(o0, _c64(r)), nbytes), b.mul(c, _c64(cb)))
                    h.prefetch(q.data, b.add(qo, _c64(PREFETCH)))
                    if bits4_static:
                        by = h.load(q.data, qo, _vec(_I8, 32))
                        lo = b.and_(by, ir.Constant(_vec(_I8, 32), [15] * 32))
                        hi = b.lshr(by, ir.Constant(_vec(_I8, 32), [4] * 32))
                        codes = b.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 64),
                                                                     list(range(64))))
                    else:
                        codes = h.load(q.data, qo, _vec(_I8, 64))
                    p = b.sitofp(h.dot_u8i8(codes, xv, width), f16)
                    fp = b.bitcast(b.gep(scr.data, [b.add(b.mul(_c64(r), chunks), c)]),
                                   _vec(_F32, 2).as_pointer())
                    f2 = b.load(fp, align=1)
                    f = b.shuffle_vector(f2, f2, ir.Constant(_vec(_I32, 16), pat))
                    b.store(h.fma(p, f, b.load(accs[r])), accs[r])
            with cgutils.for_range(b, b.sub(chunks, b.mul(pairs, _c64(2)))) as lc:
                c = b.add(b.mul(pairs, _c64(2)), lc.index)  # one chunk, plain order
                xv = h.load(x.data, b.add(b.mul(m, K), b.mul(c, _c64(32))), _vec(_I8, 32))
                for r in range(nr):
                    qo = b.add(b.mul(b.add(o0, _c64(r)), nbytes), b.mul(c, _c64(cb)))
                    h.prefetch(q.data, b.add(qo, _c64(PREFETCH)))
                    codes = h.codes32(q.data, qo, bits4_static)
                    p8 = b.sitofp(h.dot_u8i8(codes, xv, width), _vec(_F32, 8))
                    b.store(h.fma(p8, h.splat(factor(r, c, 1), 8), b.load(accs8[r])),
                            accs8[r])
            for r in range(nr):
                tot = b.fadd(h.hsum(b.load(accs[r])), h.hsum(b.load(accs8[r])))
                finish(b.add(o0, _c64(r)), m, tot)

    def finish(o, m, tot):
        """y[m, o] = tot plus the bias term of weight row o for activation row m."""
        xs_row = b.gep(xs.data, [b.mul(m, G)])
        with b.if_else(derived) as (then, other):
            with then:
                bd = b.fmul(bc, h.group_dot(s.data, b.mul(o, G), sdt, xs_row, G))
                blk_d = b.block
            with other:
                be = h.group_dot(bb.data, b.mul(o, G), sdt, xs_row, G)
                blk_e = b.block
        phi = b.phi(_F32)
        phi.add_incoming(bd, blk_d)
        phi.add_incoming(be, blk_e)
        b.store(b.fadd(tot, phi), b.gep(y.data, [b.add(b.mul(m, N), o)]))

    def rows_f32(o0, nr: int, kind: int, m0, mb: int):
        """Weight rows ``[o0, o0 + nr)`` times activation rows ``[m0, m0 + mb)``, float32
        activations on affine or E2M1 codes (``kind`` 0, 1 or 2): each chunk's codes
        become floats once, in registers, and go into every activation row of the block.
        4-bit codes become floats times their chunk's factor (:meth:`_IR.nibbles_scaled`)
        and go into a row by two FMAs, one accumulator for each half of the chunk. 8-bit
        codes stay the exact integers: a row's chunk sums ``q * x`` first and is scaled
        after (an FMA more a row), as the one-row kernel did, since an affine byte's code
        is near its zero point's 128 and its bias term takes that back: scaled first,
        each product's rounding is of ``scale * q``, not of ``scale * (q - 128)``, and
        Q8_0 logits moved past their tolerance. A row's sums are the same whatever ``mb``
        is (the same operations in the same order), so a row's product does not depend
        on the rows beside it."""
        bits4_static = kind in (1, 2)
        cb = 16 if bits4_static else 32  # code bytes per chunk
        for r in range(nr):
            fill(r, b.add(o0, _c64(r)), None)
            for j in range(mb):
                b.store(ir.Constant(f16, None), blk[r][j][0])
                b.store(ir.Constant(f16, None), blk[r][j][1])
        with cgutils.for_range(b, chunks) as lc:
            c = lc.index
            ws = []  # per weight row: the chunk's two halves as floats, and its factor
            for r in range(nr):
                qo = b.add(b.mul(b.add(o0, _c64(r)), nbytes), b.mul(c, _c64(cb)))
                h.prefetch(q.data, b.add(qo, _c64(PREFETCH)))
                f = factor(r, c, 1)
                if not bits4_static:
                    lo = b.uitofp(h.load(q.data, qo, _vec(_I8, 16)), f16)
                    hi = b.uitofp(h.load(q.data, b.add(qo, _c64(16)), _vec(_I8, 16)), f16)
                    ws.append((lo, hi, h.splat(f, 16)))
                    continue
                if _HAS_AVX512F:  # the 16 values scaled, then looked up
                    ws.append(h.nibbles_scaled(h.load(q.data, qo, _vec(_I8, 16)), f,
                                               _FP4_DOUBLED if kind == 2 else _NIBBLES)
                              + (None,))
                    continue
                by = h.load(q.data, qo, _vec(_I8, 16))
                lo = b.and_(by, ir.Constant(_vec(_I8, 16), [15] * 16))
                hi = b.lshr(by, ir.Constant(_vec(_I8, 16), [4] * 16))
                if kind == 2:
                    lo, hi = (b.sitofp(h.fp4(v), f16) for v in (lo, hi))
                else:
                    lo, hi = b.uitofp(lo, f16), b.uitofp(hi, f16)
                fs = h.splat(f, 16)
                ws.append((b.fmul(lo, fs), b.fmul(hi, fs), None))
            for j in range(mb):
                xo = b.add(b.mul(b.add(m0, _c64(j)), K), b.mul(c, _c64(32)))
                x_lo = h.load(x.data, xo, f16)
                x_hi = h.load(x.data, b.add(xo, _c64(16)), f16)
                for r in range(nr):
                    w_lo, w_hi, fs = ws[r]
                    a_lo, a_hi = blk[r][j]
                    if fs is not None:  # exact codes: the chunk's sum, then its factor
                        p = h.fma(w_lo, x_lo, b.fmul(w_hi, x_hi))
                        b.store(h.fma(p, fs, b.load(a_lo)), a_lo)
                        continue
                    b.store(h.fma(w_lo, x_lo, b.load(a_lo)), a_lo)
                    b.store(h.fma(w_hi, x_hi, b.load(a_hi)), a_hi)
        for j in range(mb):
            for r in range(nr):
                a_lo, a_hi = blk[r][j]
                finish(b.add(o0, _c64(r)), b.add(m0, _c64(j)),
                       h.hsum(b.fadd(b.load(a_lo), b.load(a_hi))))

    def weight_rows(row_fn, nrow: int):
        """``row_fn(o0, nr)`` over every weight row, ``nrow`` at a time, then the last
        ``N % nrow`` one at a time."""
        nfull = b.udiv(N, _c64(nrow))
        with cgutils.for_range(b, nfull) as lo:
            row_fn(b.mul(lo.index, _c64(nrow)), nrow)
        with cgutils.for_range(b, b.sub(N, b.mul(nfull, _c64(nrow)))) as lo:
            row_fn(b.add(b.mul(nfull, _c64(nrow)), lo.index), 1)

    def blocks_f32(kind: int):
        """Blocks of MB activation rows (then one block of the rest), each block over
        every weight row, R at a time: a block's activations stay in L1 while the
        weight's codes stream (from L2 for a matrix of up to ~1 MB) once per block."""
        def block(m0, mb: int):
            weight_rows(lambda o0, nr: rows_f32(o0, nr, kind, m0, mb), R)

        nblk = b.udiv(M, _c64(MB))
        with cgutils.for_range(b, nblk) as lm:
            block(b.mul(lm.index, _c64(MB)), MB)
        rest = b.sub(M, b.mul(nblk, _c64(MB)))
        for k in range(1, MB):
            with b.if_then(b.icmp_unsigned("==", rest, _c64(k))):
                block(b.mul(nblk, _c64(MB)), k)

    # the one place a code kind (see the module docstring) meets the loops that multiply
    # it: each entry emits the whole product for its kind
    if int8:
        by_kind = {k: (lambda k=k: weight_rows(lambda o0, nr: rows_i8(o0, nr, k), R))
                   for k in (1, 0)}
    else:
        by_kind = {k: (lambda k=k: blocks_f32(k)) for k in F32_BLOCKED}
        by_kind[3] = lambda: weight_rows(rows_fp8, R)
        if _HAS_VBMI:
            by_kind[4] = lambda: weight_rows(rows_fp8_vbmi, R_FP8)

    def dispatch(kinds):
        if len(kinds) == 1:
            by_kind[kinds[0]]()
            return
        with b.if_else(b.icmp_unsigned("==", kindv, ir.Constant(kindv.type, kinds[0]))) \
                as (then, other):
            with then:
                by_kind[kinds[0]]()
            with other:
                dispatch(kinds[1:])

    dispatch(list(by_kind))
    return context.get_dummy_value()


@intrinsic
def qgemv_f32(typingctx, q, s, b, x, xs, y, sc, bits4, bc):
    """y[m, o] = sum_i w[o, i] x[m, i] with float32 activations (see :func:`_emit`)."""
    _check_types(q, s, b)
    sig = types.void(q, s, b, x, xs, y, sc, bits4, bc)
    return sig, lambda ctx, bld, sg, args: _emit(ctx, bld, sg, args, int8=False)


@intrinsic
def qgemv_i8(typingctx, q, s, b, xq, dx, xs, y, sc, bits4, bc):
    """y[m, o] = sum_i w[o, i] xhat[m, i], xhat = dx * xq (8-bit activations)."""
    _check_types(q, s, b)
    sig = types.void(q, s, b, xq, dx, xs, y, sc, bits4, bc)
    return sig, lambda ctx, bld, sg, args: _emit(ctx, bld, sg, args, int8=True)


# -- the callable kernels (numba caches them with this file: a change to the IR above
# -- invalidates them) ------------------------------------------------------------------

_opts = dict(cache=True, nogil=True, boundscheck=False, fastmath=True)
HAS_AVX512F = _HAS_AVX512F  # (printed by hpcmac.bench.llm --rows)
HAS_GFNI = _HAS_GFNI  # (read by mv_f32 as a compile-time constant)
HAS_VBMI = _HAS_VBMI


@nb.njit(**_opts)
def mv_f32(q, s, b, x, y, group, bits4, bc):
    """y (M, N) = x (M, K) float32 times the codes; the group sums of x once per call
    (not for FP8, which has no bias term)."""
    M, K = x.shape
    G = K // group
    xs = np.zeros((M, G), np.float32)
    for m in range(M if bits4 != 3 else 0):
        for g in range(G):
            a = np.float32(0.0)
            for i in range(g * group, (g + 1) * group):
                a += x[m, i]
            xs[m, g] = a
    sc = np.empty((R, K // 32), np.float32)
    if bits4 == 3 and HAS_VBMI and group % 64 == 0:  # FP8 in runs of 64 (kind 4)
        xp = np.empty_like(x)
        for m in range(M):
            for c in range(0, K, 64):
                for j in range(64):
                    xp[m, c + j] = x[m, c + VBMI_ORDER[j]]
        qgemv_f32(q, s, b, xp, xs, y, sc, bits4 + 1, bc)
        return
    if bits4 == 3 and HAS_GFNI:  # FP8: the activations in the GFNI decode's order
        xp = np.empty_like(x)
        for m in range(M):
            for c in range(0, K, 32):
                for j in range(32):
                    xp[m, c + j] = x[m, c + GFNI_ORDER[j]]
        x = xp
    qgemv_f32(q, s, b, x, xs, y, sc, bits4, bc)


@nb.njit(**_opts)
def quantize_x(x, group, bits4=False):
    """x (M, K) -> int8 codes, one scale per 32 (max|x| / 127), and the group sums of
    the rounded activations ``dx * xq`` (what the kernel multiplies). ``bits4``: the
    codes in the order the 4-bit kernel pairs chunks (see :func:`_emit`)."""
    M, K = x.shape
    C = K // 32
    cpg = group // 32
    xq = np.empty((M, K), np.int8)
    dx = np.empty((M, C), np.float32)
    xs = np.zeros((M, C // cpg), np.float32)
    for m in range(M):
        for c in range(C):
            amax = np.float32(0.0)
            for i in range(c * 32, c * 32 + 32):
                amax = max(amax, abs(x[m, i]))
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            isum = 0
            for i in range(c * 32, c * 32 + 32):
                v = np.int32(np.rint(x[m, i] * inv))
                j = i
                if bits4 and c < C - C % 2:  # pairs (c even, c + 1): 16-wide halves
                    k = i - c * 32
                    j = (c - c % 2) * 32 + (c % 2) * 16 + (k // 16) * 32 + k % 16
                xq[m, j] = v
                isum += v
            dx[m, c] = d
            xs[m, c // cpg] += d * np.float32(isum)
    return xq, dx, xs


@nb.njit(**_opts)
def mv_i8(q, s, b, x, y, group, bits4, bc):
    """As :func:`mv_f32` with the activations rounded to 8 bits per run of 32."""
    xq, dx, xs = quantize_x(x, group, bits4 != 0)
    sc = np.empty((R, x.shape[1] // 32), np.float32)
    qgemv_i8(q, s, b, xq, dx, xs, y, sc, bits4, bc)
