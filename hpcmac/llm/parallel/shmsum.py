"""A tensor group's all-reduce through shared memory, when all its ranks share one host.

Decode sums one hidden vector per reduction (4 KB for hidden 1024), twice per
layer. Through MPI each one costs an ``Irecv``/``Isend`` pair per peer and,
past Open MPI's shared-memory eager limit (4 KB including its header), a
rendezvous: the sender's request completes only once the receiver has polled,
matched and acknowledged, so a rank that is briefly late (or asleep in its
wait) holds up its peer twice. Here each rank writes its part into its own
slot of one shared mapping and publishes a sequence number; the others poll
that number and read the part in place. A send never waits.

Layout of the mapping: per rank, one 64-byte line holding its sequence number,
then two data slots of :data:`MAX_BYTES` (reduction ``s`` uses slot ``s % 2``).
A rank writes slot ``s % 2`` again at reduction ``s + 2`` only after every peer
has published ``s + 1``, which each does only after it has read its parts of
reduction ``s``: two slots are enough.

Ordering: the data stores must be visible before the sequence number. x86-64
keeps stores in program order and loads in program order (TSO), and the two
numpy calls are opaque to the compiler (a part is at most 64 KB, so its copy uses
ordinary stores: memcpy's non-temporal ones, which x86 may reorder, start at
megabytes); other processors (arm64: Apple
silicon) reorder, so there the group keeps using MPI. So does a group spread
over several hosts, a message over :data:`MAX_BYTES`, or
``HPCMAC_TP_SHM=0``.

The file backing the mapping is unlinked as soon as every rank has mapped it,
so nothing is left in ``/dev/shm`` whatever happens to the job.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
from collections.abc import Sequence

import numpy as np

from hpcmac.comm.base import Group

#: the largest reduction that goes through shared memory (decode of a few sequences)
MAX_BYTES = 64 << 10
_LINE = 64  # bytes: each rank's sequence number on a cache line of its own
_STRIDE = _LINE + 2 * MAX_BYTES  # bytes per rank


def eligible(hosts: Sequence[str]) -> bool:
    """True when a group on ``hosts`` (global) may sum through shared memory here."""
    if os.environ.get("HPCMAC_TP_SHM", "1").strip() == "0":
        return False
    return (len(hosts) > 1 and len(set(hosts)) == 1
            and platform.machine().lower() in ("x86_64", "amd64"))


class _Published:
    """A request-like test: has the peer published reduction ``s``?"""

    __slots__ = ("seq", "s")

    def __init__(self, seq: np.ndarray, s: int):
        self.seq, self.s = seq, s

    def test(self) -> bool:
        return bool(self.seq[0] >= self.s)


class ShmSum:
    """Sums float32 arrays of up to :data:`MAX_BYTES` over a one-host group (see module doc).

    Collective over ``group`` to build; afterwards :meth:`sum` is collective too.
    Build only when :func:`eligible` holds for the group's hosts; if any rank
    cannot map the file, every rank gets ``ok == False`` and none may use it.
    """

    def __init__(self, group: Group):
        self.rank, self.size = group.rank, group.size
        self.ok = False
        self.s = 0
        nbytes = self.size * _STRIDE
        where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = None
        if self.rank == 0:
            try:
                fd, path = tempfile.mkstemp(prefix="hpcmac-tp-", dir=where)
                os.ftruncate(fd, nbytes)
                os.close(fd)
            except OSError:  # no shared mapping: the group keeps using its transport
                path = None
        path = group.bcast_obj(path, 0)
        mm = None
        if path is not None:
            try:
                with open(path, "r+b") as f:
                    mm = mmap.mmap(f.fileno(), nbytes)
            except OSError:
                mm = None
        oks = group.allgather_obj(mm is not None)  # every rank has mapped it (or failed)
        if self.rank == 0 and path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
        if not all(oks):
            return
        self._mm = mm
        buf = np.frombuffer(mm, dtype=np.uint8)
        self.seqs = [buf[r * _STRIDE:r * _STRIDE + 8].view(np.int64) for r in range(self.size)]
        self.slots = [[buf[r * _STRIDE + _LINE + k * MAX_BYTES:
                           r * _STRIDE + _LINE + (k + 1) * MAX_BYTES].view(np.float32)
                       for k in (0, 1)] for r in range(self.size)]
        self.ok = True

    def sum(self, a: np.ndarray, wait) -> np.ndarray:
        """The sum over the group of every rank's ``a`` (C-contiguous float32, the same
        shape on every rank, at most :data:`MAX_BYTES`), added in rank order.

        ``wait(test, peer)`` blocks until ``test.test()`` holds (the caller's
        waiting policy and timeout).
        """
        s = self.s + 1
        k = s & 1
        n = a.size
        self.slots[self.rank][k][:n] = a.reshape(-1)
        self.seqs[self.rank][0] = s  # publish: the part is in place (TSO, see module doc)
        for r in range(self.size):
            if r != self.rank:
                wait(_Published(self.seqs[r], s), r)
        out = self.slots[0][k][:n] + self.slots[1][k][:n]
        for r in range(2, self.size):
            out += self.slots[r][k][:n]
        self.s = s
        return out.reshape(a.shape)
