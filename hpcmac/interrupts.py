"""SIGINT and SIGTERM end a command at once: one line, exit 130 / 143, nothing left.

Python runs signal handlers in the main thread between bytecodes, so a rank
blocked in an MPI wait or a long BLAS call would not notice a signal until
that call returns (a blocked collective: never). :func:`install` therefore
lets the C-level handler wake a small watcher thread (``signal.set_wakeup_fd``)
that acts at once, whatever the main thread is doing:

1. prints ``interrupted, rank R`` (R: this process's rank in the launcher's world);
2. runs the cleanups registered with :func:`on_interrupt` (temporary output
   files removed, output locks released: the previous results stay whole);
3. removes this process's Open MPI shared-memory segment;
4. ``os._exit(128 + signal)``: 130 for SIGINT, 143 for SIGTERM, without
   ``MPI_Finalize`` (which would wait for ranks that are not coming); the
   launcher sees a rank leave and ends the others.

A rank started by Open MPI's launcher (``prterun``/``prted``, or MPICH's proxy) also
asks the kernel for a SIGTERM when that parent exits (``PR_SET_PDEATHSIG``, Linux): the
launcher puts each rank in a process group of its own, so a launcher that is killed or
crashes would otherwise leave its ranks running (a one-rank ``serve`` has no MPI
connection that could notice). The SIGTERM ends the rank as above.

A command that installs its own SIGINT handler (the LLM pipeline's
stop-after-this-step on the first Ctrl-C) keeps it: the watcher acts only on
signals whose handler is still :func:`install`'s. A SIGINT ignored by the
parent (a background job of a shell script) stays ignored.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

_cleanups: list[Callable[[], None]] = []
#: signals a command handles itself just now: signum -> (depth, monotonic end of the last)
_deferred: dict[int, list[float]] = {}
#: after a deferral ends, a late wake-up byte is still taken as the command's (seconds)
_DEFER_GRACE = 3.0
_lock = threading.Lock()
_state = {"installed": False, "exiting": False}


def on_interrupt(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` (no arguments, quick, may run in another thread) if a signal ends the
    process; returns ``fn`` for :func:`forget`."""
    with _lock:
        _cleanups.append(fn)
    return fn


def forget(fn: Callable[[], None]) -> None:
    """Drop a cleanup registered with :func:`on_interrupt` (no error if absent)."""
    with _lock:
        try:
            _cleanups.remove(fn)
        except ValueError:
            pass


class deferred:
    """``with deferred(signal.SIGINT):`` the command's own handler deals with the signal
    (the pipeline's stop-after-this-step); the watcher leaves it alone, also for a wake-up
    it reads up to a few seconds after the block ends (a loaded machine schedules threads
    late)."""

    def __init__(self, signum: int):
        self.signum = signum

    def __enter__(self) -> deferred:
        with _lock:
            depth_end = _deferred.setdefault(self.signum, [0, 0.0])
            depth_end[0] += 1
        return self

    def __exit__(self, *_exc) -> None:
        import time

        with _lock:
            depth_end = _deferred[self.signum]
            depth_end[0] -= 1
            depth_end[1] = time.monotonic()


def _is_deferred(signum: int) -> bool:
    import time

    with _lock:
        depth, end = _deferred.get(signum, (0, 0.0))
    return depth > 0 or time.monotonic() - end < _DEFER_GRACE


def _handler(signum, _frame) -> None:
    """The Python-level handler: the watcher thread does the work; this is the fallback
    when the wake-up byte could not be written."""
    end(signum)


def end(signum: int) -> None:
    """Print ``interrupted, rank R``, clean up, exit 128 + ``signum`` (see :func:`die`)."""
    from hpcmac.errors import world_rank

    die(f"interrupted, rank {world_rank()}", 128 + signum)


def die(line: str, code: int) -> None:
    """From any thread: print ``line``, run the cleanups, drop this process's MPI
    segment and ``os._exit(code)`` (no MPI_Finalize). The first caller wins."""
    with _lock:
        if _state["exiting"]:
            return
        _state["exiting"] = True
        cleanups = list(reversed(_cleanups))
    try:  # straight to the descriptor: the main thread may hold sys.stderr's lock
        os.write(2, f"{line}\n".encode())
    except OSError:
        pass
    for fn in cleanups:
        try:
            fn()
        except Exception:  # noqa: S110 - best effort while exiting
            pass
    if "mpi4py.MPI" in sys.modules:
        from hpcmac.comm.cleanup import drop_segment

        drop_segment()
    os._exit(code)


def _watch(sock: socket.socket, handled: tuple[int, ...]) -> None:
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in handled and signal.getsignal(signum) is _handler \
                    and not _is_deferred(signum):
                end(signum)


def install() -> None:
    """Handle SIGTERM and (unless ignored) SIGINT as the module says. Main thread only;
    idempotent."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    handled = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        handled.append(signal.SIGINT)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        reader.close()
        writer.close()
        return
    for signum in handled:
        signal.signal(signum, _handler)
    _state["installed"] = True
    _state["sockets"] = (reader, writer)  # kept alive with the process
    threading.Thread(target=_watch, args=(reader, tuple(handled)), daemon=True,
                     name="hpcmac-interrupts").start()
    if launcher_parent():
        from hpcmac.mpirun import die_with_parent

        die_with_parent(signal.SIGTERM)


#: the processes that start ranks: Open MPI 5 (PRRTE), Open MPI 4, MPICH (hydra)
LAUNCHERS = ("prterun", "prted", "orted", "mpirun", "mpiexec", "hydra_pmi_proxy")


def launcher_parent() -> bool:
    """Whether this process is a rank whose parent is an MPI launcher or its daemon."""
    if not any(v in os.environ for v in ("PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")):
        return False
    try:
        with open(f"/proc/{os.getppid()}/comm") as fh:
            return fh.read().strip() in LAUNCHERS
    except OSError:
        return False
