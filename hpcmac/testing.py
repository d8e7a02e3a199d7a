"""Helpers for MPI tests (hpcmac's own and users'): verdicts every rank agrees on.

Run MPI tests with ``mpirun -np N python -m mpi4py -m hpcmac.testing [pytest args]``:

* ``-m mpi4py`` turns an uncaught exception on any rank into ``MPI_Abort``,
  so the job ends instead of leaving other ranks in a collective;
* this module's ``main`` runs pytest with ``--with-mpi`` (pytest-mpi) and
  prefixes the output of every rank but 0 with ``[rank N]``, rank > 0 quiet
  except for failures;
* pytest-timeout (thread method, see pyproject.toml) ends a deadlocked rank
  with a stack dump naming the test; mpirun then ends the others.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import numpy as np


def world():
    """The MPI group of this job (``hpcmac.comm`` mpi transport)."""
    from hpcmac.comm.mpi import MPIGroup

    return MPIGroup()


def parallel_assert(cond: Any, msg: str = "", group=None) -> None:
    """Collective: raise AssertionError on every rank if ``cond`` is false on any rank.

    The message lists the ranks that failed and what each said.
    """
    group = world() if group is None else group
    ok = bool(cond)
    verdicts = group.allgather_obj((ok, "" if ok else str(msg)))
    failed = [(r, m) for r, (good, m) in enumerate(verdicts) if not good]
    if failed:
        detail = "; ".join(f"rank {r}: {m}" if m else f"rank {r}" for r, m in failed)
        raise AssertionError(f"failed on {len(failed)}/{group.size} ranks: {detail}")


def parallel_allclose(actual, desired, rtol=1e-7, atol=0.0, msg: str = "", group=None) -> None:
    """Collective ``np.testing.assert_allclose`` whose verdict every rank shares."""
    try:
        np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol)
        ok, why = True, ""
    except AssertionError as exc:
        ok, why = False, f"{msg} {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
    parallel_assert(ok, why.strip(), group)


class _Prefixed(io.TextIOBase):
    """A text stream that prefixes every line written to ``raw`` with ``prefix``."""

    def __init__(self, raw, prefix: str):
        self._raw, self._prefix, self._bol = raw, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._bol:
                out.append(self._prefix)
            out.append(piece)
            self._bol = piece.endswith("\n")
        self._raw.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._raw.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._raw.fileno()

    @property
    def encoding(self):
        return getattr(self._raw, "encoding", "utf-8")


class _QuietMPIInfo:
    """Drop pytest-mpi's end-of-run "MPI Information" block (mpi4py's rc and build
    config, repeated by every rank); ``python -m hpcmac info`` says the same once."""

    def pytest_sessionstart(self, session) -> None:
        for plugin in session.config.pluginmanager.get_plugins():
            if type(plugin).__name__ == "MPIPlugin" and hasattr(plugin, "_is_testing_mpi"):
                plugin._is_testing_mpi = False


def main(argv: list[str] | None = None) -> int:
    """Run pytest on this rank of an MPI job; the exit status is the job's verdict."""
    import pytest
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    args = list(sys.argv[1:] if argv is None else argv)
    args = ["--with-mpi", "-p", "no:cacheprovider", *args]
    if size > 1:
        if rank > 0:
            args = ["-q", "--no-header", "-rf", *args]
        prefix = f"[rank {rank}] "
        sys.stdout = _Prefixed(sys.__stdout__, prefix)
        sys.stderr = _Prefixed(sys.__stderr__, prefix)
    code = int(pytest.main(args, plugins=[_QuietMPIInfo()]))
    sys.stdout.flush()
    sys.stderr.flush()
    # one verdict for the job: any rank's failure fails all
    worst = MPI.COMM_WORLD.allreduce(code if code not in (0, 5) else 0, op=MPI.MAX)
    none = MPI.COMM_WORLD.allreduce(1 if code == 5 else 0, op=MPI.MIN)
    if worst:
        return worst
    return 5 if none else 0


if __name__ == "__main__":
    sys.exit(main())
