"""``serve --survive``: a front process outside the MPI job that outlives it.

The front owns the HTTP port (the same app as plain ``serve``,
:func:`hpcmac.llm.server.build_app`, serving from a
:class:`~hpcmac.llm.survive.front.FrontSource`), the request queue and every
request's tokens so far. It places the model on the hostfile's hosts
(:func:`~hpcmac.llm.survive.replace.replace_on`), launches the job through
:mod:`hpcmac.launch` (mpirun over a hostfile of the hosts in use) with
``--channel``, and talks to rank 0 over a loopback TCP channel
(:mod:`~hpcmac.llm.survive.channel`). No MPI rank opens an HTTP port.

A loss is the job ending, the channel closing, or rank 0's beats stopping
for ``--survive-heartbeat`` seconds (the job's own heartbeat and watchdog
end it within that time when any other rank or link goes). The front then
ends what is left of the job, names the lost host from the job's last lines,
drops it (``launch doctor``'s checks drop any other host that fails them),
places the model on the survivors, relaunches, and resubmits every open
request to the new job. See docs/faults.md.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from hpcmac.errors import UsageError
from hpcmac.llm.survive.channel import LOADING
from hpcmac.llm.survive.readmit import Readmits

#: the front's work folder (hostfiles of each job): ``PREFIX<pid>-<random>`` in the temp dir
WORK_PREFIX = "hpcmac-survive-"


def sweep_work_dirs(tmp: str | None = None) -> list[str]:
    """Remove the work folders of fronts that are gone (killed: SIGKILL runs no cleanup),
    this user's only; the removed paths."""
    import shutil

    tmp = tmp or tempfile.gettempdir()
    gone = []
    for entry in os.scandir(tmp):
        pid = entry.name.removeprefix(WORK_PREFIX).split("-", 1)[0]
        if not entry.name.startswith(WORK_PREFIX) or not pid.isdigit():
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
            continue  # its front is alive
        except ProcessLookupError:
            pass
        except (PermissionError, OSError):  # alive under another user, or unreadable
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        gone.append(entry.path)
    return gone


def work_dir() -> str:
    """A new work folder for this front, removed at exit (normal, an exception, SystemExit;
    a fatal signal's is removed by the next front's :func:`sweep_work_dirs`)."""
    import atexit
    import shutil

    sweep_work_dirs()
    path = tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


#: launches in a row that never reached "hello" before the front gives up
MAX_FAILED_STARTS = 3
#: seconds the launcher has, after the front noticed a loss, to report it and exit
LAUNCHER_GRACE_S = 1.5
#: flags of the front that the job must not get (with their values)
_FRONT_ONLY = {"--host": 1, "--port": 1, "--hostfile": 1, "--tp": 1, "--pp": 1, "--split": 1,
               "--tp-split": 1, "--agent": 1, "--survive-heartbeat": 1,
               "--survive-start-timeout": 1, "--channel": 1, "--survive": 0,
               "--readmit-after": 1, "--api-key": 1, "--cors": 1}



