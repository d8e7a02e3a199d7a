"""This node's fixed facts for calibration: cores, the largest cache, memory.

Read by ``plan.calibrate`` and ``plan.tensor_cost`` (neither imports the other
for them). Nothing here measures or communicates.
"""

from __future__ import annotations

import os


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def last_cache_bytes() -> int:
    """Bytes of the largest CPU cache (Linux sysfs; 0 when unknown)."""
    from pathlib import Path

    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best


def memory_gb() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (ValueError, OSError, AttributeError):
        return 0.0
