"""The GGUF repack kept on disk: each tensor's :class:`~hpcmac.llm.model.quant.QuantTensor`.

Opening a GGUF file turns the blocks of every tensor of an exact type into the
engine's layout (:func:`hpcmac.llm.model.gguf_quant.to_quant`): for SmolLM2-135M
Q4_1 (98 MB, 211 tensors) about 0.5 s of CPU, paid by every process that loads it.
This module keeps each converted tensor in a file of its own and reads it back with
one ``readinto`` per array.

Where: ``$HPCMAC_CACHE_DIR/gguf``, else ``$XDG_CACHE_HOME/hpcmac/gguf``, else
``~/.cache/hpcmac/gguf``; ``HPCMAC_GGUF_CACHE=0`` turns it off. Only files of at least
:data:`MIN_BYTES` are cached (a smaller one converts in a few milliseconds).

An entry is one folder per GGUF file version, named by a digest of the file's resolved
path, size and mtime and of :func:`layout` (the source of the code that defines the
layout, and :data:`FORMAT`): a file rewritten, or a checkout whose conversion differs,
gets its own entry and never reads another's. Each tensor is written to a temporary
file and renamed into place, so processes opening the same file at once (the ranks of
a job) see a whole file or none. A file that does not hold together (magic, header,
sizes, shapes; the data itself is not checksummed, as the GGUF file's is not) is
ignored and rewritten. When a process makes an entry it removes the entries whose
GGUF file is gone or changed, or that no process used for :data:`UNUSED_DAYS` days.
A cache that cannot be written (read-only, full) is skipped for the rest of the process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
import struct
import time
from pathlib import Path

import numpy as np

from hpcmac.llm.model.quant import QuantTensor

#: the environment switch (``0``, ``off``, ``no``, ``false``: off) and the cache's root
ENV, DIR_ENV = "HPCMAC_GGUF_CACHE", "HPCMAC_CACHE_DIR"
#: the on-disk format of one tensor's file; part of every entry's key
FORMAT = 1
#: GGUF files smaller than this are converted each time, never cached
MIN_BYTES = 16 << 20
#: entries unused this long are removed (by the next process that makes an entry)
UNUSED_DAYS = 30
_MAGIC = b"HPCMACQT"
_ALIGN = 64  # each array starts on a cache line (the kernels read 64 bytes at a time)
_DTYPES = ("<u4", "<f4", "|u1")  # words, float32 scales and biases, E8M0 scales
_SAFE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,150}")
_META = "source.json"
_TOUCH_S = 3600.0  # how stale an entry's last-used time may be before a hit refreshes it
_layout: str | None = None


def enabled() -> bool:
    """Whether ``HPCMAC_GGUF_CACHE`` leaves the cache on (the default)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "off", "no", "false")


def root() -> Path:
    """The folder holding the entries (see the module docstring)."""
    base = os.environ.get(DIR_ENV)
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = os.path.join(xdg, "hpcmac") if xdg else \
            os.path.join(os.path.expanduser("~"), ".cache", "hpcmac")
    return Path(base) / "gguf"


def layout() -> str:
    """A digest of what the cached arrays depend on: :data:`FORMAT` and the source of
    :mod:`~hpcmac.llm.model.gguf_quant` and :mod:`~hpcmac.llm.model.quant` (``to_quant``,
    ``pack``, ``QuantTensor``): an edit there makes new entries, so no version number
    has to be remembered."""
    global _layout
    if _layout is None:
        from hpcmac.llm.model import gguf_quant, quant

        h = hashlib.sha256(f"format {FORMAT}\n".encode())
        for mod in (gguf_quant, quant):
            h.update(Path(mod.__file__).read_bytes())
        _layout = h.hexdigest()[:16]
    return _layout


