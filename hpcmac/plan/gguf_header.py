"""Read a GGUF file's header only: metadata and tensor infos, no tensor data.

A GGUF file starts with its metadata (key, type, value) and a table of its
tensors (name, dims, type, offset); the weights follow. Reading the header
alone is enough to plan a model, and works on a file cut right after the
header (``head -c`` of a 400 GB download). Format: ggml's ``docs/gguf.md``
(versions 2 and 3: 64-bit counts and lengths).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hpcmac.errors import UsageError

#: ggml tensor types: (name, bytes per block, elements per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 4, 1), 1: ("F16", 2, 1), 2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32),
    6: ("Q5_0", 22, 32), 7: ("Q5_1", 24, 32), 8: ("Q8_0", 34, 32), 9: ("Q8_1", 36, 32),
    10: ("Q2_K", 84, 256), 11: ("Q3_K", 110, 256), 12: ("Q4_K", 144, 256),
    13: ("Q5_K", 176, 256), 14: ("Q6_K", 210, 256), 15: ("Q8_K", 292, 256),
    16: ("IQ2_XXS", 66, 256), 17: ("IQ2_XS", 74, 256), 18: ("IQ3_XXS", 98, 256),
    19: ("IQ1_S", 50, 256), 20: ("IQ4_NL", 18, 32), 21: ("IQ3_S", 110, 256),
    22: ("IQ2_S", 82, 256), 23: ("IQ4_XS", 136, 256), 24: ("I8", 1, 1), 25: ("I16", 2, 1),
    26: ("I32", 4, 1), 27: ("I64", 8, 1), 28: ("F64", 8, 1), 29: ("IQ1_M", 56, 256),
    30: ("BF16", 2, 1), 34: ("TQ1_0", 54, 256), 35: ("TQ2_0", 66, 256),
    39: ("MXFP4", 17, 32),
}

# metadata value types: uint8 int8 uint16 int16 uint32 int32 float32 bool string array
# uint64 int64 float64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
#: arrays longer than this are skipped, not decoded (a tokenizer's 150k strings)
_KEEP_ARRAY = 64


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int = 0  # into the data section

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        _, size, block = GGML_TYPES[self.ggml_type]
        return self.numel // block * size


@dataclass
class Header:
    path: str
    version: int
    fields: dict[str, Any]          # arrays longer than _KEEP_ARRAY hold their length only
    tensors: dict[str, TensorInfo]
    size: int = 0                   # bytes of the header (metadata and tensor table)


class _Reader:
    """Reads the header from a buffer that grows from the file as parsing needs it."""

    CHUNK = 4 << 20

    def __init__(self, fh: BinaryIO, path: str, keep_arrays: bool = False):
        import os

        self.fh, self.path, self.keep = fh, path, keep_arrays
        self.buf, self.off = b"", 0
        # every count and length is checked against the bytes the file still holds, so a
        # crafted count is refused at once instead of being followed
        self.size = os.fstat(fh.fileno()).st_size
        self.depth = 0

    def left(self) -> int:
        """Bytes of the file after the read position."""
        return self.size - self.tell()

    def bound(self, count: int, each: int, what: str) -> None:
        if count * each > self.left():
            raise UsageError(f"{self.path}: GGUF {what}: {count} entries of >= {each} bytes, "
                             f"the file holds {self.left()} more: not a GGUF header")

    def _need(self, n: int) -> None:
        while self.off + n > len(self.buf):
            more = self.fh.read(max(self.CHUNK, len(self.buf)))
            if not more:
                raise UsageError(f"{self.path}: GGUF header ends early (truncated inside the "
                                 "metadata or tensor table)")
            self.buf = self.buf[self.off:] + more
            self.off = 0

    def take(self, n: int) -> bytes:
        self._need(n)
        b = self.buf[self.off:self.off + n]
        self.off += n
        return b

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        v = struct.unpack_from(fmt, self.buf, self.off)[0]
        self.off += size
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24 or n > self.left():
            raise UsageError(f"{self.path}: GGUF string of {n} bytes: not a GGUF header")
        return self.take(n).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Skip ``count`` strings (a tokenizer's vocabulary) without decoding them."""
        u64 = _U64.unpack_from
        left = count
        while left:
            buf, off, end = self.buf, self.off, len(self.buf)
            while left and off + 8 <= end:
                n = u64(buf, off)[0]
                if off + 8 + n > end:
                    break
                off += 8 + n
                left -= 1
            self.off = off
            if left:
                self._need(8)
                n = u64(self.buf, self.off)[0]
                if n > 1 << 24:
                    raise UsageError(f"{self.path}: GGUF string of {n} bytes: not a GGUF header")
                self._need(8 + n)

    def strings(self, count: int) -> list[str]:
        """``count`` strings decoded (a tokenizer's vocabulary: ~0.03 s for 100k)."""
        u64 = _U64.unpack_from
        out: list[str] = []
        add = out.append
        left = count
        while left:
            buf, off, end = self.buf, self.off, len(self.buf)
            while left and off + 8 <= end:
                n = u64(buf, off)[0]
                if off + 8 + n > end:
                    break
                add(buf[off + 8:off + 8 + n].decode("utf-8", errors="replace"))
                off += 8 + n
                left -= 1
            self.off = off
            if left:
                self._need(8)
                n = u64(self.buf, self.off)[0]
                if n > 1 << 24:
                    raise UsageError(f"{self.path}: GGUF string of {n} bytes: not a GGUF header")
                self._need(8 + n)
        return out

    def scalars(self, etype: int, count: int) -> list:
        """``count`` fixed-size values of one type, unpacked at once."""
        fmt = _SCALARS[etype]
        size = struct.calcsize(fmt)
        self._need(count * size)
        vals = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.off)
        self.off += count * size
        return list(vals)

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            self.bound(n, struct.calcsize(_SCALARS[etype]) if etype in _SCALARS else 8,
                       "array")
            if etype == _ARRAY and self.depth >= 8:
                raise UsageError(f"{self.path}: GGUF arrays nested deeper than 8")
            if self.keep and etype in _SCALARS:
                return self.scalars(etype, n)
            if self.keep and etype == _STRING:
                return self.strings(n)
            if n <= _KEEP_ARRAY or self.keep:
                self.depth += 1
                try:
                    return [self.value(etype) for _ in range(n)]
                finally:
                    self.depth -= 1
            if etype in _SCALARS:  # fixed-size elements: skip them at once
                self.take(n * struct.calcsize(_SCALARS[etype]))
            elif etype == _STRING:
                self.skip_strings(n)
            elif etype == _ARRAY and self.depth < 8:
                self.depth += 1
                for _ in range(n):
                    self.value(etype)
                self.depth -= 1
            else:
                raise UsageError(f"{self.path}: GGUF array of type {etype}: not a GGUF header")
            return _Length(n)
        raise UsageError(f"{self.path}: GGUF metadata value type {vtype} unknown")

    def tell(self) -> int:
        return self.fh.tell() - (len(self.buf) - self.off)


