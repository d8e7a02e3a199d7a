"""This process's resident memory: the peak so far, and a per-phase peak where the OS allows.

Linux keeps a resettable high-water mark (``VmHWM`` in ``/proc/self/status``,
reset by writing 5 to ``/proc/self/clear_refs``), so each HPL phase gets its own
peak. Elsewhere (macOS) the peak is ``getrusage``'s ``ru_maxrss`` since the
process started, which can only grow. Nothing here communicates.
"""

from __future__ import annotations

import sys

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


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
    """The peak resident set size: since :func:`reset_peak` on Linux, else since start."""
    kb = _status_kb("VmHWM:")
    if kb is not None:
        return kb * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS: bytes


def rss_bytes() -> int:
    """The resident set size now (0 where the OS does not say)."""
    kb = _status_kb("VmRSS:")
    return kb * 1024 if kb is not None else 0


def reset_peak() -> bool:
    """Start a new peak at the current RSS; False where the OS cannot (then the peak
    keeps counting from the process start)."""
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False
