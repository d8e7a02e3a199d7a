"""Progress of a running factorisation on stderr: columns done, elapsed, ETA.

Only rank 0 shows it, and only when asked or when the user is at a terminal.
Under ``mpirun`` a rank's own streams say nothing about that: Open MPI gives
every rank's stdout a pseudo-terminal (even in batch) and its stderr a pipe
that it forwards line by line (a ``\r`` redraw would show only at the end). So
"a terminal" means this process's stderr is one, or, under a launcher, the
launcher's (its parent's) stderr is one (Linux ``/proc``); on a non-terminal
stderr the progress comes as whole lines, a few seconds apart.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


def want_progress(setting: str, stream: TextIO | None = None) -> bool:
    """``setting`` "on", "off" or "auto": a terminal on ``stream`` (default: stderr, or the
    launcher's stderr when started by one)."""
    if setting == "on":
        return True
    if setting == "off":
        return False
    if stream is not None:
        return _isatty(stream)
    return _isatty(sys.stderr) or (_launched() and _parent_stderr_is_tty())


def _launched() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def _parent_stderr_is_tty() -> bool:
    """Whether the launcher that started us (our parent) writes its stderr to a terminal."""
    try:
        target = os.readlink(f"/proc/{os.getppid()}/fd/2")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty"))


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def work_fraction(done: int, n: int) -> float:
    """Fraction of LU flops done after ``done`` of ``n`` columns: 1 - ((n-done)/n)^3."""
    if n <= 0:
        return 1.0
    left = max(0, n - done) / n
    return 1.0 - left**3


class Progress:
    """Callable ``progress(cols_done, n)`` for ``hpl_solve``; redraws one stderr line.

    Local: make one on the rank that shows progress and pass None elsewhere.

    The ETA is the time the remaining flops take at the rate measured so far:
    from the first call (the end of the first panel) on, so that whatever ran
    before the factorisation (matrix generation) does not count as a slow
    start. After the last column the line says the run goes on with the
    solve and the residual check, and :meth:`close` says when that ended.
    """

    def __init__(self, label: str, stream: TextIO | None = None,
                 min_interval: float | None = None):
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.redraw = _isatty(self.stream)
        if min_interval is None:
            min_interval = 0.2 if self.redraw else 3.0
        self.min_interval = min_interval
        self.t0 = time.perf_counter()
        self._last = -1.0
        self._shown = False
        self._ref: tuple[float, float] | None = None  # (time, work fraction) at the first call
        self._check_from: float | None = None  # when the factorisation ended

    def __call__(self, done: int, n: int) -> None:
        now = time.perf_counter()
        frac = work_fraction(done, n)
        if self._ref is None:
            self._ref = (now, frac)
        if done < n and now - self._last < self.min_interval:
            return
        self._last = now
        elapsed = now - self.t0
        eta = eta_seconds(self._ref, now, frac)
        eta_s = f"{eta:7.1f}s" if eta == eta else "      ?"
        line = (f"{self.label}: {done:>{len(str(n))}d}/{n} columns ({100.0 * frac:5.1f}% of flops)"
                f"  elapsed {elapsed:7.1f}s  ETA {eta_s}")
        if done >= n:
            line += "; solving and checking the residual"
            self._check_from = now
        if self.redraw:
            self.stream.write("\r" + line)
            self._shown = True
            if done >= n:
                self._end_line()
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _end_line(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False

    def close(self) -> None:
        """End the progress line, and say how long the solve and the check took (once)."""
        self._end_line()
        if self._check_from is not None:
            took = time.perf_counter() - self._check_from
            self.stream.write(f"{self.label}: solve and residual check took {took:.1f}s\n")
            self.stream.flush()
            self._check_from = None


def eta_seconds(ref: tuple[float, float], now: float, frac: float) -> float:
    """Seconds left at the flop rate measured since ``ref`` = (time, work fraction); NaN
    before there is a rate to go by."""
    t_ref, f_ref = ref
    if frac <= f_ref or now <= t_ref:
        return float("nan")
    return (now - t_ref) * (1.0 - frac) / (frac - f_ref)
