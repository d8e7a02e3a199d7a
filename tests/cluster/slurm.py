"""A real single-node Slurm (slurmctld, slurmd, munge) under a temp dir, no systemd.

:meth:`Slurm.start` writes the config, starts munged, slurmctld and slurmd
and waits for the node to be idle; :meth:`Slurm.stop` kills the three
daemons (by their pid files and the processes this object started) and
removes nothing but what it made. Every command gets ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "mungekey")


def capability() -> str:
    """'' when a single-node Slurm can run here, else why not."""
    if os.geteuid() != 0:
        return "slurmd needs root"
    missing = [d for d in DAEMONS if not shutil.which(d) and not Path(f"/usr/sbin/{d}").exists()]
    if missing:
        return f"not installed: {', '.join(missing)} (tools/system-deps installs them as root)"
    try:
        import pwd

        pwd.getpwnam("munge")
    except KeyError:
        return "no munge user (the munge package creates it)"
    return ""


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class Slurm:
    def __init__(self, root: Path, cpus: int = 2):
        self.root = root
        self.host = socket.gethostname()
        self.cpus = cpus
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge", "tmp"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=hpcmactest
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={self.port}
SlurmdPort={self.port + 1}
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.socket
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
TmpFS={r}/tmp
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=10 State=UP OverSubscribe=FORCE:4
""")

    def start(self, timeout: float = 30) -> None:
        self.port = 20000 + os.getpid() % 20000
        self._write_conf()
        m = self.root / "munge"
        os.chmod(m, 0o755)
        key = m / "munge.key"
        subprocess.run([_bin("mungekey"), "-c", "-k", str(key)], check=True,
                       capture_output=True)
        shutil.chown(m, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        os.chmod(key, 0o600)
        self._daemon(["runuser", "-u", "munge", "--", _bin("munged"),
                        f"--socket={m}/munge.socket", f"--key-file={key}",
                        f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid",
                        f"--seed-file={m}/munged.seed"], what="munged")
        for d in ("slurmctld", "slurmd"):
            self._daemon([_bin(d), "-f", str(self.conf)], what=d)
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            res = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env,
                                 capture_output=True, text=True, timeout=10)
            state = res.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.3)
        raise RuntimeError(f"slurm node not idle after {timeout} s (state {state!r}); "
                           f"log: {self.log()[-1500:]}")

    def _daemon(self, argv: list[str], what: str) -> None:
        res = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=20)
        if res.returncode:
            raise RuntimeError(f"{what} did not start: {res.stderr.strip()}\n{self.log()}")

    def log(self) -> str:
        out = []
        for f in ("log/slurmctld.log", "log/slurmd.log", "munge/munged.log"):
            p = self.root / f
            if p.exists():
                out.append(f"== {f}\n{p.read_text()[-3000:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"):
            p = self.root / pidfile
            try:
                pid = int(p.read_text().split()[0])
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if str(self.root).encode() not in cmd:
                continue  # the pid was reused by something that is not ours
            try:
                os.kill(pid, signal.SIGTERM)
                for _ in range(50):
                    os.kill(pid, 0)
                    time.sleep(0.1)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def sbatch(self, script: Path, *args: str, env: dict | None = None) -> str:
        res = subprocess.run(["sbatch", "--parsable", *args, str(script)],
                             env={**self.env, **(env or {})}, capture_output=True, text=True,
                             timeout=30, check=True, cwd=env.get("PWD") if env else None)
        return res.stdout.strip().split(";")[0]

    def wait(self, job: str, timeout: float) -> str:
        """Wait until ``job`` has left the queue; its final state from the controller."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=self.env,
                                 capture_output=True, text=True, timeout=10)
            if not res.stdout.strip():
                break
            time.sleep(0.3)
        else:
            subprocess.run(["scancel", job], env=self.env, capture_output=True, timeout=10)
            raise TimeoutError(f"job {job} still queued or running after {timeout} s")
        res = subprocess.run(["scontrol", "show", "job", job], env=self.env,
                             capture_output=True, text=True, timeout=10)
        for word in res.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"