def job_flags(argv: list[str]) -> list[str]:
    """``argv`` (serve's flags) without the ones the front keeps to itself (pure)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in _FRONT_ONLY:
            i += 1 + (_FRONT_ONLY[name] if "=" not in a else 0)
            continue
        out.append(a)
        i += 1
    return out


class Job:
    """One launch of the MPI job: its process group and its last stderr lines."""

    def __init__(self, argv: list[str], env: dict[str, str], on_line=None):
        self.lines: deque[str] = deque(maxlen=400)
        self.on_line = on_line
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace",
                                     start_new_session=True)
        self.relay = threading.Thread(target=self._relay, daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if self.on_line is not None:
                self.on_line(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def own_lines(self, grace: float) -> list[str]:
        """The job's last lines before the front ends it, the launcher given ``grace`` s
        to report the fault and exit by itself (rank 0 often notices a dead peer before
        Open MPI's launcher does). What ranks print once the front has signalled them
        names the ranks it ended, not the lost host."""
        try:
            self.proc.wait(grace)
            self.relay.join(0.5)  # its last lines
        except subprocess.TimeoutExpired:
            pass
        return list(self.lines)

    def end(self, grace: float = 3.0) -> None:
        """TERM the launcher's group, KILL it after ``grace`` s; its output read to the end."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.relay.join(timeout=3)


def next_beat(beat: float, base: float, dropped: bool, lines) -> float:
    """The next job's heartbeat seconds (pure). A job lost with no host dropped whose
    lines say a heartbeat ran out was most likely a rank starved of CPU, not a dead
    host (seen at load 22-28 with 4 s: rank 0 silent 4-5 s while starting, three
    launches in a row): twice the last, at most 4x ``base``. Back to ``base`` once a
    loss drops a host."""
    if dropped:
        return base
    if any("no heartbeat from" in ln or "sent nothing for" in ln for ln in lines):
        return min(beat * 2, base * 4)
    return beat


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """The front's loop: place, launch, watch, recover (see the module doc)."""

    def __init__(self, args, argv: list[str], source, cfg, context: int, slots: int):
        from hpcmac.launch.hostfile import load_with_data
        from hpcmac.llm.parallel.placement import LayoutFlags, ModelSizes
        from hpcmac.llm.parallel.plan import HostMemory, available_memory

        self.args, self.source, self.cfg = args, source, cfg
        self.hf, self.data = load_with_data(args.hostfile)
        if not isinstance(self.data, dict) or "hosts" not in self.data:
            raise UsageError(f"{args.hostfile}: --survive needs an hpcmac hostfile (an object "
                             "with \"hosts\"), not an mlx.launch list")
        self.hosts = [HostMemory(h.name, h.slots, h.memory_gb) for h in self.hf.hosts]
        self.ssh = {h.name: h.ssh for h in self.hf.hosts}
        self.flags = LayoutFlags.of(args)
        self.sizes = ModelSizes(args.model, args.quantize, args.q_group_size)
        self.avail = available_memory()
        self.kv_tokens, self.slots = slots * context, slots
        self.job_argv = job_flags(argv)
        self.stop = threading.Event()
        self.token = ""  # each launch's own (_launch): a late hello from an ended job is refused
        self.lost: list[str] = []
        self._back: list[str] = []  # the hosts the last wait for a readmission brought back
        self.beat = args.survive_heartbeat  # the next job's heartbeat seconds (next_beat)
        self.evidence: list[str] = []  # the job's lines that named the last lost host
        self.readmits = Readmits(args.readmit_after)  # hosts to check for re-admission
        self._check: tuple[threading.Thread, list[str], list] | None = None  # doctor, running
        self.all_hosts = list(self.hosts)  # the hostfile's, in its order
        self.work = work_dir()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"

    def request_readmit(self, host: str) -> tuple[dict, int]:
        """The HTTP thread: queue ``host`` for re-admission (the watch loop checks it)."""
        if host not in self.ssh:
            return {"error": {"message": f"no host {host!r} in {self.args.hostfile}"}}, 404
        if host not in self.lost:
            return {"error": {"message": f"host {host!r} is not lost"}}, 409
        self.readmits.ask(host)
        return {"status": "accepted", "host": host,
                "note": "doctor checks it; /health says when it is back"}, 202

    def _readmittable(self) -> list[str]:
        """The lost hosts to bring back now: asked by hand or due by --readmit-after, and
        passed by doctor (with the hosts in use), whose checks run in a thread so the
        watch loop goes on; [] while they run. A host doctor fails is told in the log."""
        now = time.monotonic()
        if self._check is None:
            due = [h for h in self.readmits.due(now) if h in self.lost]
            if due:
                names, bad = [h.name for h in self.hosts] + due, []
                t = threading.Thread(target=lambda: bad.extend(self._doctor(names)),
                                     name="hpcmac-survive-doctor", daemon=True)
                t.start()
                self._check = (t, due, bad)
            return []
        t, due, bad = self._check
        if t.is_alive():
            return []
        self._check = None
        for h in due:
            if h in bad:
                print(f"serve --survive: {h} not readmitted: launch doctor fails it",
                      file=sys.stderr, flush=True)
        return [h for h in self.readmits.checked(due, bad, now) if h in self.lost]

    # -- one job ----------------------------------------------------------------------------
    def _place(self):
        from hpcmac.llm.survive.replace import replace_on

        return replace_on(self.cfg, self.sizes, self.hosts, self.flags,
                          kv_tokens=self.kv_tokens, sequences=self.slots, avail=self.avail,
                          lost=self.lost)

    def _launch(self, placement, flags, names: list[str]) -> Job:
        from hpcmac.launch import runner
        from hpcmac.launch.hostfile import parse
        from hpcmac.llm.survive.channel import TOKEN_ENV
        from hpcmac.llm.survive.replace import survivors_hostfile

        data = survivors_hostfile(self.data, names)
        path = os.path.join(self.work, "hostfile.json")
        Path(path).write_text(json.dumps(data, indent=1))
        hf = parse(data, path)
        layout = ["--tp", str(placement.tp), "--pp", str(placement.pp)]
        if flags.split:
            layout += ["--split", flags.split]
        if flags.tp_split and placement.tp > 1:
            layout += ["--tp-split", flags.tp_split]
        command = [sys.executable, "-m", "hpcmac.llm", "serve", *self.job_argv, *layout,
                   "--hostfile", path, "--channel", self.address]
        beat = f"HPCMAC_HEARTBEAT_TIMEOUT={self.beat:g}"
        opts = runner.Options(np=placement.size, agent=self.args.agent, env=[beat],
                              oversubscribe=placement.size > hf.total_slots())
        plan = runner.plan(hf, command, opts, self.work)
        for p, content in plan.files.items():
            Path(p).write_text(content)
        argv = list(plan.argv)
        cut = argv.index("--")
        argv[cut:cut] = ["-x", TOKEN_ENV]  # by name: the value stays out of ps

        def on_line(line: str) -> None:  # rank 0 starts loading: the launch is done
            if LOADING in line and self.source.phase == "relaunching":
                self.source.set_phase("reloading")

        self.source.set_phase("relaunching" if self.source.phase else None)
        self.token = secrets.token_hex(16)
        return Job(argv, {**os.environ, **plan.env, TOKEN_ENV: self.token}, on_line)

    def _accept(self, job: Job):
        """The job's hello over the channel; None when it ended, was stopped or timed out."""
        from hpcmac.llm.survive.channel import Closed, Conn

        deadline = time.monotonic() + self.args.survive_start_timeout
        while not self.stop.is_set() and time.monotonic() < deadline:
            if job.proc.poll() is not None:
                return None, None
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn = Conn(sock)
            sock.settimeout(10)
            try:
                hello = conn.recv()
            except Closed:
                conn.close()
                continue
            sock.settimeout(None)
            if hello.get("op") != "hello" or hello.get("token") != self.token:
                conn.close()  # not our job
                continue
            return conn, hello
        return None, None

    def _watch(self, job: Job, conn) -> tuple[str, float]:
        """Serve until the job is lost; why it was, and when its last frame came."""
        from hpcmac.llm.survive.channel import Closed

        last = [time.monotonic()]
        closed = threading.Event()

        def read():
            try:
                while True:
                    msg = conn.recv()
                    last[0] = time.monotonic()
                    if msg["op"] != "beat":
                        self.source.on_message(msg)
            except (Closed, KeyError, TypeError, ValueError):
                closed.set()

        threading.Thread(target=read, name="hpcmac-survive-read", daemon=True).start()
        limit = self.beat
        while not self.stop.is_set():
            if self.lost:
                back = self._readmittable()
                if back:
                    return f"readmitting {', '.join(back)}", time.monotonic()
            rc = job.proc.poll()
            if rc is not None:
                return f"the job ended (exit {rc})", last[0]
            if closed.is_set():
                return "rank 0 closed the channel", last[0]
            if time.monotonic() - last[0] > limit:
                return f"rank 0 sent nothing for {limit:g} s", last[0]
            time.sleep(0.05)
        return "stopping", last[0]

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        failed_starts = 0
        recovering: dict | None = None
        while not self.stop.is_set():
            try:
                placement, flags, names = self._place()
            except UsageError as exc:
                self.source.refuse(str(exc))
                print(f"serve --survive: {exc}", file=sys.stderr, flush=True)
                if not self._wait_readmit():
                    break
                self.source.unrefuse(f"recovering: readmitting {', '.join(self._back)}",
                                     phase="replacing")
                recovering = {"why": f"readmitting {', '.join(self._back)}", "lost": [],
                              "evidence": [], "t_detect": time.monotonic(), "detect_s": 0.0}
                continue
            t_launch = time.monotonic()
            job = self._launch(placement, flags, names)
            conn, hello = self._accept(job)
            if conn is None:
                job.end()
                if self.stop.is_set():
                    break
                failed_starts += 1
                last = next((ln for ln in reversed(job.lines) if ln.strip()), "no output")
                if failed_starts >= MAX_FAILED_STARTS:
                    why = (f"the job failed to start {failed_starts} times on "
                           f"{', '.join(names)}; its last line: {last}")
                    self.source.refuse(why)
                    print(f"serve --survive: {why}", file=sys.stderr, flush=True)
                    self.stop.wait()
                    break
                self._lose(job, f"the job ended before it was up ({last})", names)
                continue
            failed_starts = 0
            info = {k: hello.get(k) for k in ("placement", "hosts", "ranks", "load_s", "bytes")}
            resumed = self.source.attach(conn, info)
            now = time.monotonic()
            if recovering is not None:
                gb = (info["bytes"] or 0) / 2**30
                t_detect = recovering.pop("t_detect")
                rec = {**recovering, "resumed": resumed,
                       "replace_s": round(t_launch - t_detect, 3),
                       "start_s": round(now - t_launch, 3),
                       "reload_s": round(info["load_s"] or 0.0, 3),
                       "reload_s_per_gb": round((info["load_s"] or 0.0) / gb, 3) if gb else None,
                       "gb": round(gb, 3)}
                rec["seconds"] = round(rec["replace_s"] + rec["start_s"], 3)
                self.source.record(rec, now)
                print(f"serve --survive: recovered in {rec['seconds']:.1f} s on "
                      f"{', '.join(names)} ({info['placement']}; reload {rec['reload_s']:.1f} s "
                      f"for {gb:.2f} GiB of weights); {resumed} stream(s) resumed",
                      file=sys.stderr, flush=True)
                recovering = None
            if self.lost:
                self.source.serving("degraded", f"serving without {', '.join(self.lost)} "
                                    f"(lost); on {', '.join(names)}")
            else:
                self.source.serving("ok", "")
            why, t_last = self._watch(job, conn)
            if self.stop.is_set():
                self._stop_job(job, conn)
                break
            t_detect = time.monotonic()
            self.source.detach()
            conn.close()
            if why.startswith("readmitting "):  # a planned relaunch on the larger set
                back = why.split(" ", 1)[1].split(", ")
                self.lost = [h for h in self.lost if h not in back]
                self.hosts = [h for h in self.all_hosts if h.name not in self.lost]
                self.source.set_state("degraded", f"recovering: {why}", phase="replacing")
                job.end(grace=1.0)
                lost = []
            else:
                lost = self._lose(job, why, names)
            # detect_s: from the job's last frame (a beat every 0.5 s, or a token) to here
            recovering = {"why": why, "lost": lost, "evidence": self.evidence if lost else [],
                          "t_detect": t_detect,
                          "detect_s": round(t_detect - t_last, 3)}
        return 0

    def _wait_readmit(self) -> bool:
        """Nothing fits the hosts left: wait (503s meanwhile) until a lost host is
        readmitted (asked, or by --readmit-after) and put it back; False when stopped."""
        while not self.stop.wait(0.2):
            back = self._readmittable()
            if back:
                self._back = back
                self.lost = [h for h in self.lost if h not in back]
                self.hosts = [h for h in self.all_hosts if h.name not in self.lost]
                return True
        return False

    def _lose(self, job: Job, why: str, names: list[str]) -> list[str]:
        """The job is lost: end it, name and drop the lost host; the hosts dropped."""
        from hpcmac.llm.survive.replace import evidence, lost_hosts

        self.source.set_state("degraded", f"recovering: {why}", phase="detecting")
        lines = job.own_lines(LAUNCHER_GRACE_S)
        job.end(grace=1.0)
        pairs = [(n, self.ssh[n]) for n in names]
        blamed = lost_hosts(lines, pairs)
        front = self.hosts[0].name if self.hosts else None
        drop = [h for h in blamed if h != front]  # the front's own host is alive: it is us
        self.lost += [h for h in drop if h not in self.lost]  # /health names them now
        self.source.set_state("degraded", f"recovering: {why}"
                              + (f"; lost {', '.join(drop)}" if drop else ""), phase="replacing")
        drop += [h for h in self._doctor([n for n in names if n not in drop]) if h != front]
        drop = list(dict.fromkeys(drop))
        said = f"; lost {', '.join(drop)}" if drop else "; no host lost"
        print(f"serve --survive: {why}{said}", file=sys.stderr, flush=True)
        self.evidence = [ln for h in drop for ln in evidence(lines, h, pairs)[:2]]
        self.lost += [h for h in drop if h not in self.lost]
        self.readmits.lost(drop, time.monotonic())
        beat, self.beat = self.beat, next_beat(self.beat, self.args.survive_heartbeat,
                                               bool(drop), [why, *lines[-50:]])
        if self.beat != beat:
            print(f"serve --survive: the next job's heartbeat: {self.beat:g} s (no host was "
                  "lost; its ranks were likely starved of CPU)", file=sys.stderr, flush=True)
        self.hosts = [h for h in self.hosts if h.name not in drop]
        self.source.set_state("degraded", f"recovering: {why}{said}", phase="replacing")
        return drop

    def _doctor(self, names: list[str]) -> list[str]:
        """The hosts among ``names`` that ``launch doctor``'s checks fail (ssh, Python,
        every cable to the others); local hosts are not checked."""
        import shlex

        from hpcmac.launch import doctor
        from hpcmac.launch.convert import is_local
        from hpcmac.launch.hostfile import parse
        from hpcmac.llm.survive.replace import survivors_hostfile

        remote = [n for n in names if not is_local(self.ssh[n])]
        if not remote:
            return []
        hf = parse(survivors_hostfile(self.data, names), "<survivors>")
        ssh = [self.args.agent] if self.args.agent else \
            shlex.split("ssh -o BatchMode=yes -o ConnectTimeout=5")
        python = doctor.python_paths(hf)
        # doctor's own 30 s (10 s ran out at load 20: a probe starts a Python on each host)
        reports = doctor.collect(hf, ssh, python, timeout=30)
        checks = doctor.evaluate(hf, reports, python)
        bad = {c.host for c in checks if not c.ok and c.item in ("ssh", "python")}
        links = [c for c in checks if c.item.startswith("link")]
        pinged = [text for rep in reports.values() if isinstance(rep, dict)
                  for key, text in rep.items() if key.startswith("ping ")]
        if any("not found" not in text for text in pinged):  # else no ping tool: no verdict
            for n in names:
                mine = [c for c in links if c.host == n]
                if mine and all(not c.ok for c in mine):
                    bad.add(n)  # no cable of this host answers, others' do
        return [n for n in remote if n in bad]

    def _stop_job(self, job: Job, conn) -> None:
        """The front stops: ask rank 0 to stop the pipeline, then end the group."""
        from hpcmac.llm.survive.channel import Closed

        try:
            conn.send({"op": "stop"})
        except Closed:
            pass
        try:
            job.proc.wait(3)
        except subprocess.TimeoutExpired:
            pass
        job.end(grace=1.0)
        conn.close()


def run_survive(args, argv: list[str]) -> int:
    """``serve --survive``: the front (see the module doc)."""
    from hpcmac.errors import world_size
    from hpcmac.llm.args import context_length
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.tokenizer import load_tokenizer
    from hpcmac.llm.ops import Ops
    from hpcmac.llm.server import (
        HttpThread,
        api_key_of,
        bind,
        build_app,
        check_serve_args,
        cors_of,
        serve_config,
    )
    from hpcmac.llm.survive.front import FrontSource

    if world_size() > 1:
        raise UsageError("--survive starts the MPI job itself: run it without mpirun, on "
                         "the hostfile's first host")
    if not args.hostfile:
        raise UsageError("--survive needs --hostfile (the hosts to serve on and fall back to)")
    if args.survive_heartbeat <= 0 or args.survive_start_timeout <= 0:
        raise UsageError("--survive-heartbeat and --survive-start-timeout: expected seconds > 0")
    if args.readmit_after is not None and not args.readmit_after > 0:
        raise UsageError(f"--readmit-after {args.readmit_after:g}: expected seconds > 0")
    check_serve_args(args)
    cfg = load_config(args.model)
    context = context_length(args, cfg)
    slots = args.max_batch or 16
    sock = bind(args.host, args.port)
    scfg = serve_config(args, cfg, load_tokenizer(args.model), context)
    name = scfg.model_id
    source = FrontSource(capacity=slots + args.queue)
    sup = Supervisor(args, argv, source, cfg, context, slots)
    source.on_readmit = sup.request_readmit
    source.lost_hosts = lambda: list(sup.lost)
    alive = threading.Event()
    http = HttpThread(build_app(scfg, source, alive, Ops(api_key=api_key_of(args),
                                                         cors=cors_of(args), slots=slots)),
                      sock)
    http.start()
    alive.set()
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (survive front; the job "
          f"over {args.hostfile})", file=sys.stderr, flush=True)

    def stop(signum, frame):
        sup.stop.set()

    # SIGHUP too (its terminal closed): its default ends the front with no cleanup
    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        sup.run()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        source.fail_all("the server stopped")
        http.stop()
        sup.listener.close()
        import shutil

        shutil.rmtree(sup.work, ignore_errors=True)
    return 0
