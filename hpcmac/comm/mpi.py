"""The MPI transport: mpi4py buffer (uppercase) calls, zero copy."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcmac.comm.base import Group, Request, check_op


def is_available() -> tuple[bool, str]:
    """(usable, reason) without initialising anything beyond importing mpi4py."""
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception as exc:  # pragma: no cover - import failures vary
        return False, f"mpi: mpi4py does not import ({exc})"
    return True, ""


class MPIRequest(Request):
    __slots__ = ("_req",)

    def __init__(self, req):
        self._req = req

    def wait(self) -> None:
        self._req.Wait()

    def test(self) -> bool:
        return bool(self._req.Test())


class MPIGroup(Group):
    """A Group over an mpi4py communicator (``COMM_WORLD`` by default)."""

    transport = "mpi"

    def __init__(self, comm=None):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self._rank = self.comm.Get_rank()
        self._size = self.comm.Get_size()
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def send(self, buf, dest, tag=0):
        self.comm.Send(buf, dest, tag)

    def recv(self, buf, source, tag=0):
        self.comm.Recv(buf, source, tag)
        return buf

    def isend(self, buf, dest, tag=0):
        return MPIRequest(self.comm.Isend(buf, dest, tag))

    def irecv(self, buf, source, tag=0):
        return MPIRequest(self.comm.Irecv(buf, source, tag))

    def bcast(self, buf, root=0):
        self.comm.Bcast(buf, root)
        return buf

    def allreduce(self, buf, op="sum", out=None):
        mop = self._ops[check_op(op)]
        if out is None:
            out = np.empty_like(buf)
        if out is buf:
            self.comm.Allreduce(self._MPI.IN_PLACE, out, mop)
        else:
            self.comm.Allreduce(buf, out, mop)
        return out

    def allreduce_maxloc(self, value, index):
        pairs = np.empty((self._size, 2), dtype=np.float64)
        self.comm.Allgather(np.array([value, index], dtype=np.float64), pairs)
        return _pick_maxloc(pairs)

    def allgather(self, buf, out=None):
        buf = np.ascontiguousarray(buf)
        if out is None:
            out = np.empty((self._size, *buf.shape), dtype=buf.dtype)
        self.comm.Allgather(buf, out)
        return out

    def reduce_scatter(self, buf, op="sum"):
        buf = np.ascontiguousarray(buf)
        if buf.shape[0] != self._size:
            raise ValueError(f"reduce_scatter: leading dimension {buf.shape[0]} != group size {self._size}")
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


def _pick_maxloc(pairs: np.ndarray) -> tuple[float, int]:
    """From rows (value, index): the largest |value|, ties to the smallest index."""
    mags = np.abs(pairs[:, 0])
    best = mags.max()
    cand = pairs[mags == best]
    row = cand[np.argmin(cand[:, 1])]
    return float(row[0]), int(row[1])
