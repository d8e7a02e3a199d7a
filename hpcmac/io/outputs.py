"""Output files that cannot be lost: checked before the run, locked, written as the path asks.

Every file a command writes for its user goes through here (HPL.out, every
``--json``, generated hostfiles). How a path is written depends on what it is
(:func:`target`):

* **a regular file, or nothing yet**: atomically. The text goes to a temporary
  ``.NAME.HOST.PID.XXXX.tmp`` beside it, is flushed to disk and renamed over
  it: a reader (or a kill) sees the old file or the new one, never half of one.
* **a symlink**: resolved, and its target written atomically in the target's
  directory (the link stays a link). When that directory cannot take a
  temporary file, the target is written in place, and a ``note:`` line says so.
* **a character device, FIFO or block device** (``/dev/null``, a pipe): written
  through, opened as C's ``fopen(path, "w")`` opens it, never renamed over.
* **a directory or a socket**: refused in one line before the run.

:func:`check_writable` runs before any work, :class:`OutputLock` is held for
the whole job (a second job writing the same file refuses to start), and
:class:`AtomicText` is a stream written over a long run (HPL.out) that replaces
the old file only when complete. A write that fails (a full disk, an I/O
error) is one line naming the path (:class:`OutputError`), never a traceback.

Temporaries name their host and process: one left by a killed writer
(``kill -9``) is removed by the next writer of the same file on that host.
"""

from __future__ import annotations

import errno
import io
import os
import re
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpcmac import interrupts
from hpcmac.errors import UsageError


class OutputError(UsageError):
    """Writing an output failed mid-run (disk full, I/O error): one line, exit 1.

    Raised on the writing rank alone (``local=True``), :func:`hpcmac.lifecycle.run_cli`
    prints the line and ends the job at once (under MPI the other ranks are not there
    to agree). A driver that shares the failure with every rank first (a broadcast
    after each run) raises it with ``local=False``: every rank leaves together."""

    code = 1

    def __init__(self, message: str, local: bool = True):
        super().__init__(message)
        self.local = local


@dataclass(frozen=True)
class Target:
    """Where and how an output path is written (local: rank 0's file system).

    ``path`` as given, ``real`` the file the bytes reach (symlinks resolved) and
    ``how``: ``"atomic"`` (temporary + rename), ``"inplace"`` (the target opened
    and truncated: its directory takes no temporary) or ``"stream"`` (written
    through: a device, a FIFO, standard output)."""

    path: str
    real: str
    how: str


def target(path: str, what: str) -> Target:
    """How ``path`` will be written; UsageError (one line) for a directory, a socket or a
    symlink loop. Touches nothing (the writability probe is :func:`check_writable`'s)."""
    if path == "-":
        return Target(path, "/dev/stdout", "stream")
    if not path:
        raise UsageError(f"{what}: empty path (name a file, or leave the option out)")
    try:
        st = os.stat(path)  # the kernel follows the links (also /proc's fd links)
    except (FileNotFoundError, NotADirectoryError):  # check_writable says which
        st = None
    except OSError as exc:  # a symlink loop, a name too long, ...
        raise UsageError(f"{what} {path}: cannot write: {_reason(exc)}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{what} {path}: cannot write: it is a directory")
    if st is not None and stat.S_ISSOCK(st.st_mode):
        raise UsageError(f"{what} {path}: cannot write: it is a socket (open() cannot "
                         "write to one)")
    if (st is not None and not stat.S_ISREG(st.st_mode)) or _via_dev(path):
        return Target(path, path, "stream")  # opened by its own name, links and all
    real = os.path.realpath(path, strict=False)
    return Target(path, real, _atomic_or_inplace(real, st))


def _via_dev(path: str) -> bool:
    """True when ``path`` or a symlink it leads through lies under /dev or /proc:
    ``/dev/stdout`` or ``/dev/fd/1`` redirected to a file must be written through that
    descriptor's file, never replaced (the shell's redirection would lose it)."""
    p = os.path.abspath(path)
    for _ in range(40):
        if p.startswith(("/dev/", "/proc/")):
            return True
        if not os.path.islink(p):
            return False
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return False


def _atomic_or_inplace(real: str, st: os.stat_result | None) -> str:
    """``"atomic"`` when ``real``'s directory takes a new file (or cannot be checked yet),
    ``"inplace"`` when it does not but the file itself exists and is writable."""
    parent = os.path.dirname(real) or "."
    if st is None or os.access(parent, os.W_OK | os.X_OK):
        return "atomic"
    return "inplace" if os.access(real, os.W_OK) else "atomic"


