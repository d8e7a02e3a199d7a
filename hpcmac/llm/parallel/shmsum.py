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

Waking (Linux): a rank whose poll budget (the watchdog's) runs out before its
peer publishes sleeps in the kernel on the peer's sequence word (``FUTEX_WAIT``
on its low 32 bits, the value it last saw), after raising a flag in the peer's
line; a rank that publishes and finds its flag raised lowers it and wakes the
sleepers (``FUTEX_WAKE``). The waiter is on a core again as soon as the part
lands, not after a sleep of up to half a millisecond, and costs nothing while
it waits. A publisher that finds no flag makes no system call. The flag and the
sequence word are a store then a load on each side (Dekker's pattern, which
x86's store buffer can reorder): the waiter's side is ordered by the kernel
(``futex_wait`` fences before it compares the word), the publisher's by a
locked instruction between its store and its load (a lock taken and released).
Each sleep is bounded anyway (the watchdog's slice), so a wake missed for any
reason costs that slice, never a hang. macOS has no futex: there (and with
``HPCMAC_TP_FUTEX=0``) the watchdog's poll-then-sleep stays.

The leader's doorbell: rank 0's line also holds a step counter (int64 at 16) and
its own waiter flag (int32 at 24). Once the leader has posted a step's messages
(through MPI, tag ``TAG_STEP``) it raises the counter (:meth:`ShmSum.ring`) and,
if a follower's flag is up, wakes it; a follower waits for the counter to pass
the steps it has taken (:meth:`ShmSum.rung`) with the same poll, then futex, as a
sum's part, and only then posts its receives (whose waits cover a message still
on its way). A follower idle between requests (its poll budget spent) is back on
a core as the step is sent, not up to half a millisecond later.

The file backing the mapping is unlinked as soon as every rank has mapped it,
so nothing is left in ``/dev/shm`` whatever happens to the job.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import tempfile
import threading
from collections.abc import Sequence

import numpy as np

from hpcmac.comm.base import Group

#: the largest reduction that goes through shared memory (decode of a few sequences)
MAX_BYTES = 64 << 10
_LINE = 64  # bytes: each rank's sequence number (int64 at 0) and waiter flag (int32 at 8)
_STRIDE = _LINE + 2 * MAX_BYTES  # bytes per rank
_FLAG = 8  # byte offset of the waiter flag in a rank's line
_BELL, _BELL_FLAG = 16, 24  # rank 0's line: the step counter (int64), its waiter flag

_SYS_FUTEX = 202  # x86-64 Linux (the only place the mapping is used, see eligible)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not _PRIVATE: the word is shared between processes
_EAGAIN, _EINTR, _ETIMEDOUT = 11, 4, 110


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """``futex(2)`` on a 32-bit word of a shared mapping, through libc's ``syscall``.

    ctypes drops the GIL for the call, so a rank's other threads (serve's HTTP
    front on rank 0) run while it sleeps.
    """

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.syscall
        self._call.restype = ctypes.c_long
        self._call.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                               ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_long]
        self._ts = _Timespec()
        self._pts = ctypes.addressof(self._ts)

    def wait(self, addr: int, expected: int, timeout_s: float) -> bool:
        """Sleep while the word at ``addr`` holds ``expected`` (its low 32 bits), at
        most ``timeout_s``; False when the time ran out, True otherwise (woken, the
        word already different, a signal)."""
        ns = max(int(timeout_s * 1e9), 1000)
        self._ts.tv_sec, self._ts.tv_nsec = divmod(ns, 1_000_000_000)
        rc = self._call(_SYS_FUTEX, addr, _FUTEX_WAIT, expected & 0xFFFFFFFF,
                        self._pts, None, 0)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err in (_EAGAIN, _EINTR):
            return True
        if err == _ETIMEDOUT:
            return False
        raise OSError(err, f"futex wait: {os.strerror(err)}")

    def wake(self, addr: int) -> int:
        """Wake every sleeper on the word at ``addr``; how many there were."""
        rc = self._call(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        if rc < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"futex wake: {os.strerror(err)}")
        return rc


def futex_available() -> bool:
    """True when waits may sleep on a futex here: Linux on x86-64, ``HPCMAC_TP_FUTEX``
    not 0 (macOS has no futex: the watchdog's poll-then-sleep stays there)."""
    if os.environ.get("HPCMAC_TP_FUTEX", "1").strip() == "0":
        return False
    return (os.uname().sysname == "Linux"
            and platform.machine().lower() in ("x86_64", "amd64"))