class _Length(int):
    """An array that was skipped: only its length is known."""


def read_header(path: str | Path, keep_arrays: bool = False) -> Header:
    """Metadata and tensor table of a GGUF file (or of its first bytes up to the data).

    Arrays longer than 64 entries (a tokenizer's vocabulary and merges) are skipped
    and stand as their length, unless ``keep_arrays``: then every array is decoded
    (strings as ``str``, numbers as a list), as a model's loader needs them.
    """
    p = Path(path)
    try:
        fh = open(p, "rb")
    except OSError as exc:
        raise UsageError(f"{p}: cannot read ({exc.strerror})") from None
    with fh:
        r = _Reader(fh, str(p), keep_arrays)
        if fh.read(4) != b"GGUF":
            raise UsageError(f"{p}: not a GGUF file (no GGUF magic)")
        r.buf, r.off = b"", 0
        version = r.unpack("<I")
        if version not in (2, 3):
            raise UsageError(f"{p}: GGUF version {version}; expected 2 or 3")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        r.bound(n_kv, 13, "metadata count")  # key length, type, 1-byte value
        r.bound(n_tensors, 24, "tensor count")  # name length, dims, type, offset
        fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            fields[key] = r.value(r.unpack("<I"))
        tensors = {}
        for _ in range(n_tensors):
            name = r.string()
            if len(name) > 256 or not name.isprintable():
                raise UsageError(f"{p}: tensor name {name[:60]!r}: expected a short printable "
                                 "name (a GGUF name has at most 64 bytes)")
            nd = r.unpack("<I")
            if nd > 4:  # GGML_MAX_DIMS
                raise UsageError(f"{p}: tensor {name}: {nd} dimensions, expected at most 4")
            dims = tuple(r.unpack("<Q") for _ in range(nd))
            gtype = r.unpack("<I")
            offset = r.unpack("<Q")  # into the data section
            if gtype not in GGML_TYPES:
                raise UsageError(f"{p}: tensor {name}: ggml type {gtype} unknown")
            if name in tensors:
                raise UsageError(f"{p}: tensor {name} appears twice in the tensor table")
            tensors[name] = TensorInfo(name, dims, gtype, offset)
        size = r.tell()
    return Header(str(p), version, fields, tensors, size)
