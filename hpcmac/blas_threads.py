"""BLAS threads per rank, chosen once by ``comm.init()`` and reported by ``info``.

The rule: ranks that share a host split its cores, ``cores // ranks_here``
threads each (one per rank when the ranks fill the cores or more), and a
rank alone on its host gets all of them. What the user set wins: an explicit
request (``HPCMAC_BLAS_THREADS``, ``hpl --blas-threads``; 0 means "leave
BLAS alone") or a thread count in the environment (``OMP_NUM_THREADS``,
``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS``, ``VECLIB_MAXIMUM_THREADS``).

A launcher may bind a rank to fewer cores (Open MPI binds each rank to one
core when it starts at most 2): a rank alone on its host is then widened to
the host's cores unless a batch scheduler gave it the binding (Slurm, PBS,
LSF); otherwise the thread count never exceeds the cores the rank may use,
since threads that share a core spin against each other. The choice is
applied with threadpoolctl to numpy's and scipy's BLAS (loaded first if
they were not); no environment variable is changed, so processes this one
starts choose for themselves.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

ENV_KEYS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
            "VECLIB_MAXIMUM_THREADS")
SCHEDULER_KEYS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID")


@dataclass
class Choice:
    """``threads``: imposed per rank, or None (BLAS left as it is); ``reason``: one phrase."""

    threads: int | None
    reason: str
    widened: bool = False


def choose(requested: int | None, ranks_here: int, cores: int, usable: int | None = None,
           env=None) -> Choice:
    """Pure: the thread count for one rank.

    Parameters
    ----------
    requested : int or None
        An explicit request (0: leave BLAS alone); None: decide.
    ranks_here : int
        Ranks of the job on this host.
    cores : int
        Cores of the host.
    usable : int, optional
        Cores this rank may run on (its affinity mask); None: all.
    env : mapping, optional
        The environment (default ``os.environ``).
    """
    env = os.environ if env is None else env
    if requested is not None:
        if requested <= 0:
            return Choice(None, "left to the BLAS library (requested 0)")
        return Choice(int(requested), "requested")
    for key in ENV_KEYS:
        if env.get(key):
            return Choice(None, f"{key}={env[key]} from the environment")
    ranks_here = max(1, int(ranks_here))
    threads = max(1, cores // ranks_here)
    what = f"{cores} cores, {ranks_here} rank{'s' if ranks_here > 1 else ''} on this host"
    if usable is not None and usable < threads:
        return Choice(usable, f"{what}; this rank is bound to {usable} core"
                              f"{'s' if usable > 1 else ''}")
    return Choice(threads, what)


def requested_from_env(env=None) -> int | None:
    """``HPCMAC_BLAS_THREADS`` as an int (None when unset); ValueError when not an integer >= 0."""
    env = os.environ if env is None else env
    raw = env.get("HPCMAC_BLAS_THREADS", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"HPCMAC_BLAS_THREADS: expected an integer >= 0, found {raw!r}")
    return int(raw)


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # macOS has no affinity masks
        return None


#: what configure() decided in this process (reported by ``python -m hpcmac info``)
current: Choice | None = None


def configure(group, requested: int | None = None) -> Choice:
    """Collective over ``group``: choose and apply this rank's BLAS thread count.

    ``requested`` (global) overrides ``HPCMAC_BLAS_THREADS``; None asks the
    environment, then the rule above. Called by ``comm.init()``; calling it
    again with a request re-applies.
    """
    global current
    hosts = group.allgather_obj(socket.gethostname()) if group.size > 1 else [None]
    ranks_here = hosts.count(hosts[group.rank])
    if requested is None:
        requested = requested_from_env()
    cores = os.cpu_count() or 1
    mask = _affinity()
    widened = False
    if (requested is None and ranks_here == 1 and mask is not None and len(mask) < cores
            and not any(os.environ.get(k) for k in SCHEDULER_KEYS + ENV_KEYS)):
        try:
            os.sched_setaffinity(0, range(cores))
            mask, widened = _affinity(), True
        except OSError:
            pass
    choice = choose(requested, ranks_here, cores, len(mask) if mask else None)
    if widened:
        choice.reason += "; widened from the launcher's binding (the only rank on this host)"
        choice.widened = True
    if choice.threads is not None:
        _apply(choice.threads)
    current = choice
    return choice


def _apply(threads: int) -> None:
    # threadpoolctl sees only loaded libraries: load numpy's and scipy's BLAS first (no
    # environment variable is set, so child processes choose for themselves). scipy's
    # BLAS comes with its cython_blas module, loaded without scipy.linalg's ~0.2 s of
    # imports (numpy.f2py, array_api_compat) that an HPL job never uses
    import numpy  # noqa: F401
    from threadpoolctl import threadpool_limits

    from hpcmac.linalg import _blas  # noqa: F401

    threadpool_limits(limits=threads, user_api="blas")


def describe() -> str:
    """One line for ``info``: the threads per rank and why."""
    if current is None:
        return "not configured (comm.init() was not called)"
    if current.threads is None:
        return f"as the BLAS library chose ({current.reason})"
    return f"{current.threads} per rank ({current.reason})"