class TensorCache:
    """The entry of one GGUF file version (``path`` resolved, ``size``, ``mtime_ns``)."""

    def __init__(self, path: str, size: int, mtime_ns: int, folder: Path):
        self.source = {"path": path, "size": size, "mtime_ns": mtime_ns, "layout": layout()}
        self.folder = folder
        self.broken = False  # a write failed: stop trying in this process
        self._touched = False

    def _file(self, name: str) -> Path:
        stem = name if _SAFE.fullmatch(name) else \
            "h" + hashlib.sha256(name.encode()).hexdigest()[:32]
        return self.folder / (stem + ".qt")

    def get(self, name: str, qtype: str, shape: tuple[int, ...]) -> QuantTensor | None:
        """The cached tensor ``name`` of GGUF type ``qtype`` and canonical ``shape``, or
        None when there is none that holds together."""
        try:
            with open(self._file(name), "rb") as f:
                qt = _read(f, os.fstat(f.fileno()).st_size, self.source["layout"], name,
                           qtype, tuple(shape))
        except (OSError, ValueError, KeyError, TypeError, struct.error, UnicodeError):
            return None
        if qt is not None and not self._touched:
            self._touched = True
            _touch(self.folder / _META)
        return qt

    def put(self, name: str, qtype: str, shape: tuple[int, ...], qt: QuantTensor) -> None:
        """Write tensor ``name`` (a temporary file renamed into place); never raises."""
        if self.broken:
            return
        tmp = None
        try:
            if not (self.folder / _META).exists():
                self._make_entry()
            final = self._file(name)
            tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            with open(tmp, "wb") as f:
                _write(f, self.source["layout"], name, qtype, tuple(shape), qt)
            os.replace(tmp, final)
        except OSError:
            self.broken = True
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def _make_entry(self) -> None:
        """Create the entry's folder and its description, then prune the others."""
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.folder / _META, json.dumps(self.source).encode())
        prune(self.folder.parent, keep=self.folder)


def for_file(path: str | os.PathLike) -> TensorCache | None:
    """The cache entry of GGUF file ``path`` (made on its first write), or None when the
    cache is off or the file is smaller than :data:`MIN_BYTES`."""
    if not enabled():
        return None
    try:
        p = Path(path).resolve()
        st = p.stat()
        if st.st_size < MIN_BYTES:
            return None
        src = str(p)
        key = hashlib.sha256(json.dumps([src, st.st_size, st.st_mtime_ns, layout()])
                             .encode()).hexdigest()[:32]
        return TensorCache(src, st.st_size, st.st_mtime_ns, root() / key)
    except OSError:
        return None


