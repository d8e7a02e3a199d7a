"""``init(transport="auto", strict=False)``: choose a transport, agree on it, cache the group.

The choice is made collectively: every rank says whether it can use the
requested transport and why not, the verdicts are allgathered over MPI, and
all ranks take the same decision from the same list, so ranks that disagree
never deadlock. Rank 0 logs one line: the transport chosen and, for each one
rejected, why (silence it with ``HPCMAC_QUIET_TRANSPORT=1``).
"""

from __future__ import annotations

import argparse
import os
import sys

from hpcmac.comm.base import Group
from hpcmac.errors import UsageError

TRANSPORTS = ("auto", "mpi", "rdma", "ring", "local")

_cached: dict[str, Group] = {}


def transport_from_env(default: str = "auto") -> str:
    """``HPCMAC_TRANSPORT`` or ``default`` (not validated: see :func:`check_transport`)."""
    return os.environ.get("HPCMAC_TRANSPORT", default) or default


def strict_from_env() -> bool:
    """``HPCMAC_TRANSPORT_STRICT`` as a bool (unset, "", 0, false, no: False)."""
    return os.environ.get("HPCMAC_TRANSPORT_STRICT", "0").strip().lower() not in (
        "", "0", "false", "no", "off")


def check_transport(name: str) -> str:
    """``name`` if it is a transport, else UsageError (one line listing the valid ones)."""
    if name not in TRANSPORTS:
        raise UsageError(f"unknown transport {name!r}; expected one of: {', '.join(TRANSPORTS)}")
    return name