def check_writable(path: str, what: str) -> Target:
    """UsageError (one line) unless ``path`` can be written as :func:`target` says; the
    directory of an atomic write is tested by creating (and removing) a probe there.
    Removes the temporaries that dead writers of ``path`` left on this host. Prints the
    ``note:`` line of an in-place write. Returns the :class:`Target`.

    Local: call on the rank that writes (rank 0), before the run.
    """
    t = target(path, what)
    if t.how == "stream":
        if not os.access(t.real, os.W_OK) and os.geteuid() != 0:
            raise UsageError(f"{what} {path}: cannot write: permission denied")
        return t
    real = Path(t.real)
    parent = real.parent
    if os.path.islink(path):
        shown = f"{str(parent)!r} (the symlink's target directory)"
    else:
        parent = Path(path).parent if str(Path(path).parent) else Path(".")
        shown = f"{str(parent)!r}"
    if not parent.exists():
        raise UsageError(f"{what} {path}: cannot write: directory {shown} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{what} {path}: cannot write: {shown} is not a directory")
    if t.how == "inplace":
        _note_inplace(t, what)
        return t
    remove_stale(t.real)
    try:  # the real test: create (and remove) a file where the temporary will go
        fd, probe = tempfile.mkstemp(prefix=_tmp_prefix(real.name), suffix=".probe",
                                     dir=parent)
        os.close(fd)
        try:
            os.unlink(probe)
        except FileNotFoundError:  # a lock holder elsewhere swept it: it was made
            pass
    except OSError as exc:
        if real.exists() and os.access(real, os.W_OK):  # e.g. root-squashed NFS
            t = Target(t.path, t.real, "inplace")
            _note_inplace(t, what)
            return t
        raise UsageError(f"{what} {path}: cannot write in {str(parent)!r}: "
                         f"{_reason(exc)}") from None
    if real.exists() and not os.access(real, os.W_OK) and os.geteuid() != 0:
        raise UsageError(f"{what} {path}: cannot write: the file is read-only")
    return t


def output_path(text: str) -> str:
    """argparse ``type=`` of an output flag: an empty name is refused (``--json ''`` used
    to be ignored without a word); the rest is checked by :func:`check_writable`."""
    if not text:
        import argparse

        raise argparse.ArgumentTypeError("expected a file name ('-': standard output), "
                                         "found ''")
    return text


def checked_output(what: str):
    """argparse ``type=`` for a command run as one process: :func:`output_path`, then
    :func:`check_writable` as the flags are read (one line, exit 2, before any work).
    A command run by mpirun checks on rank 0 instead (:func:`check_on_root`)."""
    def check(text: str) -> str:
        check_writable(output_path(text), what)
        return text

    check.__name__ = "output path"  # argparse names the type in its messages
    return check


def check_on_root(group, path: str | None, what: str) -> None:
    """Collective: :func:`check_writable` on rank 0 (the writer) before any work, its
    verdict raised on every rank alike (ranks on other hosts may not see rank 0's
    folder). ``group``: anything with ``rank`` and ``bcast_obj``."""
    if not path:
        return
    err = None
    if group.rank == 0:
        try:
            check_writable(path, what)
        except UsageError as exc:
            err = str(exc)
    err = group.bcast_obj(err, 0)
    if err:
        raise UsageError(err)


_NOTED: set[str] = set()


def _note_inplace(t: Target, what: str) -> None:
    if t.real in _NOTED:
        return
    _NOTED.add(t.real)
    print(f"note: {what} {t.path}: {os.path.dirname(t.real)!r} takes no temporary file: "
          f"writing {t.real} in place (an interrupted run leaves it incomplete)",
          file=sys.stderr, flush=True)


def write_atomic(path: str, text: str, what: str = "output") -> None:
    """Write ``text`` to ``path`` as :func:`target` says: a file replaced all at once
    (temporary + fsync + rename), a symlink's target likewise, a device written through.
    A failed write is an :class:`OutputError` (one line naming the path)."""
    with AtomicText(path, what) as fh:
        fh.write(text)


