"""Small control messages between ranks as plain tagged bytes, never pickle.

``pickle.loads`` of bytes from the network runs whatever a peer (or anyone
who can reach its port) sends. Control messages here are plain data:
``None``, bools, integers (64-bit), floats, strings, bytes, lists, tuples and
dicts of those, numeric numpy arrays and scalars, and dataclasses defined in
hpcmac (rebuilt from their fields by name, nothing else imported), encoded as
a tag byte, a length or value in a fixed-size little-endian field, and the
payload. :func:`decode` checks every length
against the bytes left and the nesting depth, and raises :class:`WireError`
(a ValueError) for anything malformed; it never builds an object it was not
told about. Both ends are hpcmac: the format is internal, not a standard.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

#: deepest nesting decode() follows
MAX_DEPTH = 32

_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_LEN = struct.Struct("<I")
_NONE, _TRUE, _FALSE, _INT, _FLOAT = b"N", b"T", b"F", b"i", b"f"
_STR, _BYTES, _LIST, _TUPLE, _DICT = b"s", b"b", b"l", b"t", b"d"
_ARRAY, _CLASS = b"a", b"c"
#: numpy kinds an array may have: bool, signed/unsigned int, float, complex
_KINDS = "biufc"


class WireError(ValueError):
    """A control message that is not what :func:`encode` writes."""


def encode(obj: Any) -> bytes:
    """``obj`` (plain data, see the module) as bytes; TypeError for anything else,
    ValueError for an integer outside int64."""
    out: list[bytes] = []
    _enc(obj, out, 0)
    return b"".join(out)


def _enc(obj: Any, out: list[bytes], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"control message nested deeper than {MAX_DEPTH}")
    if obj is None:
        out.append(_NONE)
    elif obj is True:
        out.append(_TRUE)
    elif obj is False:
        out.append(_FALSE)
    elif isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in _KINDS:
        arr = np.asarray(obj)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        out.append(_ARRAY)
        _enc((arr.dtype.str, tuple(int(d) for d in arr.shape), isinstance(obj, np.generic)),
             out, depth + 1)
        out += [_LEN.pack(arr.nbytes), arr.tobytes()]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        if not cls.__module__.startswith("hpcmac."):
            raise TypeError(f"cannot send a {cls.__name__} as a control message")
        out.append(_CLASS)
        _enc(f"{cls.__module__}:{cls.__qualname__}", out, depth + 1)
        _enc({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}, out, depth + 1)
    elif isinstance(obj, int):
        if not -(2**63) <= obj < 2**63:
            raise ValueError(f"cannot send an integer of {obj.bit_length()} bits in a control "
                             "message (64 at most)")
        out += [_INT, _I64.pack(obj)]
    elif isinstance(obj, float):
        out += [_FLOAT, _F64.pack(obj)]
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out += [_STR, _LEN.pack(len(data)), data]
    elif isinstance(obj, (bytes, bytearray)):
        out += [_BYTES, _LEN.pack(len(obj)), bytes(obj)]
    elif isinstance(obj, (list, tuple)):
        out += [_LIST if isinstance(obj, list) else _TUPLE, _LEN.pack(len(obj))]
        for item in obj:
            _enc(item, out, depth + 1)
    elif isinstance(obj, dict):
        out += [_DICT, _LEN.pack(len(obj))]
        for key, value in obj.items():
            _enc(key, out, depth + 1)
            _enc(value, out, depth + 1)
    else:
        raise TypeError(f"cannot send a {type(obj).__name__} as a control message")


def decode(data: bytes) -> Any:
    """The object :func:`encode` made ``data`` from; WireError when ``data`` is anything else."""
    obj, end = _dec(memoryview(data), 0, 0)
    if end != len(data):
        raise WireError(f"control message: {len(data) - end} bytes after the end")
    return obj


def _need(buf: memoryview, off: int, n: int) -> None:
    if n < 0 or off + n > len(buf):
        raise WireError(f"control message cut short at byte {off} (needs {n} more)")


def _dec(buf: memoryview, off: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise WireError(f"control message nested deeper than {MAX_DEPTH}")
    _need(buf, off, 1)
    tag = bytes(buf[off:off + 1])
    off += 1
    if tag == _NONE:
        return None, off
    if tag == _TRUE:
        return True, off
    if tag == _FALSE:
        return False, off
    if tag in (_INT, _FLOAT):
        _need(buf, off, 8)
        value = (_I64 if tag == _INT else _F64).unpack_from(buf, off)[0]
        return value, off + 8
    if tag == _ARRAY:
        return _dec_array(buf, off, depth)
    if tag == _CLASS:
        return _dec_class(buf, off, depth)
    _need(buf, off, 4)
    n = _LEN.unpack_from(buf, off)[0]
    off += 4
    if tag in (_STR, _BYTES):
        _need(buf, off, n)
        raw = bytes(buf[off:off + n])
        if tag == _BYTES:
            return raw, off + n
        try:
            return raw.decode("utf-8"), off + n
        except UnicodeDecodeError:
            raise WireError(f"control message: invalid UTF-8 in a string at byte {off}") from None
    if tag in (_LIST, _TUPLE, _DICT):
        # every item takes at least one byte: a count beyond the bytes left is a lie
        _need(buf, off, n * (2 if tag == _DICT else 1))
        items = []
        for _ in range(n * (2 if tag == _DICT else 1)):
            item, off = _dec(buf, off, depth + 1)
            items.append(item)
        if tag == _LIST:
            return items, off
        if tag == _TUPLE:
            return tuple(items), off
        try:
            return dict(zip(items[::2], items[1::2])), off
        except TypeError:
            raise WireError("control message: a dict key that cannot be a key") from None
    raise WireError(f"control message: unknown tag {tag!r} at byte {off - 1}")


def _dec_array(buf: memoryview, off: int, depth: int) -> tuple[Any, int]:
    head, off = _dec(buf, off, depth + 1)
    try:
        dtype_str, shape, scalar = head
        dtype = np.dtype(dtype_str)
        shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise WireError("control message: a malformed array header") from None
    if dtype.kind not in _KINDS or any(d < 0 for d in shape) or len(shape) > 32:
        raise WireError(f"control message: an array of {dtype_str!r} {shape} is not allowed")
    _need(buf, off, 4)
    n = _LEN.unpack_from(buf, off)[0]
    off += 4
    count = 1
    for d in shape:
        count *= d
    if n != count * dtype.itemsize:
        raise WireError(f"control message: array of shape {shape} declares {n} bytes")
    _need(buf, off, n)
    arr = np.frombuffer(bytes(buf[off:off + n]), dtype=dtype).reshape(shape).copy()
    return (arr[()] if scalar else arr), off + n


def _dec_class(buf: memoryview, off: int, depth: int) -> tuple[Any, int]:
    import importlib

    name, off = _dec(buf, off, depth + 1)
    fields, off = _dec(buf, off, depth + 1)
    if not isinstance(name, str) or not name.startswith("hpcmac.") or ":" not in name \
            or not isinstance(fields, dict):
        raise WireError(f"control message: {name!r} is not an hpcmac dataclass")
    module, qualname = name.split(":", 1)
    try:
        # only hpcmac's own modules, and only a dataclass in them
        cls = getattr(importlib.import_module(module), qualname)
    except (ImportError, AttributeError, ValueError):
        raise WireError(f"control message: {name!r} is not an hpcmac dataclass") from None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise WireError(f"control message: {name!r} is not an hpcmac dataclass")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    if set(fields) - known:
        raise WireError(f"control message: {name} has no field(s) {sorted(set(fields) - known)}")
    try:
        return cls(**{k: v for k, v in fields.items() if k in known}), off
    except (TypeError, ValueError) as exc:
        raise WireError(f"control message: {name}: {exc}") from None