def add_transport_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--transport`` and ``--transport-strict`` to a command's parser.

    Validation happens in :func:`init` (one line, exit 2 through ``run_cli``),
    not in argparse, whose error is a usage block.
    """
    parser.add_argument("--transport", default=None, metavar="NAME",
                        help=f"one of {', '.join(TRANSPORTS)} (default: $HPCMAC_TRANSPORT or auto)")
    parser.add_argument("--transport-strict", action="store_true", default=None,
                        help="fail instead of falling back when the transport is unusable")


def init(transport: str | None = None, strict: bool | None = None,
         announce: bool = True, hostfile=None) -> Group:
    """Collective over the launcher's world: the Group for ``transport`` (cached).

    Parameters
    ----------
    transport : str, optional (global)
        "auto", "mpi", "rdma", "ring" or "local". None reads
        ``HPCMAC_TRANSPORT`` (default "auto"). "auto" takes rdma when every
        rank can use it, else mpi.
    strict : bool, optional (global)
        True: an unusable requested transport raises UsageError with the
        reason instead of falling back to mpi. None reads
        ``HPCMAC_TRANSPORT_STRICT``.
    announce : bool (global)
        False holds the "transport: ..." line back until :func:`announce`, so a
        command can check its input first (bad input then prints one line).
    hostfile : Hostfile, optional (global)
        The job's parsed hostfile (``hpcmac.launch.hostfile.job_hostfile``), read by
        whoever starts the job: its links carry the ring's and the heartbeat's
        traffic. comm itself reads no launcher file.

    The first call also sets this process's BLAS threads
    (:mod:`hpcmac.blas_threads`: cores shared among the ranks on each host).
    """
    if transport:
        name = check_transport(transport)
    else:
        try:
            name = check_transport(transport_from_env())
        except UsageError as exc:
            raise UsageError(f"HPCMAC_TRANSPORT: {exc}") from None
    strict = strict_from_env() if strict is None else bool(strict)
    key = f"{name}:{int(strict)}"
    if key in _cached:
        return _cached[key]
    global _holding
    _holding = not announce
    try:
        group = _choose(name, strict, hostfile)
    finally:
        _holding = False
    _configure_blas(group)
    _cached[key] = group
    if group.size > 1 and group.transport != "local":
        from hpcmac.comm import heartbeat

        # collective: a silent peer ends the job (comm.heartbeat)
        heartbeat.start(group, hostfile=hostfile)
    return group


def job_group(transport: str | None = None, announce: bool = True, hostfile=None) -> Group:
    """Collective: the Group a command runs on; no MPI started for one process.

    A job of several ranks, or any ``transport`` asked for, goes to :func:`init`, with
    ``hostfile()`` (a callable: the launcher's file is read only then). One
    process without a launcher gets the local group, also through :func:`init` so that
    its BLAS threads are set the same way (``HPCMAC_BLAS_THREADS``; once skipped there,
    so a lone ``serve`` ran every core's worth of BLAS threads whatever was asked).
    """
    from hpcmac.errors import world_size

    if world_size() > 1 or transport:
        return init(transport, announce=announce,
                    hostfile=hostfile() if hostfile is not None else None)
    return init("local", announce=announce)


def _configure_blas(group: Group) -> None:
    """Collective: BLAS threads per rank (``hpcmac.blas_threads``), once per process."""
    from hpcmac import blas_threads

    if blas_threads.current is not None:
        return
    try:
        blas_threads.configure(group)
    except ValueError as exc:   # HPCMAC_BLAS_THREADS malformed: the same on every rank
        raise UsageError(str(exc)) from None


def announce() -> None:
    """Print the transport line(s) that ``init(announce=False)`` held back."""
    lines = _held[:]
    _held.clear()
    for line in lines:
        _log(line)


def _choose(name: str, strict: bool, hostfile=None) -> Group:
    if name == "local":
        from hpcmac.comm.local import LocalGroup

        return LocalGroup()
    from hpcmac.comm import mlx as mlx_backend

    launched = mlx_backend.launched_by_mlx()
    if launched is not None:
        return _choose_mlx_launch(name, strict, launched)
    if name == "auto" and not launched_by_mpi():
        # one process and no launcher: starting MPI here (an Open MPI singleton) only
        # costs start-up time and leaves files in /dev/shm and $TMPDIR
        from hpcmac.comm.local import LocalGroup

        _log("transport: local (one process, not started by mpirun)")
        return LocalGroup()
    from hpcmac.comm.mpi import MPIGroup, is_available

    ok, why = is_available()
    if not ok:
        if strict or name != "auto":
            raise UsageError(why)
        from hpcmac.comm.local import LocalGroup

        _log(f"transport: local ({why})")
        return LocalGroup()
    world = MPIGroup()
    _agree_on_request(world, name, strict)
    if name == "mpi":
        _log_rank0(world.rank, "transport: mpi")
        return world
    wanted = "rdma" if name == "auto" else name
    reason = _mlx_reason(world, wanted)
    if reason:
        if strict:
            raise UsageError(reason)
        _log_rank0(world.rank, f"transport: mpi ({reason})")
        return world
    group, failure = init_or_fallback(world, wanted, hostfile)
    if failure:
        if strict:
            raise UsageError(failure)
        _log_rank0(world.rank, f"transport: mpi ({failure})")
        return world
    _log_rank0(world.rank, f"transport: {wanted} ({group.fallback_note()})")
    return group


def init_or_fallback(world: Group, name: str, hostfile=None) -> tuple[Group | None, str]:
    """Collective over ``world``: (the MLX group, '') or (None, why it failed to initialise).

    Every rank tries :func:`hpcmac.comm.mlx.init_group`; the outcome is agreed
    with a bounded non-blocking reduction, so when one rank's JACCL fails
    while its peers wait inside JACCL's own handshake, the job is ended with
    that rank's reason after ``HPCMAC_INIT_WAIT`` seconds (default 60)
    instead of hanging.
    """
    import socket
    import time

    import numpy as np

    from hpcmac.comm import mlx as mlx_backend

    group, why = None, ""
    try:
        group = mlx_backend.init_group(name, world, hostfile)
    except Exception as exc:  # JACCL/ring raise RuntimeError; anything else is a failure too
        why = f"{name}: {_launcher_backend(name)} failed to initialise on rank {world.rank} " \
              f"({socket.gethostname()}): {str(exc).splitlines()[0] if str(exc) else exc!r}"
    from mpi4py import MPI

    flag = np.array([1 if why else 0], dtype=np.int32)
    anyfail = np.zeros(1, dtype=np.int32)
    req = world.comm.Iallreduce(flag, anyfail, op=MPI.MAX)
    deadline = time.monotonic() + float(os.environ.get("HPCMAC_INIT_WAIT", "60"))
    while not req.Test():
        if time.monotonic() > deadline:
            print(f"error: {why or name + ': peers did not finish initialising'}; other ranks "
                  "are stuck in its handshake, ending the job", file=sys.stderr, flush=True)
            world.abort(1)
        time.sleep(0.01)
    if not anyfail[0]:
        return group, ""
    reasons = [r for r in world.allgather_obj(why) if r]
    return None, reasons[0]


def _choose_mlx_launch(name: str, strict: bool, launched: str) -> Group:
    """Started by mlx.launch: no MPI world, the launcher decided the MLX backend."""
    from hpcmac.comm import mlx as mlx_backend

    rank = int(os.environ.get("MLX_RANK", "0"))
    rejected = ""
    if name not in ("auto", launched):
        rejected = f"{name}: launched by mlx.launch --backend {_launcher_backend(launched)}"
        if strict:
            raise UsageError(rejected)
    ok, why = mlx_backend.is_available(launched)
    if not ok:  # the launcher asked for a backend this mlx cannot run: nothing to fall back on
        raise UsageError(why)
    group = mlx_backend.init_group(launched, None)
    note = group.fallback_note() + (f"; {rejected}" if rejected else "")
    _log_rank0(rank, f"transport: {launched} ({note})")
    return group


def launched_by_mpi(env: dict[str, str] | None = None) -> bool:
    """Whether an MPI launcher (mpirun, mpiexec, srun with PMI/PMIx) started this process."""
    env = os.environ if env is None else env
    return any(v in env for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"))


def _agree_on_request(world: Group, name: str, strict: bool) -> None:
    """Collective: every rank must ask for the same transport, else all raise the same error."""
    asks = world.allgather_obj((name, strict))
    if len(set(asks)) > 1:
        detail = ", ".join(f"rank {r} asks {n}{' (strict)' if st else ''}"
                           for r, (n, st) in enumerate(asks))
        raise UsageError(f"ranks disagree on the transport: {detail}")


def _launcher_backend(name: str) -> str:
    return "jaccl" if name == "rdma" else name


def _mlx_reason(world: Group, name: str) -> str:
    """Agreed over ``world``: '' when every rank can use MLX ``name``, else the first reason."""
    from hpcmac.comm import mlx as mlx_backend

    ok, why = mlx_backend.is_available(name)
    if ok and name == "rdma":  # the device matrix must fit this job's ranks too
        why = mlx_backend.rdma_matrix_problem(world.size, world.rank)[1]
        ok = not why
    import socket

    verdicts = world.allgather_obj((ok, why, socket.gethostname()))
    bad = [(r, reason, host) for r, (good, reason, host) in enumerate(verdicts) if not good]
    if not bad:
        return ""
    r, reason, host = bad[0]
    return reason if len(bad) == len(verdicts) else f"{reason} (rank {r} on {host})"


def _log_rank0(rank: int, line: str) -> None:
    if rank == 0:
        _log(line)


#: transport lines held back by init(announce=False) until announce()
_holding = False
_held: list[str] = []


def _log(line: str) -> None:
    if _holding:
        _held.append(line)
        return
    if os.environ.get("HPCMAC_QUIET_TRANSPORT") == "1":
        return
    print(line, file=sys.stderr, flush=True)