def eligible(hosts: Sequence[str]) -> bool:
    """True when a group on ``hosts`` (global) may sum through shared memory here."""
    if os.environ.get("HPCMAC_TP_SHM", "1").strip() == "0":
        return False
    return (len(hosts) > 1 and len(set(hosts)) == 1
            and platform.machine().lower() in ("x86_64", "amd64"))


class _Published:
    """A request-like test: has the peer published reduction ``s``? With a futex,
    :meth:`block` sleeps until it has (the watchdog calls it past its poll budget)."""

    __slots__ = ("seq", "s", "block")

    def __init__(self, seq: np.ndarray, s: int, block=None):
        self.seq, self.s = seq, s
        if block is not None:
            self.block = block

    def test(self) -> bool:
        return bool(self.seq[0] >= self.s)


class _Sleep:
    """The kernel-side wait on one peer's sequence word (see module doc, Waking)."""

    def __init__(self, futex: Futex, seq: np.ndarray, flag: np.ndarray, counts: list):
        self.futex, self.seq, self.flag, self.counts = futex, seq, flag, counts
        self.addr = seq.ctypes.data  # the low 32 bits of the int64 (little-endian)
        self.s = 0

    def __call__(self, timeout_s: float) -> None:
        self.flag[0] = 1  # the publisher wakes us (the kernel fences before it compares)
        self.counts[0] += 1
        if not self.futex.wait(self.addr, self.s - 1, timeout_s):
            self.counts[1] += 1


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
        self.flags = [buf[r * _STRIDE + _FLAG:r * _STRIDE + _FLAG + 4].view(np.int32)
                      for r in range(self.size)]
        self.bell = buf[_BELL:_BELL + 8].view(np.int64)  # rank 0's line
        self.bell_flag = buf[_BELL_FLAG:_BELL_FLAG + 4].view(np.int32)
        self.rings = 0  # local: steps rung (leader) or taken (a follower)
        #: local: sleeps in the kernel, those that ran to their timeout, wakes issued
        self.counts = [0, 0, 0]
        # the futex choice must agree on every rank (a sleeper relies on its peer's
        # wake): each rank's answer gathered, used only if all said yes
        want = futex_available()
        if all(group.allgather_obj(want)):
            self.futex = Futex()
            self._sleeps = [_Sleep(self.futex, self.seqs[r], self.flags[r], self.counts)
                            if r != self.rank else None for r in range(self.size)]
            self._fence = threading.Lock()
            self._bell_sleep = _Sleep(self.futex, self.bell, self.bell_flag, self.counts)
        else:
            self.futex = None
        self.ok = True

    def ring(self) -> None:
        """Leader (rank 0): a step's messages are sent; the followers may take them."""
        self.rings += 1
        self.bell[0] = self.rings
        if self.futex is not None:
            with self._fence:  # as in sum: the store above is seen before the flag's load
                pass
            if self.bell_flag[0]:
                self.bell_flag[0] = 0
                self.counts[2] += 1
                self.futex.wake(self.bell.ctypes.data)

    def rung(self):
        """A follower: a request-like test of the leader's next step (``block`` sleeps on
        the doorbell past the poll budget), for the caller's wait; counts it as taken."""
        self.rings += 1
        if self.futex is None:
            return _Published(self.bell, self.rings)
        sleep = self._bell_sleep
        sleep.s = self.rings
        return _Published(self.bell, self.rings, sleep)

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
        futex = self.futex
        if futex is not None:
            with self._fence:  # a locked instruction: the store above is seen before the load
                pass
            flag = self.flags[self.rank]
            if flag[0]:
                flag[0] = 0
                self.counts[2] += 1
                futex.wake(self.seqs[self.rank].ctypes.data)
        for r in range(self.size):
            if r != self.rank:
                if futex is None:
                    wait(_Published(self.seqs[r], s), r)
                else:
                    sleep = self._sleeps[r]
                    sleep.s = s
                    wait(_Published(self.seqs[r], s, sleep), r)
        out = self.slots[0][k][:n] + self.slots[1][k][:n]
        for r in range(2, self.size):
            out += self.slots[r][k][:n]
        self.s = s
        return out.reshape(a.shape)
