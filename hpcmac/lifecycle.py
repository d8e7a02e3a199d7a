"""The one way every command runs, reports bad input and ends.

:func:`run_cli` runs a command's ``main``: a :class:`~hpcmac.errors.UsageError`
becomes one line on stderr and exit code 2, with no traceback (:func:`fail`).

Rules that keep ranks from hanging:

* Input that every rank reads (HPL.dat, a hostfile, CLI flags) is validated
  identically on every rank, so every rank raises the same error before any
  collective starts; they all exit 2 and rank 0 alone prints.
* An error that happens on some ranks only, once collectives are under way,
  must abort the whole job: :func:`run_cli` aborts for anything that is not a
  UsageError, and for a UsageError marked ``local`` (an output that failed to
  write on rank 0 alone: one line, exit 1). A UsageError's ``code`` (default 2)
  is the exit code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from hpcmac.errors import UsageError, world_rank


def fail(message: str, code: int = 2) -> None:
    """Print ``error: message`` once (rank 0) and exit with ``code``.

    Meant to be reached by every rank with the same message (input validated
    identically everywhere). Under MPI the ranks first agree that they are all
    here (a non-blocking barrier, at most ``HPCMAC_FAIL_WAIT`` seconds, else the
    job is aborted), finalize MPI, and only rank 0 exits non-zero, last: then
    mpirun reports no crash banner and no rank is killed mid-exit.
    """
    if world_rank() == 0:
        # one line whatever the message holds (a name read from a damaged file, say)
        line = message.replace("\r", "\\r").replace("\n", "\\n")
        print(f"error: {line}", file=sys.stderr, flush=True)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None and _mpi_launched():
        # the input was refused before MPI started; start it only to leave together,
        # else mpirun sees rank 0 exit non-zero first and prints its crash banner
        try:
            from mpi4py import MPI as mpi
        except Exception:  # no usable MPI here: exit as we are
            mpi = None
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        raise SystemExit(code)
    world = mpi.COMM_WORLD
    if world.Get_size() == 1:
        raise SystemExit(code)
    import time

    request = world.Ibarrier()
    deadline = time.monotonic() + float(os.environ.get("HPCMAC_FAIL_WAIT", "20"))
    while not request.Test():
        if time.monotonic() > deadline:  # some rank is elsewhere: end the job
            world.Abort(code)
        time.sleep(0.005)
    rank = world.Get_rank()
    sys.stdout.flush()
    sys.stderr.flush()
    from hpcmac.comm.cleanup import finalize

    finalize()  # MPI_Finalize, then remove what Open MPI leaves in /dev/shm
    if rank != 0:
        os._exit(0)
    time.sleep(0.5)  # let the other ranks leave first
    os._exit(code)


def _mpi_launched() -> bool:
    """Started by mpirun/mpiexec (Open MPI or PMI) with more than one rank."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a command's ``main(argv)``; bad input becomes one line and exit 2.

    Any other exception on any rank aborts the whole MPI job (when MPI is
    initialised), so no rank is left waiting in a collective. SIGINT and SIGTERM
    end the process with ``interrupted, rank R`` and exit 130 / 143
    (:mod:`hpcmac.interrupts`).
    """
    from hpcmac import interrupts

    interrupts.install()
    try:
        code = main(argv)
    except UsageError as exc:
        code = getattr(exc, "code", 2)
        if getattr(exc, "local", False):  # one rank's output failed mid-run: end the job
            line = str(exc).replace("\r", "\\r").replace("\n", "\\n")
            print(f"error: {line}", file=sys.stderr, flush=True)
            _abort_if_parallel(code)
            raise SystemExit(code) from None
        fail(str(exc), code)
    except KeyboardInterrupt:  # a handler of the command's own raised it (finally blocks ran)
        import signal

        interrupts.end(signal.SIGINT)
        raise SystemExit(130) from None
    except SystemExit:
        raise
    except BrokenPipeError:  # `| head` closed standard output: leave quietly, as a shell
        # tool killed by SIGPIPE does (stdout to /dev/null: the exit's flush cannot fail)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _abort_if_parallel(141)
        raise SystemExit(141) from None
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        _abort_if_parallel(1)
        raise
    return int(code or 0)


def _abort_if_parallel(code: int) -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        if mpi.COMM_WORLD.Get_size() > 1:
            mpi.COMM_WORLD.Abort(code)
