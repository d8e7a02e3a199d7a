"""What this machine can hold: memory a new allocation may use (local, no MPI).

Inputs whose numbers decide an allocation (HPL's N, a hostfile's slots, a
model's context length) are checked against these before any work starts, so
an impossible request is one line and exit 2 instead of a MemoryError (or the
OOM killer) after minutes of work.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess

GIB = 1 << 30


def system_available() -> int:
    """Bytes of memory available to a new process on this host (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    if platform.system() == "Darwin":
        try:
            total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True,
                                       text=True, timeout=5).stdout.strip())
            # unified memory: Metal may wire about 3/4 of it by default
            return int(total * 0.75)
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _address_space_left() -> int | None:
    """Bytes of address space this process may still map under ``ulimit -v``, or None."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    used = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    return max(0, soft - used)


def _cgroup_left() -> int | None:
    """Bytes left under this process's cgroup v2 memory limit, or None when unlimited."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")),
                       None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            current = int(f.read().strip())
        return max(0, int(limit) - current)
    except (OSError, ValueError, IndexError):
        return None


def available_memory(ranks_here: int = 1) -> int:
    """Bytes one of ``ranks_here`` processes sharing this host may allocate (local).

    The host's available memory split evenly, and no more than this process's
    ``ulimit -v`` or its cgroup allows.
    """
    host = system_available()
    cgroup = _cgroup_left()  # shared by the ranks here, like the host's memory
    if cgroup is not None:
        host = min(host, cgroup)
    share = host // max(1, ranks_here)
    own = _address_space_left()
    return int(share if own is None else min(share, own))


def gib(nbytes: float) -> str:
    """``nbytes`` as GiB with one decimal (e.g. ``"3.1 GiB"``)."""
    return f"{nbytes / GIB:.1f} GiB"
