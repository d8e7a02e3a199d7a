"""Output files that cannot be lost: checked before the run, locked, replaced whole.

* :func:`check_writable` runs before any work: the directory exists and takes
  a new file, and the path is not a directory or a special file.
* :class:`OutputLock` is held for the whole job: a second job writing the
  same file refuses to start with one line (``fcntl.flock`` on a hidden lock
  file next to the output, removed at the end).
* :func:`write_atomic` writes a temporary file in the same directory, flushes
  it to disk and renames it over the old one: a reader (or a kill) sees the
  old file or the new one, never half of one.
* :class:`AtomicText` does the same for a stream written over a long run
  (HPL.out): the new file replaces the old only when it is complete.

Paths that are not files (``/dev/stdout``, ``-``) are written directly.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from hpcmac import interrupts
from hpcmac.errors import UsageError


def _is_stream(path: str) -> bool:
    """True for outputs that are not files we may replace (``-``, /dev/stdout, a pipe)."""
    if path == "-":
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    return not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode)


def check_writable(path: str, what: str) -> None:
    """UsageError (one line) unless a file at ``path`` can be created and renamed into place.

    Local: call on the rank that writes (rank 0), before the run.
    """
    if _is_stream(path):
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {path}: cannot write: it is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.exists():
        raise UsageError(f"{what} {path}: cannot write: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: cannot write: {str(parent)!r} is not a directory")
    try:  # the real test: create (and remove) a file where the temporary will go
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot write in {str(parent)!r}: "
                         f"{exc.strerror}") from None
    if p.exists() and not os.access(p, os.W_OK) and os.geteuid() != 0:
        raise UsageError(f"{what} {path}: cannot write: the file is read-only")


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` all at once (temporary file + fsync + rename)."""
    if _is_stream(path):
        with open(path if path != "-" else "/dev/stdout", "w") as fh:
            fh.write(text)
        return
    with AtomicText(path) as fh:
        fh.write(text)


class AtomicText:
    """A text file written to ``.NAME.XXXX.tmp`` beside ``path`` and renamed over it on
    :meth:`commit` (or a clean ``with`` exit); :meth:`discard` (or an exception)
    removes the temporary and leaves the previous file as it was."""

    def __init__(self, path: str):
        self.path = path
        p = Path(path)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp",
                                        dir=p.parent if str(p.parent) else ".")
        self.fh = os.fdopen(fd, "w")
        interrupts.on_interrupt(self._remove)
        try:  # keep the old file's permissions; a new file gets the umask's
            os.chmod(self.tmp, stat.S_IMODE(os.stat(path).st_mode))
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.tmp, 0o666 & ~umask)

    def write(self, text: str) -> int:
        return self.fh.write(text)

    def flush(self) -> None:
        self.fh.flush()

    def commit(self) -> None:
        """Flush, fsync and rename the temporary over ``path``."""
        if self.fh.closed:
            return
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)
        interrupts.forget(self._remove)

    def discard(self) -> None:
        """Remove the temporary; ``path`` keeps its previous content."""
        if not self.fh.closed:
            self.fh.close()
        self._remove()
        interrupts.forget(self._remove)

    def _remove(self) -> None:
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass

    close = commit

    def __enter__(self) -> AtomicText:
        return self

    def __exit__(self, kind, _value, _tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


class OutputLock:
    """An exclusive lock on output ``path`` for this process's lifetime (or until
    :meth:`release`). A second job taking it gets a UsageError naming the path.

    The lock is ``fcntl.flock`` on ``.NAME.lock`` beside the output, so it dies
    with the process (even on kill -9) and never needs clearing by hand.
    """

    def __init__(self, path: str, what: str):
        import fcntl

        self.fd = -1
        if _is_stream(path):
            return
        p = Path(path)
        self.lock = str(p.with_name(f".{p.name}.lock"))
        while True:
            try:
                fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                             0o644)
            except OSError as exc:
                raise UsageError(f"{what} {path}: cannot create lock {self.lock}: "
                                 f"{exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UsageError(f"{what} {path}: another job{holder} is writing it "
                                     "(wait for it, or choose another file)") from None
                raise UsageError(f"{what} {path}: cannot lock {self.lock}: "
                                 f"{exc.strerror}") from None
            # the previous holder may have removed the file between our open and flock
            try:
                same = os.stat(self.lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        interrupts.on_interrupt(self.release)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd < 0:
            return
        interrupts.forget(self.release)
        try:
            os.unlink(self.lock)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *_exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        pid = os.pread(fd, 32, 0).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""
