"""Which lost hosts to check for re-admission, and when (thread-safe, no I/O).

A lost host comes back two ways: asked by hand (``POST /admin/hosts/HOST/readmit``)
or by the ``--readmit-after S`` policy, S seconds after it was lost. Either way
``launch doctor``'s checks decide; a host they fail is tried again S seconds later
under the policy (asked by hand: once per ask). The supervisor runs the checks off
its watch loop, so a slow or silent host never delays noticing a loss.
"""

from __future__ import annotations

import threading


class Readmits:
    """The lost hosts' clocks and the hand-made asks.

    after : ``--readmit-after`` seconds, or None (by hand only).
    """

    def __init__(self, after: float | None = None):
        self.after = after
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}  # lost host -> lost (or last failed) at
        self._asked: list[str] = []

    def lost(self, hosts, now: float) -> None:
        """``hosts`` were dropped at ``now`` (monotonic)."""
        with self._lock:
            for h in hosts:
                self._since[h] = now

    def ask(self, host: str) -> None:
        with self._lock:
            if host not in self._asked:
                self._asked.append(host)

    def due(self, now: float) -> list[str]:
        """The hosts to check now: the asked ones, then those lost ``after`` s ago."""
        with self._lock:
            out = [h for h in self._asked if h in self._since]
            if self.after is not None:
                out += [h for h, t in self._since.items()
                        if now - t >= self.after and h not in out]
            return out

    def checked(self, hosts, bad, now: float) -> list[str]:
        """Doctor's verdict on ``hosts`` (``bad``: those it failed), checked at ``now``:
        the ones to bring back. A failed host waits another ``after`` s."""
        bad = set(bad)
        with self._lock:
            back = [h for h in hosts if h not in bad and h in self._since]
            for h in hosts:
                if h in self._asked:
                    self._asked.remove(h)
                if h in bad and h in self._since:
                    self._since[h] = now
            for h in back:
                del self._since[h]
            return back
