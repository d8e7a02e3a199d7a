"""``serve --survive``: the front outside the MPI job, re-placement and resume.

The pure parts (which host the log blames, the survivors' hostfile and
placement, the resume message, the sampler's resumed draws) without MPI; then
one real front over a local ``mpirun -np 2`` whose rank 1 is killed mid-stream:
every concurrent greedy stream (the ``openai`` client) completes with the text
of the fault-free run, a seeded sampled stream too, /health counts the
recovery, and SIGTERM to the front leaves nothing running.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hpcmac.errors import UsageError
from hpcmac.llm.model.sampling import Sampler, SamplingParams
from hpcmac.llm.parallel.live import LiveRequest
from hpcmac.llm.parallel.placement import LayoutFlags
from hpcmac.llm.parallel.plan import HostMemory
from hpcmac.llm.survive.front import Held, resume_message
from hpcmac.llm.survive.replace import (
    candidates,
    evidence,
    lost_hosts,
    replace_on,
    survivors_hostfile,
)
from hpcmac.llm.survive.supervisor import job_flags

ROOT = Path(__file__).resolve().parents[2]
MESH = ROOT / "hostfiles" / "mesh-4.json"
HOSTS = [("mac1", "mac1.local"), ("mac2", "mac2.local"), ("mac3", "mac3.local"),
         ("mac4", "mac4.local")]


# -- pure ----------------------------------------------------------------------------------

def test_the_log_names_the_lost_host():
    killed = ["prterun noticed that process rank 2 with PID 4711 on node mac3.local exited on",
              "signal 9 (Killed)."]
    assert lost_hosts(killed, HOSTS) == ["mac3"]
    # a blackholed host: every peer names it, it names each of them once
    beat = [f"error: rank {r} (mac{r + 1}.local): no heartbeat from rank 3 (mac4.local) for "
            "8 s: the link between them or that host is down" for r in range(3)]
    beat.append("error: rank 3 (mac4.local): no heartbeat from rank 0 (mac1.local) for 8 s")
    assert lost_hosts(beat, HOSTS) == ["mac4"]
    assert evidence(beat, "mac4", HOSTS) == [ln.strip() for ln in beat[:3]]
    watch = ["error: rank 0 on mac1.local waited 5 s for rank 1 on mac2.local to send back "
             "tokens; it is gone"]
    assert lost_hosts(watch, HOSTS) == ["mac2"]
    peer = ["  Local host: mac4", "  Local PID:  25289", "  Peer host:  mac3",
            "prterun has exited due to process rank 3 with PID 25289 on node mac4 calling"]
    assert lost_hosts(peer, HOSTS) == ["mac3"]
    assert lost_hosts(["error: something else on mac9"], HOSTS) == []


def test_survivors_hostfile_keeps_the_links_between_survivors():
    from hpcmac.launch.hostfile import parse

    data = json.loads(MESH.read_text())
    sub = survivors_hostfile(data, ["mac1", "mac2", "mac4"])
    hf = parse(sub, "<sub>")  # a valid hostfile: a full mesh of three
    assert hf.names == ["mac1", "mac2", "mac4"]
    assert len(hf.links) == 3 and hf.link_between("mac1", "mac3") is None
    assert len(data["hosts"]) == 4  # the original is untouched


def test_candidates_keep_the_tensor_width_then_fall_back_to_a_pipeline():
    assert candidates(4, LayoutFlags(2, 2)) == [(4, LayoutFlags(2, 2)), (4, LayoutFlags(1, 4))]
    assert candidates(3, LayoutFlags(2, 2)) == [(2, LayoutFlags(2, 1)), (3, LayoutFlags(1, 3))]
    assert candidates(3, LayoutFlags()) == [(3, LayoutFlags()), (3, LayoutFlags(1, 3))]
    assert candidates(1, LayoutFlags(2, 2)) == [(1, LayoutFlags(1, 1))]


class _Sizes:
    """Every layer 1 GiB, the embedding and head 1 GiB each (no checkpoint needed)."""

    def whole(self):
        return [2**30] * 8, 2**30, 2**30

    def stage(self, start, end, first, last, shard=None):
        return (end - start + first + last) * 2**30


def test_replace_on_the_survivors_or_say_what_is_missing():
    from hpcmac.llm.model.config import ModelConfig

    cfg = ModelConfig(arch="llama", n_layers=8, hidden=64, vocab=1000, n_heads=64,
                      n_kv_heads=8, head_dim=8, intermediate=300)
    hosts = [HostMemory(f"mac{i}", 1, 6.0) for i in (1, 2, 4)]
    pl, fl, names = replace_on(cfg, _Sizes(), hosts, LayoutFlags(), kv_tokens=0,
                               sequences=1, avail=0)
    assert (pl.tp, pl.pp, names) == (1, 3, ["mac1", "mac2", "mac4"])
    with pytest.raises(UsageError) as e:
        replace_on(cfg, _Sizes(), hosts[:1], LayoutFlags(), kv_tokens=0, sequences=1,
                   avail=0, lost=["mac2", "mac4"])
    msg = str(e.value)
    assert "does not fit the 1 host(s) left after losing mac2, mac4" in msg
    assert "mac1" in msg and "GiB" in msg


def test_the_resume_message_carries_the_tokens_so_far_and_the_draws():
    req = LiveRequest(prompt=[5, 6, 7], max_tokens=10,
                      sampling=SamplingParams(temperature=0.7, seed=9), eos_ids=(2,),
                      stops=("\n\n",))
    msg = resume_message(3, Held(req, toks=[11, 12]))
    assert msg["prompt"] == [5, 6, 7, 11, 12] and msg["prior"] == 2
    assert msg["max_tokens"] == 8 and msg["sampling"]["draws"] == 2
    assert msg["sampling"]["seed"] == 9 and msg["stops"] == ["\n\n"] and msg["key"] == 3


def test_a_resumed_sampler_draws_what_the_whole_stream_would():
    logits = np.random.default_rng(1).normal(size=(30, 200)) * 3
    params = dict(temperature=0.8, top_k=40, top_p=0.9, seed=3)
    whole = Sampler(SamplingParams(**params))
    ref = [whole(row) for row in logits]
    tail = Sampler(SamplingParams(**params, draws=17))
    assert [tail(row) for row in logits[17:]] == ref[17:]
    with pytest.raises(UsageError):
        SamplingParams(draws=-1).validate()


class _Conn:
    """A channel end that records what the front sends."""

    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


def _req(events, **kw):
    return LiveRequest(prompt=[1, 2], max_tokens=5, eos_ids=(0,),
                       on_token=lambda t: events.append(("tok", t)),
                       on_finish=lambda r, n: events.append(("end", r, n)), **kw)


def test_the_front_keeps_requests_across_jobs_and_resumes_them():
    from hpcmac.llm.parallel.live import Full
    from hpcmac.llm.survive.front import FrontSource

    src, ev = FrontSource(capacity=2), []
    assert src.health()[1] == 503  # starting: no job yet
    key = src.submit(_req(ev))  # queued while no job runs
    assert src.submit(_req(ev, sampling=SamplingParams(seed=5))) == key + 1
    with pytest.raises(Full):
        src.submit(_req(ev))
    a = _Conn()
    src.attach(a, {"placement": "pipeline: 2 stages", "hosts": ["h1", "h2"], "ranks": 2})
    src.set_state("ok")
    assert [m["op"] for m in a.sent] == ["submit", "submit"]
    seeds = [m["sampling"]["seed"] for m in a.sent]
    assert seeds[1] == 5 and isinstance(seeds[0], int)  # a seed was chosen: resumable
    src.on_message({"op": "tok", "key": key, "tok": 7})
    src.on_message({"op": "tok", "key": key, "tok": 8})
    src.detach()
    src.set_state("degraded", "recovering: the job ended; lost h2")
    body, code = src.health()
    assert code == 200 and body["status"] == "degraded" and "h2" in body["reason"]
    src.cancel(key + 1)  # a client leaves while no job runs: it ends now
    b = _Conn()
    assert src.attach(b, {}) == 1  # one stream had tokens: resumed
    (m,) = b.sent
    assert m["prompt"] == [1, 2, 7, 8] and m["max_tokens"] == 3 and m["prior"] == 2
    assert m["sampling"]["seed"] == seeds[0]
    src.on_message({"op": "tok", "key": key, "tok": 0})
    src.on_message({"op": "end", "key": key, "reason": "eos"})
    assert ev == [("tok", 7), ("tok", 8), ("end", "cancelled", 0), ("tok", 0), ("end", "eos", 3)]
    # a stream whose EOS came back but not its end, when the job was lost: ended, not resumed
    k2 = src.submit(_req(ev))
    src.on_message({"op": "tok", "key": k2, "tok": 0})
    src.detach()
    c = _Conn()
    assert src.attach(c, {}) == 0 and c.sent == [] and ev[-1] == ("end", "eos", 1)
    src.submit(_req(ev))
    src.refuse("the model does not fit the 1 host(s) left")
    assert ev[-1] == ("end", "error", 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        src.submit(_req(ev))
    body, code = src.health()
    assert code == 503 and body["status"] == "error" and "does not fit" in body["error"]


def test_a_recovery_says_its_phase_and_names_the_lost_host():
    from hpcmac.llm.survive.front import PHASES, FrontSource

    src, ev, out = FrontSource(capacity=4), [], ["mac3"]
    src.lost_hosts = lambda: list(out)
    src.attach(_Conn(), {})
    src.serving("ok", "")
    k1, k2 = src.submit(_req(ev)), src.submit(_req(ev))
    src.on_message({"op": "tok", "key": k1, "tok": 7})  # k2 has streamed nothing yet
    src.detach()
    src.set_state("degraded", "recovering: the job ended (exit 137)", phase="detecting")
    body, code = src.health()
    assert code == 200 and body["phase"] == "detecting" and body["lost"] == ["mac3"]
    for phase in PHASES[1:4]:
        src.set_phase(phase)
        assert src.health()[0]["phase"] == phase
    src.attach(_Conn(), {})  # k1 is re-prefilled; k2 is a plain first prefill
    src.serving("degraded", "serving without mac3 (lost); on mac1, mac2")
    body = src.health()[0]
    assert body["phase"] == "re-prefilling" and "re-prefilling 1 stream" in body["reason"]
    src.on_message({"op": "tok", "key": k2, "tok": 8})
    assert src.health()[0]["phase"] == "re-prefilling"
    src.on_message({"op": "tok", "key": k1, "tok": 9})  # every resumed stream is back
    body = src.health()[0]
    assert "phase" not in body and body["reason"].startswith("serving without mac3")
    out.clear()
    src.set_state("ok")
    assert "lost" not in src.health()[0]


def test_the_lost_host_is_read_from_the_lines_before_the_front_ends_the_job():
    """What ranks print once the front has signalled the job names the ranks the
    front ended, not the lost host: only the lines before count (the launcher given a
    moment to report the fault and exit by itself)."""
    from hpcmac.llm.survive.supervisor import Job

    said = "process rank 1 with PID 5 on node mac2.local exited on signal 9 (Killed)."
    done = Job(["sh", "-c", f"echo '{said}' >&2; exit 1"], dict(os.environ))
    t0 = time.monotonic()
    assert done.own_lines(5) == [said] and time.monotonic() - t0 < 4  # it exited: no wait
    assert lost_hosts([said], HOSTS) == ["mac2"]
    after = "prterun noticed that process rank 3 with PID 7 on node mac4.local exited on"
    job = Job(["sh", "-c", f"trap 'echo \"{after}\" >&2; exit 1' TERM; echo up >&2; "
               "while :; do sleep 0.1; done"], dict(os.environ))
    time.sleep(0.5)
    before = job.own_lines(0.3)  # still running after the grace
    job.end(grace=2)
    assert before == ["up"] and list(job.lines)[0] == "up" and after in job.lines
    assert lost_hosts(before, HOSTS) == [] and lost_hosts(list(job.lines), HOSTS) == ["mac4"]


def test_no_fit_is_not_the_end_a_readmitted_host_makes_it_fit_again(tmp_path, monkeypatch):
    """Three of four hosts lost (the heavy-load doctor of a tally once dropped them
    all): nothing fits mac1 alone, 503s; --readmit-after takes back those doctor
    passes (in its thread), and the model is placed on them again."""
    import shutil
    import threading
    from types import SimpleNamespace

    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.survive.front import FrontSource
    from hpcmac.llm.survive.supervisor import Supervisor

    data = json.loads(MESH.read_text())
    for h in data["hosts"]:
        h["memory_gb"] = 0.15  # smollm2 fits two hosts, not one
    hostfile = tmp_path / "mesh.json"
    hostfile.write_text(json.dumps(data))
    args = SimpleNamespace(hostfile=str(hostfile), model="smollm2", quantize=None,
                           q_group_size=64, tp=2, pp=2, tp_split=None, split=None,
                           readmit_after=0.3, agent=None, survive_heartbeat=4.0,
                           survive_start_timeout=10.0)
    sup = Supervisor(args, [], FrontSource(capacity=4), load_config("smollm2"), 256, 8)
    try:
        sup.lost, sup.hosts = ["mac2", "mac3", "mac4"], sup.hosts[:1]
        sup.readmits.lost(sup.lost, time.monotonic())
        with pytest.raises(UsageError, match="does not fit the 1 host"):
            sup._place()
        checked = []

        def doctor(names):  # mac3 is still down
            checked.append(sorted(names))
            return [n for n in names if n == "mac3"]

        monkeypatch.setattr(sup, "_doctor", doctor)
        threading.Timer(20, sup.stop.set).start()  # never hang the suite
        t0 = time.monotonic()
        assert sup._wait_readmit() and time.monotonic() - t0 >= 0.2
        assert checked[0] == ["mac1", "mac2", "mac3", "mac4"]
        assert sup.lost == ["mac3"] and [h.name for h in sup.hosts] == ["mac1", "mac2", "mac4"]
        placement, _, names = sup._place()
        assert (placement.tp, names) == (2, ["mac1", "mac2"])
    finally:
        sup.stop.set()
        sup.listener.close()
        shutil.rmtree(sup.work, ignore_errors=True)


def test_a_heartbeat_that_ran_out_with_no_host_lost_doubles_the_next_jobs():
    from hpcmac.llm.survive.supervisor import next_beat

    starved = ["error: rank 1 (mac3.local): no heartbeat from rank 0 (mac1.local) for 5 s: "
               "the link between them or that host is down (HPCMAC_HEARTBEAT_TIMEOUT=4)"]
    assert next_beat(4, 4, False, starved) == 8
    assert next_beat(8, 4, False, starved) == 16 and next_beat(16, 4, False, starved) == 16
    assert next_beat(8, 4, False, ["rank 0 sent nothing for 8 s"]) == 16
    assert next_beat(8, 4, False, ["rank 0 closed the channel"]) == 8  # no heartbeat ran out
    assert next_beat(16, 4, True, starved) == 4  # a host was dropped: the set seconds


def test_readmit_after_checks_a_lost_host_after_s_and_again_after_a_failure():
    from hpcmac.llm.survive.readmit import Readmits

    r = Readmits(after=5.0)
    r.lost(["mac3"], now=100.0)
    assert r.due(104.9) == [] and r.due(105.0) == ["mac3"]
    assert r.checked(["mac3"], bad=["mac3"], now=106.0) == []  # doctor fails it
    assert r.due(110.9) == [] and r.due(111.0) == ["mac3"]  # S more seconds
    r.lost(["mac2"], now=108.0)
    assert r.due(111.0) == ["mac3"]
    assert r.checked(["mac3"], bad=[], now=111.0) == ["mac3"]  # back: no longer due
    assert r.due(200.0) == ["mac2"]
    by_hand = Readmits()  # no policy: only what is asked, checked once per ask
    by_hand.lost(["mac2"], now=0.0)
    assert by_hand.due(1e9) == []
    by_hand.ask("mac2")
    assert by_hand.due(1.0) == ["mac2"]
    assert by_hand.checked(["mac2"], bad=["mac2"], now=1.0) == [] and by_hand.due(2.0) == []
    by_hand.ask("mac2")
    assert by_hand.checked(["mac2"], bad=[], now=3.0) == ["mac2"]


def test_the_survive_front_honours_the_api_key_and_keeps_health_open():
    pytest.importorskip("starlette")
    import threading

    from starlette.testclient import TestClient

    from hpcmac.llm.ops import Ops
    from hpcmac.llm.request import ServeConfig
    from hpcmac.llm.server import build_app
    from hpcmac.llm.survive.front import FrontSource

    asked = []

    def on_readmit(host):
        asked.append(host)
        return {"status": "accepted", "host": host}, 202

    def app(key):
        src = FrontSource(capacity=2)
        src.on_readmit = on_readmit
        return TestClient(build_app(ServeConfig("m", None, 100, 64, (0,)), src,
                                    threading.Event(), Ops(api_key=key)))

    keyed = app("sekrit")
    assert keyed.get("/health").status_code == 503  # open (503: the first job is starting)
    assert keyed.get("/v1/models").status_code == 401
    assert keyed.post("/admin/hosts/mac3/readmit").status_code == 401 and asked == []
    wrong = {"Authorization": "Bearer nope"}
    assert keyed.post("/admin/hosts/mac3/readmit", headers=wrong).status_code == 401
    # with the key, any client may ask (TestClient's address is not this machine's)
    r = keyed.post("/admin/hosts/mac3/readmit", headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 202 and asked == ["mac3"]
    r = keyed.post("/admin/hosts/mac2/readmit", headers={"x-api-key": "sekrit"})
    assert r.status_code == 202 and asked == ["mac3", "mac2"]
    # without a key: this machine's clients only
    r = app(None).post("/admin/hosts/mac3/readmit")
    assert r.status_code == 403 and "this machine" in r.json()["error"]["message"]
    assert asked == ["mac3", "mac2"]


def test_job_flags_drop_what_the_front_keeps():
    argv = ["--survive", "--hostfile", "h.json", "--model", "m", "--port=9", "--tp", "2",
            "--pp", "2", "--agent", "a", "--max-batch", "4", "--survive-heartbeat", "3",
            "--readmit-after", "30", "--api-key", "sekrit", "--cors=*"]
    # the key never reaches a rank's command line (ps on every host); no rank serves HTTP
    assert job_flags(argv) == ["--model", "m", "--max-batch", "4"]


@pytest.mark.parametrize("flags, says", [
    ([], "--survive needs --hostfile"),
    (["--hostfile", "none.json", "--readmit-after", "0"],
     "--readmit-after 0: expected seconds > 0"),
])
def test_survive_flags_are_checked_before_anything_starts(flags, says):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "hpcmac.llm", "serve", "--survive", "--model",
                        "smollm2", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# -- one real front over a local mpirun ------------------------------------------------------

@pytest.mark.serial  # it times the front's end after SIGTERM: alone, not beside the workers
def test_a_killed_rank_pauses_the_streams_and_they_finish_as_without_it(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("starlette")
    sys.path.insert(0, str(Path(__file__).parent))
    import httpx
    from survive_front import PROMPTS, Front, rank_pids

    hostfile = tmp_path / "local.json"
    hostfile.write_text(json.dumps({"hosts": [{"name": "localhost", "ssh": "localhost",
                                               "slots": 2}]}))
    f = Front(str(hostfile), "--max-batch", "4", "--survive-heartbeat", "5")
    try:
        prompts, n = PROMPTS[:3], 24
        ref = f.streams(prompts, n)
        sampled = dict(temperature=0.9, seed=7)
        ref_sampled = f.stream(PROMPTS[3], n, **sampled)
        assert all(isinstance(t, str) and t for t in ref), ref
        before = rank_pids(f.tag)
        assert set(before) == {0, 1}
        killed = []

        def kill(k):
            if k == 6 and not killed:
                killed.append(time.monotonic())
                os.kill(before[1], signal.SIGKILL)

        t0 = time.monotonic()
        got = f.streams(prompts, n, on_piece=kill)
        assert killed, "the stream ended before the kill"
        assert got == ref  # no client error, the fault-free text
        code, body = f.health()
        rec = body["recoveries"]
        assert code == 200 and body["status"] == "ok"
        assert rec["count"] == 1 and rec["resumed_requests"] >= 1, body
        last = rec["last"]
        assert last["reload_s"] > 0 and last["gb"] > 0
        # whichever came first: mpirun's exit, or rank 0 failing on the dead peer's socket
        assert last["why"].startswith("the job ended (exit ") or \
            last["why"] == "rank 0 closed the channel", last
        print(f"recovery: {last['seconds']:.2f} s (reload {last['reload_s']:.2f} s, "
              f"{last['reload_s_per_gb']:.1f} s/GiB); streams done "
              f"{time.monotonic() - t0:.1f} s after they began")
        if importlib.util.find_spec("prometheus_client"):  # /metrics counts it too
            text = httpx.get(f.url + "/metrics", timeout=10).text
            assert "hpcmac_recoveries_total 1.0" in text and "hpcmac_degraded 0.0" in text
        after = rank_pids(f.tag)
        assert set(after) == {0, 1} and not set(after.values()) & set(before.values())
        # a seeded sampled stream keeps its draws across a kill too
        killed.clear()
        before = after
        assert f.stream(PROMPTS[3], n, on_piece=kill, **sampled) == ref_sampled
        assert f.health()[1]["recoveries"]["count"] == 2
    finally:
        took = f.stop()
    assert took < 5, f"front and ranks took {took:.1f} s to end after SIGTERM"
    assert not rank_pids(f.tag)
    assert f.proc.returncode == 0, f.log()[-2000:]


def test_a_fronts_work_dir_goes_at_exit_and_a_killed_fronts_with_the_next(tmp_path):
    """The front's folder of job hostfiles is removed however it exits in Python (return,
    SystemExit, an exception); one whose front was killed (SIGKILL runs nothing) is removed
    by the next front's sweep, while a live front's and other names stay."""
    import subprocess

    from hpcmac.llm.survive.supervisor import WORK_PREFIX, sweep_work_dirs

    env = dict(os.environ, TMPDIR=str(tmp_path))
    head = ("import sys, time; from hpcmac.llm.survive.supervisor import work_dir; "
            "d = work_dir(); open(d + '/hostfile.json', 'w').close(); print(d, flush=True); ")

    def front(tail: str):
        return subprocess.Popen([sys.executable, "-c", head + tail], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    for tail, rc in [("", 0), ("sys.exit(3)", 3), ("raise RuntimeError('x')", 1)]:
        p = front(tail)
        d = p.stdout.readline().strip()
        assert p.wait(30) == rc and d.startswith(str(tmp_path / WORK_PREFIX))
        assert not os.path.exists(d), tail
    killed, live = front("time.sleep(60)"), front("time.sleep(60)")
    try:
        dead_dir, live_dir = killed.stdout.readline().strip(), live.stdout.readline().strip()
        killed.kill()
        killed.wait(10)
        assert os.path.isdir(dead_dir)  # nothing ran at its SIGKILL
        other = tmp_path / f"{WORK_PREFIX}not-a-front"
        other.mkdir()
        assert sweep_work_dirs(str(tmp_path)) == [dead_dir]
        assert os.path.isdir(live_dir) and other.is_dir()
    finally:
        live.kill()
        live.wait(10)
