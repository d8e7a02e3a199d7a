"""The local transport: a group of one rank, for serial runs."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcmac.comm.base import Group, Request, check_op


def is_available() -> tuple[bool, str]:
    return True, ""


class _Done(Request):
    def wait(self) -> None:
        return None

    def test(self) -> bool:
        return True


class LocalGroup(Group):
    """Size-1 group: collectives are copies, point-to-point to self is a mailbox."""

    transport = "local"

    def __init__(self):
        self._rank, self._size = 0, 1
        self._mail: dict[int, list[np.ndarray]] = {}
        self._pending: list[tuple[np.ndarray, int]] = []

    def _check_peer(self, peer: int) -> None:
        if peer != 0:
            raise ValueError(f"local group has only rank 0, got peer {peer}")

    def send(self, buf, dest, tag=0):
        self._check_peer(dest)
        self._mail.setdefault(tag, []).append(np.array(buf, copy=True))
        self._deliver()

    def recv(self, buf, source, tag=0):
        self._check_peer(source)
        box = self._mail.get(tag)
        if not box:
            raise RuntimeError("local group: recv with no matching send would deadlock")
        buf[...] = box.pop(0).reshape(buf.shape)
        return buf

    def isend(self, buf, dest, tag=0):
        self.send(buf, dest, tag)
        return _Done()

    def irecv(self, buf, source, tag=0):
        self._check_peer(source)
        self._pending.append((buf, tag))
        self._deliver()
        return _LocalRecv(self, buf)

    def _deliver(self) -> None:
        still = []
        for buf, tag in self._pending:
            box = self._mail.get(tag)
            if box:
                buf[...] = box.pop(0).reshape(buf.shape)
            else:
                still.append((buf, tag))
        self._pending = still

    def bcast(self, buf, root=0):
        self._check_peer(root)
        return buf

    def allreduce(self, buf, op="sum", out=None):
        check_op(op)
        if out is None:
            return np.array(buf, copy=True)
        if out is not buf:
            out[...] = buf
        return out

    def allreduce_maxloc(self, value, index):
        return float(value), int(index)

    def allgather(self, buf, out=None):
        if out is None:
            out = np.empty((1, *np.shape(buf)), dtype=np.asarray(buf).dtype)
        out[0] = buf
        return out

    def reduce_scatter(self, buf, op="sum"):
        check_op(op)
        if buf.shape[0] != 1:
            raise ValueError(f"reduce_scatter: leading dimension {buf.shape[0]} != group size 1")
        return np.array(buf[0], copy=True)

    def barrier(self):
        return None

    def split(self, color, key=0):
        return LocalGroup()

    def abort(self, code=1):
        import os
        import sys

        sys.stderr.flush()
        os._exit(code)

    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        return obj

    def allgather_obj(self, obj: Any) -> list[Any]:
        return [obj]


class _LocalRecv(Request):
    def __init__(self, group: LocalGroup, buf: np.ndarray):
        self._group, self._buf = group, buf

    def test(self) -> bool:
        self._group._deliver()
        return all(b is not self._buf for b, _ in self._group._pending)

    def wait(self) -> None:
        if not self.test():
            raise RuntimeError("local group: irecv with no matching send would deadlock")
