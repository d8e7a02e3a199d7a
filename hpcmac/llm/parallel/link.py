"""The pipeline's messages: non-blocking sends that count bytes, waits that time out.

Communication goes through a :class:`hpcmac.comm.Group` only.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.errors import UsageError


def _seconds_from_env(name: str) -> float | None:
    """A duration in seconds from the environment (None when unset or empty)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise UsageError(f"{name}={text!r}: expected seconds, a number >= 0")
    return value


def _yield() -> None:
    """Give the core to another runnable process, if any (returns at once otherwise)."""
    try:
        os.sched_yield()
    except (AttributeError, OSError):  # no sched_yield: a zero sleep
        time.sleep(0)


def _cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity call
        return os.cpu_count() or 1


class Link:
    """Sends through the group with non-blocking calls, counting bytes by phase."""

    def __init__(self, group: Group, watchdog: Watchdog, depth: int = 8):
        self.group, self.wd, self.depth = group, watchdog, depth
        self.pending: deque = deque()
        self.bytes: dict[tuple[int, str], int] = {}

    def send(self, buf: np.ndarray, dest: int, tag: int, phase: str) -> None:
        self.pending.append((self.group.isend(buf, dest, tag), buf))
        key = (dest, phase)
        self.bytes[key] = self.bytes.get(key, 0) + buf.nbytes
        while len(self.pending) > self.depth:
            req, _ = self.pending.popleft()
            self.wd.wait(req, dest, "to accept a message")

    def flush(self) -> None:
        while self.pending:
            req, _ = self.pending.popleft()
            self.wd.wait(req, -1, "to accept a message")

    def recv(self, buf: np.ndarray, source: int, tag: int) -> np.ndarray:
        req = self.group.irecv(buf, source, tag)
        self.wd.wait(req, source, "to send", grace=0.5 * self.group.rank)
        return buf


class Watchdog:
    """Waits on requests politely, and ends the job when a peer stays silent too long.

    The waiting policy is chosen at run time from what is measured. A wait
    first spins for 20 us (a hop through shared memory takes a few). It then
    polls, yielding the core between tests (``sched_yield``: on an idle core it
    returns at once, so this is still a spin; when another process wants the
    core, that process runs), for a budget that follows the waits measured so
    far: twice the median of the last 32, at least 50 us and at most
    :attr:`spin_s`. Past the budget it sleeps, growing to half a millisecond
    between tests, so Ctrl-C is seen at once and a long wait (a pipeline stage
    waiting on the stage before it) leaves the core to others; a request that the
    peer can wake (``req.block(seconds)``: the tensor group's shared-memory sum on
    Linux, a futex) sleeps in the kernel instead, until the peer's part lands, after
    at least the 20 us spin. :attr:`spin_s`
    depends on the host: 50 ms when this host has a core for each of its
    ranks, 0.2 ms when ranks share cores. A killed rank is reported by the
    launcher (Open MPI names rank and host); a hung one (stopped, or behind a
    dead link that TCP has not noticed) is caught here after ``timeout``
    seconds (0: never).
    """

    #: the longest poll budget when each rank of the host has a core, and when they share cores
    SPIN_OWN_CORE_S, SPIN_SHARED_S = 0.05, 2e-4
    #: the pure spin before yielding, and the shortest poll budget
    SPIN_FIRST_S, BUDGET_MIN_S = 2e-5, 5e-5
    #: the longest sleep between two polls (HPCMAC_PIPELINE_MAX_SLEEP overrides)
    MAX_SLEEP_S = 5e-4
    #: the longest kernel sleep of a request that can be woken (``req.block``), between
    #: two looks at the clock (the timeout, Ctrl-C)
    BLOCK_SLICE_S = 0.05

    def __init__(self, group: Group, hosts: Sequence[str], timeout: float,
                 max_sleep: float | None = None, spin: float | None = None,
                 ranks: Sequence[int] | None = None):
        self.group, self.hosts, self.timeout = group, list(hosts), timeout
        # the job's rank number of each group rank, for messages (a sub-group's ranks)
        self.ranks = list(ranks) if ranks is not None else list(range(len(self.hosts)))
        env_sleep = _seconds_from_env("HPCMAC_PIPELINE_MAX_SLEEP")
        self.max_sleep = (max_sleep if max_sleep is not None else
                          env_sleep if env_sleep is not None else self.MAX_SLEEP_S)
        env_spin = _seconds_from_env("HPCMAC_PIPELINE_SPIN")
        self.fixed = spin is not None or env_spin is not None
        if spin is not None:
            self.spin_s = spin
        elif env_spin is not None:
            self.spin_s = env_spin
        else:
            here = self.hosts[group.rank] if group.rank < len(self.hosts) else ""
            self.spin_s = (self.SPIN_OWN_CORE_S if self.hosts.count(here) <= _cores()
                           else self.SPIN_SHARED_S)
        self.budget = self.spin_s  # the current poll budget (adapts unless fixed)
        self.recent: deque = deque(maxlen=32)

    def wait(self, req, peer: int, what: str, grace: float = 0.0) -> None:
        """Block until ``req`` completes; after ``timeout + grace`` s of silence, abort."""
        if req.test():
            return
        limit = self.timeout + grace
        t0 = time.monotonic()
        budget = min(self.budget, self.spin_s)
        block = getattr(req, "block", None)
        delay = 0.0
        while not req.test():
            el = time.monotonic() - t0
            if el > budget and el > self.SPIN_FIRST_S and block is not None:
                block(self.BLOCK_SLICE_S)  # woken by the peer's publish (or the slice ends)
            elif el > budget:
                time.sleep(delay)
                delay = min(2 * delay or 2e-5, self.max_sleep)
            elif el > self.SPIN_FIRST_S:
                _yield()
            if self.timeout > 0 and el > limit:
                self._fail(peer, what, limit)
        if not self.fixed:
            self.recent.append(time.monotonic() - t0)
            if len(self.recent) >= 8:
                med = sorted(self.recent)[len(self.recent) // 2]
                self.budget = min(self.spin_s, max(self.BUDGET_MIN_S, 2 * med))

    def _name(self, r: int) -> str:
        return (f"rank {self.ranks[r]} on {self.hosts[r]}" if 0 <= r < len(self.hosts)
                else "a peer")

    def _fail(self, peer: int, what: str, limit: float) -> None:
        me = self._name(self.group.rank)
        print(f"error: {me} waited {limit:g} s for {self._name(peer)} {what}; "
              "it has died or hung (or --timeout is shorter than one step), ending the job",
              file=sys.stderr, flush=True)
        self.group.abort(1)
