"""Each rank's busy time, reported to rank 0 while a server runs (for ``/metrics``).

Every rank already counts the wall and CPU time it spends computing (the
pipeline's :class:`~.results.RankStats`, a follower's steps). Serving, each
rank other than 0 sends those two numbers to world rank 0 at most once a second
(:data:`PERIOD_S`), from its own loop, between steps: one 32-byte non-blocking
message on tag :data:`TAG_BUSY`, and only when the previous one has been taken.
Nothing is added to a step: no per-token message and no collective. Rank 0
tests its posted receives between steps (:meth:`BusyCollector.poll`) and keeps
the latest figures in a :class:`BusyBoard`, which the HTTP thread reads.

At the end each rank sends a last report marked final, and rank 0 receives
until it has every rank's, so no message is left unreceived when the job ends.
Only over MPI (any rank reaches rank 0 directly); on other transports rank 0
reports its own figures alone.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from hpcmac.llm.parallel.tags import TAG_BUSY

#: seconds between two reports of one rank
PERIOD_S = 1.0
#: a report: (final?, busy seconds, CPU seconds, wall seconds since the run started)
ROW = 4
#: the window over which a busy fraction is measured (seconds)
WINDOW_S = 10.0


class BusyBoard:
    """The latest busy figures of every rank (rank 0; thread-safe)."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._seen: dict[int, deque] = {r: deque(maxlen=64) for r in range(size)}

    def update(self, rank: int, busy_s: float, cpu_s: float, wall_s: float) -> None:
        with self._lock:
            self._seen[rank].append((wall_s, busy_s, cpu_s, time.monotonic()))

    def ranks(self) -> list[dict]:
        """Per rank: the busy fraction over the last :data:`WINDOW_S` seconds it reported
        (None before two reports), its busy and CPU seconds in all, and the age of its
        last report in seconds (None: never reported)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for r in range(self.size):
                seen = list(self._seen[r])
                if not seen:
                    out.append({"rank": r, "busy": None, "busy_s": None, "cpu_s": None,
                                "age_s": None})
                    continue
                wall, busy, cpu, t = seen[-1]
                old = next((s for s in seen if wall - s[0] <= WINDOW_S), seen[0])
                frac = (busy - old[1]) / (wall - old[0]) if wall > old[0] else None
                out.append({"rank": r, "busy": None if frac is None else
                            min(1.0, max(0.0, frac)), "busy_s": busy, "cpu_s": cpu,
                            "age_s": now - t})
        return out


class BusyReporter:
    """A rank other than 0: reports to world rank 0 now and then (not collective)."""

    def __init__(self, world, t_start: float, period: float = PERIOD_S):
        self.world, self.t0, self.period = world, t_start, period
        self.req = None
        self.buf = np.zeros(ROW, dtype=np.float64)
        self.t_last = -period
        self.last = (0.0, 0.0)

    def __call__(self, busy_s: float, cpu_s: float) -> None:
        """Between steps: send a report when one is due and the last one was taken."""
        self.last = (busy_s, cpu_s)
        now = time.perf_counter()
        if now - self.t_last < self.period or (self.req is not None and not self.req.test()):
            return
        self._send(0.0, busy_s, cpu_s, now)

    def _send(self, final: float, busy_s: float, cpu_s: float, now: float) -> None:
        self.t_last = now
        self.buf = np.array([final, busy_s, cpu_s, now - self.t0], dtype=np.float64)
        self.req = self.world.isend(self.buf, 0, TAG_BUSY)

    def final(self) -> None:
        """The last report (after the loop); :meth:`close` waits for it."""
        if self.req is not None:
            self.req.wait()
        self._send(1.0, *self.last, time.perf_counter())

    def close(self) -> None:
        if self.req is not None:
            self.req.wait()
            self.req = None


class BusyCollector:
    """World rank 0: takes the reports into ``board`` (not collective)."""

    def __init__(self, world, board: BusyBoard, t_start: float, remote: bool = True):
        self.world, self.board, self.t0 = world, board, t_start
        self.bufs = {r: np.zeros(ROW, dtype=np.float64)
                     for r in range(1, world.size if remote else 1)}
        self.reqs = {r: world.irecv(self.bufs[r], r, TAG_BUSY) for r in self.bufs}
        self.t_last = 0.0

    def __call__(self, busy_s: float, cpu_s: float) -> None:
        """Between steps: rank 0's own figures, and any report that has arrived."""
        now = time.perf_counter()
        if now - self.t_last < PERIOD_S / 2:
            return
        self.t_last = now
        self.board.update(0, busy_s, cpu_s, now - self.t0)
        for r in list(self.reqs):
            if self.reqs[r].test():
                self._take(r)

    def _take(self, r: int) -> None:
        final, busy, cpu, wall = (float(v) for v in self.bufs[r])
        self.board.update(r, busy, cpu, wall)
        if final:
            del self.reqs[r]
        else:
            self.reqs[r] = self.world.irecv(self.bufs[r], r, TAG_BUSY)

    def drain(self, timeout: float = 10.0) -> None:
        """After the run: receive until every rank's final report (a rank that died has
        ended the job already; ``timeout`` bounds the wait regardless)."""
        t_end = time.monotonic() + timeout
        while self.reqs and time.monotonic() < t_end:
            for r in list(self.reqs):
                if self.reqs[r].test():
                    self._take(r)
            time.sleep(1e-3)


def channel(world, board: BusyBoard | None, t_start: float):
    """This rank's side of the busy reports (every rank decides alike, from global values):
    rank 0's collector, another rank's reporter, or None (no board given). The other
    ranks report over MPI only (on another transport rank 0 has its own figures alone)."""
    if board is None:
        return None
    remote = world.size > 1 and getattr(world, "transport", "") == "mpi"
    if world.rank == 0:
        return BusyCollector(world, board, t_start, remote)
    return BusyReporter(world, t_start) if remote else None
