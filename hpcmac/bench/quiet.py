"""How quiet this machine is: the CPU others take (``/proc/stat``), and a wait for quiet.

A measurement beside other work measures the other work too. Besides other
jobs, the kernel itself can be that work: on a virtual machine whose balloon
device reports freed pages to the host (free page reporting, as the
Firecracker VM of this project's CI has), a process that frees a GiB sets
kernel workers going for seconds afterwards (measured there: 1.9 CPU-seconds
in the 8 s after freeing six 1 GiB arrays, 0.24 of a core, beside
``kvfree_rcu_reclaim`` and ``virtio_vsock`` workers). A 2-rank decode or HPL
run started in those seconds has a core taken from it part of the time: 20-70%
slower in the planner's calibration test, while the same run a minute later
is not. :func:`settle` waits, a bounded time, until the machine is quiet.
"""

from __future__ import annotations

import os
import time


def busy_s() -> tuple[float, float] | None:
    """CPU seconds all cores of this machine have been busy (Linux ``/proc/stat``:
    user, nice, system, irq, softirq and steal time), and of those the steal time
    (the hypervisor's), None where unknown. Over a run, the first less the run's
    own CPU time is what other processes and the hypervisor took."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    tck = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / tck, v[7] / tck


def settle(limit_s: float = 20.0, window_s: float = 0.5, below: float = 0.05,
           mine: float = 0.0) -> float:
    """Sleep until, over a ``window_s`` window, the machine's cores were busy less than
    ``below`` cores beyond ``mine`` (what the caller's own job is known to use while it
    waits: other ranks asleep in a poll), or ``limit_s`` passed; the seconds waited.
    Returns at once where ``/proc/stat`` is missing."""
    t0 = time.monotonic()
    last = busy_s()
    if last is None:
        return 0.0
    while time.monotonic() - t0 < limit_s:
        time.sleep(window_s)
        now = busy_s()
        if (now[0] - last[0]) / window_s < below + mine:
            break
        last = now
    return time.monotonic() - t0
