"""The MPI transport: mpi4py buffer (uppercase) calls, zero copy."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from hpcmac.comm import mpi_start
from hpcmac.comm.base import Group, Request, check_op, pick_maxloc

_BOOL = np.dtype(np.bool_)


def is_available() -> tuple[bool, str]:
    """(usable, reason) without initialising anything beyond importing mpi4py."""
    try:
        mpi_start.load()
    except Exception as exc:  # pragma: no cover - import failures vary
        return False, f"mpi: mpi4py does not import ({exc})"
    return True, ""


class MPIRequest(Request):
    """An mpi4py request (kept slim: one is built per isend/irecv)."""

    __slots__ = ("_req",)

    def __init__(self, req):
        self._req = req

    def wait(self) -> None:
        self._req.Wait()

    def test(self) -> bool:
        return bool(self._req.Test())

    def _finish(self) -> None:
        """After completion: nothing to do for a request on the caller's own buffer."""


class _CopyRequest(MPIRequest):
    """A request on a contiguous temporary: ``keep`` alive, copied ``into`` on completion."""

    __slots__ = ("_keep", "_into")

    def __init__(self, req, keep: np.ndarray, into: np.ndarray | None = None):
        self._req, self._keep, self._into = req, keep, into

    def wait(self) -> None:
        self._req.Wait()
        self._finish()

    def test(self) -> bool:
        done = bool(self._req.Test())
        if done:
            self._finish()
        return done

    def _finish(self) -> None:
        if self._into is not None:
            self._into[...] = self._keep
            self._into = None


class MPIGroup(Group):
    """A Group over an mpi4py communicator (``COMM_WORLD`` by default)."""

    transport = "mpi"

    def __init__(self, comm=None):
        MPI = mpi_start.load()
        _clean_at_exit()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self._rank = self.comm.Get_rank()
        self._size = self.comm.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._IN_PLACE = MPI.IN_PLACE

    # Hot path: the buffer goes straight to mpi4py; only when mpi4py refuses it
    # (a non-contiguous view) do we pay for a contiguous copy.
    def send(self, buf, dest, tag=0):
        try:
            self.comm.Send(buf, dest, tag)
        except BufferError:
            self.comm.Send(np.ascontiguousarray(buf), dest, tag)

    def recv(self, buf, source, tag=0):
        try:
            self.comm.Recv(buf, source, tag)
        except BufferError:
            tmp = np.empty(buf.shape, dtype=buf.dtype)
            self.comm.Recv(tmp, source, tag)
            buf[...] = tmp
        return buf

    def isend(self, buf, dest, tag=0):
        try:
            return MPIRequest(self.comm.Isend(buf, dest, tag))
        except BufferError:
            tmp = np.ascontiguousarray(buf)
            return _CopyRequest(self.comm.Isend(tmp, dest, tag), tmp)

    def irecv(self, buf, source, tag=0):
        try:
            return MPIRequest(self.comm.Irecv(buf, source, tag))
        except BufferError:
            tmp = np.empty(buf.shape, dtype=buf.dtype)
            return _CopyRequest(self.comm.Irecv(tmp, source, tag), tmp, into=buf)

    def waitall(self, requests):
        # one MPI_Waitall instead of a Python loop: it matters for streams of isends
        self._MPI.Request.Waitall([r._req for r in requests])
        for r in requests:
            if r.__class__ is not MPIRequest:
                r._finish()

    def bcast(self, buf, root=0):
        try:
            self.comm.Bcast(buf, root)
        except BufferError:
            tmp = np.ascontiguousarray(buf)
            self.comm.Bcast(tmp, root)
            buf[...] = tmp
        return buf

    def allreduce(self, buf, op="sum", out=None):
        mop = self._ops.get(op)
        if mop is None:
            check_op(op)
        if buf.dtype is _BOOL:  # MPI has no MAX/MIN on C bool: reduce bytes (sum = or)
            res = self.allreduce(np.ascontiguousarray(buf).view(np.uint8),
                                 "max" if op == "sum" else op).view(np.bool_)
            if out is None:
                return res
            out[...] = res
            return out
        if out is None:
            out = np.empty(buf.shape, dtype=buf.dtype)
        try:
            if out is buf:
                self.comm.Allreduce(self._IN_PLACE, out, mop)
            else:
                self.comm.Allreduce(buf, out, mop)
        except BufferError:  # a non-contiguous view: reduce a contiguous copy
            out[...] = self.allreduce(np.ascontiguousarray(buf), op)
        return out

    def allreduce_maxloc(self, value, index):
        pairs = np.empty((self._size, 2), dtype=np.float64)
        self.comm.Allgather(np.array([value, index], dtype=np.float64), pairs)
        return pick_maxloc(pairs)

    def allgather(self, buf, out=None):
        buf = np.asarray(buf)
        if not buf.flags.c_contiguous:
            buf = np.ascontiguousarray(buf)
        if out is None:
            out = np.empty((self._size, *buf.shape), dtype=buf.dtype)
        try:
            self.comm.Allgather(buf, out)
        except BufferError:  # a non-contiguous out
            tmp = np.empty(out.shape, dtype=out.dtype)
            self.comm.Allgather(buf, tmp)
            out[...] = tmp
        return out

    def reduce_scatter(self, buf, op="sum"):
        buf = np.ascontiguousarray(buf)
        if buf.shape[0] != self._size:
            raise ValueError(
                f"reduce_scatter: leading dimension {buf.shape[0]} != group size {self._size}")
        if buf.dtype is _BOOL:  # as in allreduce: bytes, sum = or
            op8 = "max" if op == "sum" else op
            return self.reduce_scatter(buf.view(np.uint8), op8).view(np.bool_)
        out = np.empty(buf.shape[1:], dtype=buf.dtype)
        self.comm.Reduce_scatter_block(buf, out, self._ops[check_op(op)])
        return out

    def barrier(self):
        self.comm.Barrier()

    def split(self, color, key=0):
        return MPIGroup(self.comm.Split(color, key))

    def abort(self, code=1):
        self.comm.Abort(code)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root)

    def allgather_obj(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)


_cleaning: list[bool] = []


def _clean_at_exit() -> None:
    """Once: at exit, finalize MPI ourselves and remove Open MPI's /dev/shm segment
    (registered after mpi4py's own finalizer, so it runs first; see comm.cleanup).

    A process leaving on an uncaught exception aborts the job instead: its peers may
    be waiting in a collective, so MPI_Finalize would wait for ever (``python -m
    mpi4py script.py`` asks mpi4py to abort at exit, but this finalizer runs first).
    """
    if not _cleaning:
        import atexit
        import sys

        from hpcmac.comm.cleanup import finalize

        previous = sys.excepthook

        def note_uncaught(kind, value, tb):
            _uncaught.append(kind)
            previous(kind, value, tb)

        sys.excepthook = note_uncaught
        atexit.register(_at_exit, finalize)
        _cleaning.append(True)


_uncaught: list = []


def _at_exit(finalize) -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if _uncaught and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.Get_size() > 1 and not issubclass(_uncaught[0], SystemExit):
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(1)
    finalize()


