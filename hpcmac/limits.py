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


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _cgroup_left(proc_cgroup: str = "/proc/self/cgroup",
                 root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this process's cgroup memory limit, or None when unlimited.

    cgroup v2 (``memory.max`` less ``memory.current``) where the memory controller is
    there, else cgroup v1's (``memory.limit_in_bytes`` less ``memory.usage_in_bytes``
    under ``root/memory``, as on hybrid hosts).
    """
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for hid, controllers, rel in lines:
        try:
            if hid == "0" and controllers == "":
                base = os.path.join(root, rel.lstrip("/"))
                limit = _read(os.path.join(base, "memory.max"))
                if limit == "max":
                    return None
                return max(0, int(limit) - int(_read(os.path.join(base, "memory.current"))))
            if "memory" in controllers.split(","):
                base = os.path.join(root, "memory", rel.lstrip("/"))
                limit = int(_read(os.path.join(base, "memory.limit_in_bytes")))
                if limit >= 1 << 60:  # v1 writes "unlimited" as ~2^63
                    return None
                return max(0, limit - int(_read(os.path.join(base, "memory.usage_in_bytes"))))
        except (OSError, ValueError):
            continue  # no memory controller in this hierarchy
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