def prune(folder: Path, keep: Path | None = None, now: float | None = None) -> list[Path]:
    """Remove the entries under ``folder`` whose GGUF file is gone or changed, or unused
    for :data:`UNUSED_DAYS` days (``keep`` never); returns those removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = [e for e in folder.iterdir() if e.is_dir()]
    except OSError:
        return removed
    for e in entries:
        if keep is not None and e == keep:
            continue
        meta = e / _META
        if not meta.exists():  # another process may be making it right now
            stale = _age(e, now) > 3600
        else:
            try:
                src = json.loads(meta.read_text())
                used = meta.stat().st_mtime
                st = os.stat(src["path"])  # gone: FileNotFoundError, stale
                stale = (st.st_size, st.st_mtime_ns) != (src["size"], src["mtime_ns"]) or \
                    now - used > UNUSED_DAYS * 86400
            except (OSError, ValueError, KeyError, TypeError):
                stale = True
        if stale:
            shutil.rmtree(e, ignore_errors=True)
            removed.append(e)
    return removed


# -- one tensor's file ------------------------------------------------------------------
#
# _MAGIC, a little-endian uint32 header length, the header (JSON), then each array at a
# multiple of _ALIGN bytes: {"layout", "name", "type", "shape", "bits", "group", "source",
# "mode", "arrays": [[field, dtype, shape, offset], ...]} (biases absent in the float
# modes). The file ends where its last array does.


def _write(f, lay: str, name: str, qtype: str, shape: tuple[int, ...],
           qt: QuantTensor) -> None:
    arrays = [("words", qt.words), ("scales", qt.scales)]
    if qt.biases is not None:
        arrays.append(("biases", qt.biases))
    arrays = [(k, np.ascontiguousarray(a)) for k, a in arrays]
    head = {"layout": lay, "name": name, "type": qtype, "shape": list(shape),
            "bits": qt.bits, "group": qt.group, "source": qt.source, "mode": qt.mode}

    def laid_out(start: int) -> list:
        out, off = [], start
        for k, a in arrays:
            out.append([k, a.dtype.str, list(a.shape), off])
            off = -(-(off + a.nbytes) // _ALIGN) * _ALIGN
        return out

    # the offsets depend on the header's length, which depends on their digits: the
    # arrays go after the room a header with wider offsets than any real one takes
    room = len(json.dumps({**head, "arrays": laid_out(10 ** 15)}).encode())
    head["arrays"] = laid_out(-(-(len(_MAGIC) + 4 + room) // _ALIGN) * _ALIGN)
    text = json.dumps(head).encode()
    f.write(_MAGIC + struct.pack("<I", len(text)) + text)
    pos = len(_MAGIC) + 4 + len(text)
    for (_, a), (_, _, _, at) in zip(arrays, head["arrays"]):
        f.write(b"\0" * (at - pos))
        f.write(memoryview(a).cast("B"))
        pos = at + a.nbytes


def _read(f, size: int, lay: str, name: str, qtype: str,
          shape: tuple[int, ...]) -> QuantTensor | None:
    """The tensor in ``f`` (``size`` bytes), or None unless it is the one asked for and
    every length, offset, type and shape in it holds together."""
    first = f.read(len(_MAGIC) + 4)
    if len(first) != len(_MAGIC) + 4 or first[:len(_MAGIC)] != _MAGIC:
        return None
    (n,) = struct.unpack("<I", first[len(_MAGIC):])
    if n > min(size, 1 << 20):
        return None
    head = json.loads(f.read(n).decode())
    if (head["layout"], head["name"], head["type"], tuple(head["shape"])) != \
            (lay, name, qtype, shape):
        return None
    got, end = {}, len(_MAGIC) + 4 + n
    for k, dtype, ashape, at in head["arrays"]:
        if k not in ("words", "scales", "biases") or k in got or dtype not in _DTYPES or \
                not isinstance(at, int) or at < end or at % _ALIGN or \
                not all(isinstance(d, int) and d >= 0 for d in ashape):
            return None
        nbytes = math.prod(ashape) * np.dtype(dtype).itemsize
        if at + nbytes > size:  # checked before allocating: a damaged shape can be huge
            return None
        a = _empty(tuple(ashape), np.dtype(dtype))
        f.seek(at)
        if a.nbytes and f.readinto(memoryview(a).cast("B")) != a.nbytes:
            return None
        got[k], end = a, at + a.nbytes
    if end != size or "words" not in got or "scales" not in got:
        return None
    bits, group = head["bits"], head["group"]
    if bits not in (2, 3, 4, 5, 6, 8) or group not in (32, 64, 128):
        return None
    qt = QuantTensor(got["words"], got["scales"], got.get("biases"), bits, group,
                     str(head["source"]), str(head["mode"]))
    groups = (*shape[:-1], shape[-1] // group)
    if qt.shape != shape or qt.scales.shape != groups or \
            (qt.biases is not None and qt.biases.shape != groups) or \
            (qt.biases is None) != (qt.mode != "affine"):
        return None
    return qt


def _empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on an ``_ALIGN``-byte boundary (the
    numpy backend keeps 8-bit codes as they are when aligned: no second copy)."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(n + _ALIGN, np.uint8)
    off = -buf.ctypes.data % _ALIGN
    return buf[off:off + n].view(dtype).reshape(shape)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _touch(meta: Path) -> None:
    """Mark an entry used now (its description's mtime), at most once an hour."""
    try:
        if time.time() - meta.stat().st_mtime > _TOUCH_S:
            os.utime(meta)
    except OSError:
        pass


def _age(p: Path, now: float) -> float:
    try:
        return now - p.stat().st_mtime
    except OSError:
        return 0.0