class AtomicText:
    """A text output for ``path``, complete on :meth:`commit` (or a clean ``with`` exit).

    For a file (or a symlink's target): written to ``.NAME.HOST.PID.XXXX.tmp`` beside it
    and renamed over it on commit; :meth:`discard` (or an exception) removes the
    temporary and leaves the previous file as it was. In place (the directory takes no
    temporary): kept in memory and written on commit. A device or FIFO: written through
    from the start (opening a FIFO waits for its reader, as ``fopen`` does)."""

    def __init__(self, path: str, what: str = "output"):
        self.path, self.what = path, what
        self.t = target(path, what)
        self.tmp: str | None = None
        try:
            if self.t.how == "stream":
                # standard output or error by another name (/dev/stdout, /dev/fd/2, the
                # tty): write through the process's own stream, at its offset
                std = _std_alias(self.t.real)
                self.fh = _Borrowed(std) if std is not None \
                    else open(self.t.real, "w")  # noqa: SIM115 (closed by commit/discard)
            elif self.t.how == "inplace":
                self.fh = io.StringIO()
            else:
                try:
                    self._open_temporary()
                except OSError:  # the directory takes no new file: write the file in place
                    if not os.access(self.t.real, os.W_OK):
                        raise
                    self.t = Target(self.t.path, self.t.real, "inplace")
                    _note_inplace(self.t, what)
                    self.fh = io.StringIO()
        except OSError as exc:
            raise OutputError(self._failed(exc)) from None

    def _open_temporary(self) -> None:
        real = Path(self.t.real)
        remove_stale(self.t.real)
        fd, self.tmp = tempfile.mkstemp(prefix=_tmp_prefix(real.name), suffix=".tmp",
                                        dir=real.parent)
        self.fh = os.fdopen(fd, "w")
        interrupts.on_interrupt(self._remove)
        try:  # keep the old file's permissions; a new file gets the umask's
            os.chmod(self.tmp, stat.S_IMODE(os.stat(real).st_mode))
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self.tmp, 0o666 & ~umask)

    def _failed(self, exc: OSError) -> str:
        shown = self.path if self.t.real in (self.path, os.path.abspath(self.path)) \
            else f"{self.path} (-> {self.t.real})"
        return f"{self.what} {shown}: cannot write: {_reason(exc)}"

    #: the one line of a write that failed (None while all is well); :meth:`commit`
    #: raises it, and a driver may check it after each run to stop every rank together
    error: str | None = None

    def write(self, text: str) -> int:
        """Write ``text``; a failure is kept in :attr:`error` (the rest is dropped)."""
        if self.error is not None:
            return 0
        try:
            return self.fh.write(text)
        except OSError as exc:
            self._fail(exc)
            return 0

    def flush(self) -> None:
        if self.error is not None:
            return
        try:
            self.fh.flush()
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        self.error = self._failed(exc)
        self._give_up()

    def commit(self) -> None:
        """Complete the output: flush, fsync and rename the temporary over the target
        (atomic), write the kept text (in place), or flush and close (stream).
        An :class:`OutputError` if a write failed (then nothing replaced the target)."""
        if self.error is not None:
            raise OutputError(self.error)
        if self.fh.closed:
            return
        try:
            if self.t.how == "inplace":
                text = self.fh.getvalue()
                self.fh.close()
                with open(self.t.real, "w") as out:
                    out.write(text)
                return
            self.fh.flush()
            if self.t.how == "atomic":
                os.fsync(self.fh.fileno())
            self.fh.close()
            if self.tmp is not None:
                os.replace(self.tmp, self.t.real)
                interrupts.forget(self._remove)
        except OSError as exc:
            self._give_up()
            raise OutputError(self._failed(exc)) from None

    def discard(self) -> None:
        """Drop what was written: remove the temporary (``path`` keeps its previous
        content); a stream is closed (what it was sent is gone already)."""
        self._give_up()

    def _give_up(self) -> None:
        if not self.fh.closed:
            try:
                self.fh.close()
            except OSError:  # the buffered rest could not be written either
                pass
        if self.tmp is not None:
            self._remove()
            interrupts.forget(self._remove)

    def _remove(self) -> None:
        try:
            os.unlink(self.tmp)
        except (FileNotFoundError, TypeError):
            pass

    close = commit

    def __enter__(self) -> AtomicText:
        return self

    def __exit__(self, kind, _value, _tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()


class _Borrowed:
    """sys.stdout or sys.stderr lent to an output: closing it only flushes it."""

    def __init__(self, stream):
        self.stream, self.closed = stream, False

    def write(self, text: str) -> int:
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.stream.flush()


def _std_alias(path: str):
    """sys.stdout or sys.stderr when ``path`` is the file it writes to, else None."""
    if path in ("-", "/dev/stdout"):
        return sys.stdout
    try:
        st = os.stat(path)
    except OSError:
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            fst = os.fstat(stream.fileno())
        except (OSError, ValueError, AttributeError):  # replaced or closed
            continue
        if (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
            return stream
    return None


def _reason(exc: OSError) -> str:
    """A failed call's reason in words: ``no space left on device``, ``permission denied``."""
    if exc.errno == errno.ENOSPC:
        return "no space left on device"
    return (exc.strerror or str(exc)).lower()


# -- temporaries that name their writer ----------------------------------------

def _host() -> str:
    """This host's name as it may appear in a file name (no dots: they separate fields)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"


def _tmp_prefix(name: str) -> str:
    return f".{name}.{_host()}.{os.getpid()}."


def remove_stale(real: str, locked: bool = False) -> list[str]:
    """Remove the temporaries (``.NAME.HOST.PID.*.tmp`` or ``.probe``) that writers of
    ``real`` left on this host and whose process is gone (killed mid-run); a live
    writer's and another host's (a shared file system) are kept. ``locked``: the caller
    holds the :class:`OutputLock`, so no other job writes ``real`` and every temporary of
    it but this process's goes, another host's and the unnamed ``.NAME.XXXXXXXX.tmp`` of
    older versions too. Returns the removed."""
    folder, name = os.path.split(real)
    mine = re.compile(rf"^\.{re.escape(name)}\.{re.escape(_host())}\.(\d+)\.[^.]+"
                      r"\.(tmp|probe)$")
    anyone = re.compile(rf"^\.{re.escape(name)}\.(?:[^.]+\.\d+\.)?[A-Za-z0-9_]+"
                        r"\.(tmp|probe)$")
    removed = []
    try:
        entries = os.listdir(folder or ".")
    except OSError:
        return removed
    for entry in entries:
        m = mine.match(entry)
        if m is not None:
            if _alive(int(m.group(1))):
                continue
        elif not (locked and anyone.match(entry)):
            continue
        try:
            os.unlink(os.path.join(folder or ".", entry))
            removed.append(entry)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's live process
        return True
    return True


# -- one writer per output -------------------------------------------------------

class OutputLock:
    """An exclusive lock on output ``path`` for this process's lifetime (or until
    :meth:`release`). A second job taking it gets a UsageError naming the path.

    The lock is ``fcntl.flock`` on ``.NAME.lock`` beside the file written (a
    symlink's target), so it dies with the process (even on kill -9) and never
    needs clearing by hand. A device or FIFO is not locked; a file written in place
    (its directory takes no new file) is locked itself.
    """

    def __init__(self, path: str, what: str):
        import fcntl

        self.fd = -1
        self.lock: str | None = None
        t = target(path, what)
        if t.how == "stream":
            return
        p = Path(t.real)
        if t.how == "inplace" or not os.access(p.parent, os.W_OK | os.X_OK):
            self._lock_itself(t, what)
            return
        self.lock = str(p.with_name(f".{p.name}.lock"))
        while True:
            try:
                fd = os.open(self.lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                             0o644)
            except OSError as exc:
                raise UsageError(f"{what} {path}: cannot create lock {self.lock}: "
                                 f"{_reason(exc)}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _read_holder(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UsageError(f"{what} {path}: another job{holder} is writing it "
                                     "(wait for it, or choose another file)") from None
                raise UsageError(f"{what} {path}: cannot lock {self.lock}: "
                                 f"{_reason(exc)}") from None
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
        remove_stale(t.real, locked=True)  # no other job writes it: any temporary is stale

    def _lock_itself(self, t: Target, what: str) -> None:
        import fcntl

        try:
            fd = os.open(t.real, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise UsageError(f"{what} {t.path}: cannot write: {_reason(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UsageError(f"{what} {t.path}: another job is writing it "
                             "(wait for it, or choose another file)") from None
        self.fd = fd
        interrupts.on_interrupt(self.release)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd < 0:
            return
        interrupts.forget(self.release)
        if self.lock is not None:
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
