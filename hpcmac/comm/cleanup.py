"""Leave nothing behind: Open MPI's shared-memory segment and singleton session directory.

Open MPI 5 (the PyPI wheel, 5.0.x) creates ``/dev/shm/sm_segment.HOST.UID.JOB.LOCALRANK``
for its shared-memory transport in every process and relies on its runtime to
remove it; measured here, the file stays after a normal ``MPI_Finalize`` (under
mpirun and in a singleton), and a process started without mpirun also leaves
``$TMPDIR/ompi.HOST.UID/jf.0/...``. :func:`finalize` finalizes MPI and removes
this process's own segment and (when empty) the singleton's session
directories; :func:`drop_segment` removes the segment alone, for a process
about to ``os._exit`` without finalizing. Nothing here imports mpi4py: it is
used only once MPI was started by someone else. Linux only (other systems
keep Open MPI's files elsewhere); a no-op where ``/proc/self/maps`` is absent.
"""

from __future__ import annotations

import os
import sys
import tempfile

_SEGMENT_MARKS = ("/sm_segment.", "/vader_segment.")
_before_finalize: list = []


def before_finalize(fn) -> None:
    """Run ``fn()`` at the start of :func:`finalize`, before MPI_Finalize (once per ``fn``).

    What must end while the peers still listen registers here (the heartbeat says
    goodbye), so this module imports none of its users.
    """
    if fn not in _before_finalize:
        _before_finalize.append(fn)


def own_segments() -> list[str]:
    """Paths of the shared-memory segments this process created (mapped, named for its
    uid and local rank)."""
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    uid = f".{os.getuid()}."
    found = []
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) == 6 else ""
                if (any(m in path for m in _SEGMENT_MARKS) and uid in path
                        and path.endswith(f".{local}") and path not in found):
                    found.append(path)
    except OSError:
        pass
    return found


def drop_segment(paths: list[str] | None = None) -> None:
    """Unlink this process's segments (peers that mapped them keep their mapping)."""
    for path in own_segments() if paths is None else paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _singleton_dirs(segments: list[str]) -> list[str]:
    """This singleton's session directories, deepest first (removed only when empty).

    The job id is the one in its segment's name (hex), the directory's name in decimal.
    """
    if any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")):
        return []  # under a launcher: its daemon owns the session directory
    top = os.path.join(tempfile.gettempdir(), f"ompi.{os.uname().nodename}.{os.getuid()}")
    jobs = os.path.join(top, "jf.0")
    out = []
    for seg in segments:
        try:
            job = str(int(seg.rsplit(".", 2)[-2], 16))
        except (ValueError, IndexError):
            continue
        out += [os.path.join(jobs, job, "0"), os.path.join(jobs, job)]
    return out + [jobs, top]


def finalize() -> None:
    """Finalize MPI (when started and not yet finalized) and remove what it leaves behind.

    Collective in the MPI sense (MPI_Finalize); safe to call twice.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    for fn in list(_before_finalize):  # the heartbeat's goodbye first: MPI_Finalize may
        fn()                           # wait long, silencing it
    segments = own_segments()
    singleton = _singleton_dirs(segments)
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        # MPI_Finalize holds the GIL while it waits for the other ranks: no Python
        # handler could run, so a signal now takes its default action (the work is done)
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
    mpi.Finalize()
    drop_segment(segments)
    for d in singleton:
        try:
            os.rmdir(d)  # only when empty: another singleton may be running
        except OSError:
            pass
