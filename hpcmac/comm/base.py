"""The Group interface every transport implements.

Buffers are numpy arrays. Calls that fill a buffer write into the array the
caller passes (no copy where the transport allows; the MPI transport passes
the array's memory straight to MPI). Buffers must be C-contiguous unless a
call says otherwise.

"Collective" means every rank of the group must make the same call, in the
same order, with arguments that agree where the docstring says *global*.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

REDUCE_OPS = ("sum", "max", "min")


class Request(abc.ABC):
    """A pending non-blocking send or receive."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the operation completed; its buffer may then be reused."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True when the operation completed (then ``wait`` returns at once)."""


class Group(abc.ABC):
    """A set of ranks that communicate. ``rank`` is local, ``size`` global."""

    #: transport name: "mpi", "ring", "rdma" or "local"
    transport: str = "?"
    #: set by each transport's constructor
    _rank: int
    _size: int

    @property
    def rank(self) -> int:
        """This process's rank in the group, 0..size-1."""
        return self._rank

    @property
    def size(self) -> int:
        """Number of ranks in the group (global)."""
        return self._size

    # -- point to point (not collective) ------------------------------------
    @abc.abstractmethod
    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        """Send ``buf`` to rank ``dest``; returns when ``buf`` may be reused."""

    @abc.abstractmethod
    def recv(self, buf: np.ndarray, source: int, tag: int = 0) -> np.ndarray:
        """Receive into ``buf`` (shape and dtype as sent) from ``source``; returns ``buf``."""

    @abc.abstractmethod
    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf``; do not modify it until the request completes."""

    @abc.abstractmethod
    def irecv(self, buf: np.ndarray, source: int, tag: int = 0) -> Request:
        """Start receiving into ``buf``; read it only after the request completes."""

    def waitall(self, requests: list[Request]) -> None:
        """Not collective: wait for every request in ``requests`` (one call for many)."""
        for req in requests:
            req.wait()

    # -- collectives ----------------------------------------------------------
    @abc.abstractmethod
    def bcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """Collective: copy root's ``buf`` into every rank's ``buf`` (same shape); returns it."""

    @abc.abstractmethod
    def allreduce(
        self, buf: np.ndarray, op: str = "sum", out: np.ndarray | None = None
    ) -> np.ndarray:
        """Collective: elementwise ``op`` ("sum", "max", "min") of ``buf`` over ranks.

        The result goes to ``out`` (allocated when None; may be ``buf`` itself).
        """

    @abc.abstractmethod
    def allreduce_maxloc(self, value: float, index: int) -> tuple[float, int]:
        """Collective: the (value, index) pair with the largest ``abs(value)``.

        Ties go to the smallest index, so every rank picks the same pivot.
        The value keeps its sign. For pivot search down a process column.
        """

    @abc.abstractmethod
    def allgather(self, buf: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Collective: every rank's ``buf`` (same shape on all), stacked: (size, *buf.shape)."""

    @abc.abstractmethod
    def reduce_scatter(self, buf: np.ndarray, op: str = "sum") -> np.ndarray:
        """Collective: reduce ``buf`` (shape (size, *block)) over ranks; rank r gets block r."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Collective: returns once every rank has entered."""

    @abc.abstractmethod
    def split(self, color: int, key: int = 0) -> Group:
        """Collective: sub-group of the ranks with the same ``color``, ordered by (key, rank)."""

    @abc.abstractmethod
    def abort(self, code: int = 1) -> None:
        """Not collective: end every rank of the job now with exit ``code``."""

    # -- small Python objects (pickled), for control messages -----------------
    @abc.abstractmethod
    def bcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Collective: root's object on every rank."""

    @abc.abstractmethod
    def allgather_obj(self, obj: Any) -> list[Any]:
        """Collective: the list of every rank's object, in rank order."""

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"<{name} transport={self.transport} rank={self.rank} size={self.size}>"


def check_op(op: str) -> str:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduction op must be one of {', '.join(REDUCE_OPS)}, got {op!r}")
    return op


def pick_maxloc(pairs: np.ndarray) -> tuple[float, int]:
    """From gathered rows (value, index): the largest |value|, ties to the smallest
    index. The rule every transport's ``allreduce_maxloc`` follows."""
    mags = np.abs(pairs[:, 0])
    best = mags.max()
    cand = pairs[mags == best]
    row = cand[np.argmin(cand[:, 1])]
    return float(row[0]), int(row[1])
