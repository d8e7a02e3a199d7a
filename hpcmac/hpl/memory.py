"""This process's resident memory: the peak so far, and each phase's peak, read
without changing what the kernel reports about the process.

The kernel's high-water mark (``VmHWM``, the ``ru_maxrss`` of ``getrusage`` and
``wait4``, which ``/usr/bin/time -v`` and Slurm's accounting read) is never reset
here: a benchmark must not change what outside tools see of it. A phase's peak
(:class:`PhasePeak`) is instead

* exact when the phase set a new high: the mark grew during the phase, so the
  phase's peak *is* the mark at its end;
* otherwise the largest RSS a sampler thread read during the phase (every
  ``interval_s``, 20 ms by default), and at its start and end. It can miss
  memory allocated and freed again between two readings, so it may read low by
  at most what one 20 ms window allocates and frees.

Linux only for the per-phase figures; elsewhere (macOS) every phase reads the
process peak so far (``ru_maxrss``), which can only grow. Nothing here
communicates.
"""

from __future__ import annotations

import os
import sys
import threading
import time

_STATUS = "/proc/self/status"
_STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _status_kb(key: str) -> int | None:
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set size since it started (the kernel's mark)."""
    kb = _status_kb("VmHWM:")
    if kb is not None:
        return kb * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes


def rss_bytes() -> int:
    """The resident set size now (0 where the OS does not say): one small read."""
    try:
        with open(_STATM, "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


class _Sampler:
    """One daemon thread per process that reads the RSS every ``interval_s`` while some
    :class:`PhasePeak` is running, and sleeps on an event otherwise. Started once and
    never joined: a thread (and its stack) per phase would map new memory at each
    phase start, inside whatever limit the process runs under."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meters: list[PhasePeak] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, meter: PhasePeak) -> None:
        with self._lock:
            self._meters.append(meter)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hpcmac-rss",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def remove(self, meter: PhasePeak) -> None:
        with self._lock:
            if meter in self._meters:
                self._meters.remove(meter)
            if not self._meters:
                self._wake.clear()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                meters = list(self._meters)
            if meters:
                now = rss_bytes()
                for m in meters:
                    m._high = max(m._high, now)
                time.sleep(min(m.interval_s for m in meters))


_sampler = _Sampler()


class PhasePeak:
    """The peak RSS of one stretch of code: ``start()``, the work, then ``stop()``.

    Local (not collective). The readings come from one sampler thread per process
    (:class:`_Sampler`), which reads ``/proc/self/statm`` every ``interval_s`` while a
    phase runs; it holds the GIL for a few microseconds per reading, which numpy's
    BLAS calls do not need.
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self._high = 0
        self._mark0 = 0
        self._sampling = False

    def start(self) -> None:
        self._mark0 = peak_rss_bytes()
        self._high = rss_bytes()
        if self._high == 0:  # no /proc: the process peak is all the OS tells
            return
        self._sampling = True
        _sampler.add(self)

    def stop(self) -> int:
        """The phase's peak in bytes (see the module's rules for how exact it is)."""
        if self._sampling:
            _sampler.remove(self)
            self._sampling = False
        mark = peak_rss_bytes()
        now = rss_bytes()
        if now == 0:
            return mark
        if mark > self._mark0:  # this phase set the process's new high: exact
            return mark
        return max(self._high, now)
