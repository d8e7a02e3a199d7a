"""Reading what users hand us: bounded, regular files only, strict numbers (pure, no MPI).

Every input file (HPL.dat, hostfiles, prompt and batch files, model headers)
is read through :func:`read_bytes` / :func:`read_text`: at most ``limit`` bytes
(a larger file is refused before it is read), from a regular file only (a FIFO
would block forever, ``/dev/zero`` never ends) unless the caller allows
otherwise, and text is strict UTF-8. Numbers in text formats are plain ASCII
digits (:func:`parse_int`, :func:`parse_float`): Python's ``int()`` also takes
``"١٢"``, ``"1_000"`` and ``"\\t12\\n"``, and ``float()`` takes ``"nan"``. JSON is
decoded by :func:`parse_json`, which refuses NaN/Infinity and deep nesting.
Every failure is a one-line :class:`~hpcmac.errors.UsageError` naming the file.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from typing import Any

from hpcmac.errors import UsageError

#: default cap for small text inputs (HPL.dat, hostfiles, batch files)
TEXT_LIMIT = 1 << 20
#: deepest JSON nesting accepted (hostfiles and model configs are a few levels deep)
JSON_DEPTH = 64

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"


def read_bytes(path: str | os.PathLike, what: str, limit: int = TEXT_LIMIT,
               special: bool = False) -> bytes:
    """The bytes of the file at ``path``, at most ``limit`` of them.

    Parameters
    ----------
    path : path (local)
    what : str
        How the error names the input, e.g. ``"--dat"`` or ``"hostfile"``.
    limit : int
        Largest size accepted, in bytes; a larger file is a UsageError.
    special : bool
        Allow non-regular files (pipes, character devices); they are still read
        only up to ``limit`` bytes.

    Raises
    ------
    UsageError
        ``what path: ...`` when the file is missing, not a regular file, too big
        or unreadable.
    """
    name = os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO with no writer must not block before the check
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise UsageError(f"{what} {name}: cannot read: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"{what} {name}: expected a file, found a directory")
        if not stat.S_ISREG(st.st_mode):
            if not special:
                raise UsageError(f"{what} {name}: expected a regular file, found "
                                 f"{_kind_of(st.st_mode)}")
            os.set_blocking(fd, True)
        elif st.st_size > limit:
            raise UsageError(f"{what} {name}: expected at most {_size_text(limit)}, "
                             f"found {st.st_size} bytes")
        else:
            os.set_blocking(fd, True)
        chunks = []
        got = 0
        while got <= limit:
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            except OSError as exc:
                raise UsageError(f"{what} {name}: cannot read: {exc.strerror}") from None
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:  # grew while read, or a stream
            raise UsageError(f"{what} {name}: expected at most {_size_text(limit)}, "
                             "found more")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind_of(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def decode_text(data: bytes, what: str) -> str:
    """``data`` as strict UTF-8; invalid bytes are a UsageError naming the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UsageError(f"{what}: line {line}: expected UTF-8 text, found byte "
                         f"0x{data[exc.start]:02x} at offset {exc.start}") from None


def read_text(path: str | os.PathLike, what: str, limit: int = TEXT_LIMIT,
              special: bool = False) -> str:
    """:func:`read_bytes` decoded as strict UTF-8 (see there)."""
    data = read_bytes(path, what, limit, special)
    return decode_text(data, f"{what} {os.fspath(path)}")


def parse_int(token: str) -> int | None:
    """``token`` as an integer when it is plain ASCII digits with an optional sign, else None."""
    if not _INT.fullmatch(token):
        return None
    return int(token)


def parse_float(token: str) -> float | None:
    """``token`` as a finite float when it is a plain ASCII decimal number, else None.

    No ``nan``, ``inf``, underscores, non-ASCII digits or surrounding spaces; a
    value that overflows to infinity (``1e999``) is None too.
    """
    if not _FLOAT.fullmatch(token):
        return None
    value = float(token)
    return value if math.isfinite(value) else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_json(text: str, where: str) -> Any:
    """Decode JSON text strictly: no NaN/Infinity, at most :data:`JSON_DEPTH` levels deep.

    Raises
    ------
    UsageError
        ``where: not JSON (line L, column C: why)`` or what was refused.
    """
    depth = _max_depth(text)
    if depth > JSON_DEPTH:
        raise UsageError(f"{where}: expected JSON nested at most {JSON_DEPTH} levels deep, "
                         f"found {depth}")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where}: not JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    except ValueError as exc:  # NaN, Infinity
        raise UsageError(f"{where}: not JSON: {exc}") from None
    except RecursionError:  # pragma: no cover - _max_depth refuses this first
        raise UsageError(f"{where}: JSON nested too deeply") from None


_BRACKETS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)


def _max_depth(text: str) -> int:
    """Deepest bracket nesting in JSON text, skipping strings (linear time)."""
    if text.count("[") + text.count("{") <= JSON_DEPTH:
        return 0
    depth = best = 0
    for m in _BRACKETS.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            best = max(best, depth)
        elif c in "]}":
            depth -= 1
    return best


def int_arg(text: str) -> int:
    """argparse ``type=``: an integer of plain ASCII digits (``int()`` also takes
    ``"١٢"`` and ``"1_0"``)."""
    import argparse

    value = parse_int(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits), found {text!r}")
    return value


def float_arg(text: str) -> float:
    """argparse ``type=``: a finite number in plain ASCII (no nan, inf, ``1e999``)."""
    import argparse

    value = parse_float(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a finite number, found {text!r}")
    return value
