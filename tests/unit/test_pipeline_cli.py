"""``generate`` under ``tools/mpirun`` (subprocesses): np 3, bad input, dead and hung ranks, Ctrl-C.

The MPI suite runs at np 1, 2 and 4; these run the command line at np 3 and
check what a user sees. The oracle for tokens is part 1's one-rank
:class:`~hpcmac.llm.model.generate.Generator`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIRUN = str(ROOT / "tools" / "mpirun")
PY = sys.executable

pytestmark = pytest.mark.timeout(300)


def env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e["HPCMAC_QUIET_TRANSPORT"] = "1"
    e["HPCMAC_MPIRUN_TIMEOUT"] = "240"
    e.update(extra)
    return e


def generate(np_: int, *args: str, **kw) -> subprocess.CompletedProcess:
    cmd = [MPIRUN, str(np_), PY, "-m", "hpcmac.llm", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=250,
                          cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def llama5(tmp_path_factory):
    from hpcmac.llm.model.fixtures import random_checkpoint

    return str(random_checkpoint("llama", tmp_path_factory.mktemp("ck") / "llama5", seed=4,
                                 num_hidden_layers=5))


@pytest.fixture(scope="module")
def slow_llama(tmp_path_factory):
    """Big enough that a long generation lasts several seconds."""
    from hpcmac.llm.model.fixtures import random_checkpoint

    return str(random_checkpoint("llama", tmp_path_factory.mktemp("ck") / "slow", seed=5,
                                 num_hidden_layers=3, hidden_size=256, intermediate_size=512,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=256, max_position_embeddings=4096,
                                 eos_token_id=None))  # no EOS: runs to --max-tokens


def one_rank(path: str, prompt: list[int], n: int) -> list[int]:
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.generate import Generator
    from hpcmac.llm.model.stage import load_stage

    cfg = load_config(path)
    gen = Generator(load_stage(path, 0, cfg.n_layers, True, True), max_len=len(prompt) + n)
    return gen.generate(prompt, n).tokens


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_np3_batch_matches_each_prompt_alone(llama5, tmp_path):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [40, 41, 42, 43]]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("\n".join(json.dumps({"prompt_ids": p}) for p in prompts) + "\n")
    out = tmp_path / "out.json"
    proc = generate(3, "--model", llama5, "--batch", str(batch), "--max-tokens", "9",
                    "--split", "1,3,1", "--prefill-chunk", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 3 and doc["split"]["layers"] == [1, 3, 1]
    for p, seq in zip(prompts, doc["sequences"]):
        assert seq["prompt_tokens"] == p
        assert seq["tokens"] == one_rank(llama5, p, 9)
    # rank 0 alone prints: one line per sequence
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert [ln.split()[0] for ln in lines] == ["[0]", "[1]", "[2]"], proc.stdout
    assert {"link", "bytes_per_token"} <= set(doc["bytes_per_token"][0])
    assert len(doc["stages"]) == 3 and all(0 < s["busy"] <= 1 for s in doc["stages"])


def test_np3_default_split_single_prompt(llama5, tmp_path):
    out = tmp_path / "out.json"
    proc = generate(3, "--model", llama5, "--prompt-ids", "5,6,7", "--max-tokens", "6",
                    "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["tokens"] == one_rank(llama5, [5, 6, 7], 6)
    assert set(doc) >= {"prompt_tokens", "tokens", "text", "prefill_tok_s", "decode_tok_s"}
    assert proc.stdout.strip() == ",".join(map(str, doc["tokens"]))


def test_more_ranks_than_layers(llama5):
    line = one_error_line(generate(3, "--model", llama5, "--prompt-ids", "1", "--split",
                                   "1,1,1"))
    assert "sums to 3 layers but the model has 5" in line
    from hpcmac.llm.model.fixtures import random_checkpoint

    small = random_checkpoint("qwen2", Path(llama5).parent / "qwen2-3", seed=1)
    line = one_error_line(generate(4, "--model", str(small), "--prompt-ids", "1", "--pp", "4"))
    assert line == ("error: 4 ranks but the model has only 3 layers: run with at most 3 "
                    "ranks (each pipeline stage needs a layer)")


def test_bad_split_and_batch(llama5, tmp_path):
    line = one_error_line(generate(2, "--model", llama5, "--prompt-ids", "1", "--split",
                                   "2,x"))
    assert "--split '2,x'" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1, 2]}\n{"prompt": 3}\n')
    line = one_error_line(generate(2, "--model", llama5, "--batch", str(bad)))
    assert f"{bad} line 2" in line


def test_stage_that_does_not_fit_is_refused(llama5, tmp_path):
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"hosts": [{"name": "localhost", "slots": 2,
                                         "memory_gb": 1e-6}]}))
    line = one_error_line(generate(2, "--model", llama5, "--prompt-ids", "1", "--hostfile",
                                   str(hf), "--pp", "2"))
    assert "stage 0 on " in line and "memory budget is 0.00 GiB" in line


class Job:
    """A running ``generate`` job whose stderr is collected by a thread."""

    def __init__(self, np_: int, *args: str):
        self.mark = uuid.uuid4().hex
        cmd = [MPIRUN, str(np_), PY, "-m", "hpcmac.llm", "generate", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env(HPCMAC_TEST_MARK=self.mark), cwd=ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait_generating(self, timeout: float = 120.0) -> None:
        """Until the ranks are loaded and tokens flow (rank 0 said 'pipeline:' or
        'layout:'), plus 1 s."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if "pipeline:" in self.stderr or "layout:" in self.stderr:
                time.sleep(1.0)
                assert self.proc.poll() is None, f"the job ended early: {self.stderr}"
                return
            time.sleep(0.1)
        raise AssertionError(f"generation did not start: {self.stderr}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.reader.join(5)


def _rank_pid(mark: str, rank: int, wait: float = 60.0) -> int:
    """The pid of ``rank`` of the job carrying ``mark`` in its environment."""
    t0 = time.monotonic()
    want = [f"HPCMAC_TEST_MARK={mark}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()]
    while time.monotonic() - t0 < wait:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                envb = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if all(w in envb for w in want):
                return int(d.name)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} did not start")


def _long_args(path):
    return ("--model", path, "--prompt-ids", "1,2,3", "--max-tokens", "3900")


def _gone(pid: int, wait: float) -> bool:
    """True once ``pid`` has exited (no such process, or a zombie) within ``wait`` s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < wait:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return True
        if "\nState:\tZ" in state:
            return True
        time.sleep(0.1)
    return False


needs_proc = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc")


LAYOUTS = pytest.mark.parametrize("layout", [("--pp", "3"), ("--tp", "3")],
                                  ids=["pipeline", "tensor"])


@pytest.mark.serial  # it times how fast the job ends: alone, not beside the workers' jobs
@needs_proc
@LAYOUTS
def test_killed_rank_ends_the_job_naming_it(slow_llama, layout):
    job = Job(3, *_long_args(slow_llama), *layout)
    pid = _rank_pid(job.mark, 1)
    others = [_rank_pid(job.mark, r) for r in (0, 2)]
    job.wait_generating()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    rc = job.wait(30)
    took = time.monotonic() - t0
    assert rc != 0
    assert took < 5 if layout[0] == "--tp" else took < 10, f"job took {took:.1f} s to end"
    assert "rank 1" in job.stderr and os.uname().nodename in job.stderr, job.stderr
    assert all(_gone(p, 5.0) for p in others), "a rank is still running"


@needs_proc
@LAYOUTS
def test_hung_rank_ends_the_job_naming_it(slow_llama, layout):
    job = Job(3, *_long_args(slow_llama), "--timeout", "3", *layout)
    pid = _rank_pid(job.mark, 1)
    job.wait_generating()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        rc = job.wait(40)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    took = time.monotonic() - t0
    assert rc != 0
    assert took < 20, f"job took {took:.1f} s to end"
    assert f"for rank 1 on {os.uname().nodename}" in job.stderr, job.stderr


@needs_proc
def test_ctrl_c_on_rank0_stops_every_rank(slow_llama, tmp_path):
    out = tmp_path / "partial.json"
    job = Job(2, *_long_args(slow_llama), "--json", str(out))
    pid0 = _rank_pid(job.mark, 0)
    pid1 = _rank_pid(job.mark, 1)
    job.wait_generating()
    t0 = time.monotonic()
    os.kill(pid0, signal.SIGINT)
    rc = job.wait(30)
    assert time.monotonic() - t0 < 10
    assert rc == 130, job.stderr
    assert "interrupted" in job.stderr and "Traceback" not in job.stderr, job.stderr
    assert _gone(pid1, 5.0), "rank 1 is still running"
    doc = json.loads(out.read_text())
    assert doc["interrupted"] and doc["finish_reason"] == "interrupted"
    assert 0 < len(doc["tokens"]) < 3900


@pytest.mark.timeout(900)
def test_parity_suite_at_np3():
    """``make test`` runs tests/mpi at np 1, 2 and 4; the pipeline parity tests also at 3."""
    cmd = [MPIRUN, "3", PY, "-m", "mpi4py", "-m", "hpcmac.testing",
           "tests/mpi/test_pipeline_parity.py", "-q", "-x"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=850,
                          cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "passed" in proc.stdout and "failed" not in proc.stdout


@pytest.mark.parametrize("args, expect", [
    ((), "error: python -m hpcmac.llm generate: one of the arguments --prompt --prompt-ids "
         "--batch is required (see --help)"),
    (("--prompt-ids", "1", "--bogus"),
     "error: python -m hpcmac.llm: unrecognized arguments: --bogus (see --help)"),
    (("--prompt-ids", "1", "--max-tokens", "-1"), "error: --max-tokens -1: expected >= 0"),
    (("--prompt-ids", "1", "--quantize", "4"),
     "error: --quantize 4: needs --backend mlx (the numpy backend keeps float32 weights)"),
])
def test_flag_errors_are_one_line_on_every_rank_count(llama5, args, expect):
    """Refused before MPI starts (argparse, flag checks): still one line, exit 2, and no
    launcher banner (the ranks start MPI only to leave together)."""
    cmd = [MPIRUN, "2", PY, "-m", "hpcmac.llm", "generate", "--model", llama5, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.strip()] == [expect], proc.stderr
    assert proc.stdout == ""


def test_refusals_at_np2_are_one_line_without_the_transport_line(llama5, tmp_path):
    """The transport line waits until the run starts: a refusal found while planning the
    layout, reading the config or checking flags is the only line (issue 32)."""
    cfg = json.loads((Path(llama5) / "config.json").read_text())
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10**9}))
    cases = [
        ((llama5, "--split", "1,5"), "error: --split '1,5' sums to 6 layers"),
        ((llama5, "--tp", "3"), "error: --tp 3: 2 ranks do not split into tensor groups of 3"),
        ((llama5, "--timeout", "0.001"), "error: --timeout 0.001: expected 0 (no watchdog) or "
                                         "at least 1 s"),
        ((llama5, "--seed", "-1"), "error: --seed -1: expected an integer from 0 to 2^63-1"),
        ((str(huge),), f"error: {huge / 'config.json'}: n_layers = {10**9}: expected at most"),
    ]
    for (model, *args), start in cases:
        cmd = [MPIRUN, "2", PY, "-m", "hpcmac.llm", "generate", "--model", model,
               "--prompt-ids", "1,2", "--max-tokens", "2", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env=env(HPCMAC_QUIET_TRANSPORT="0", HPCMAC_MPIRUN_TIMEOUT="90"))
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith(start), (args, lines)


def test_full_disk_at_np2_is_one_line_exit_1(llama5, tmp_path):
    """--json to a full device (mknod'd (1, 7)): rank 0 shares the failure, so every rank
    leaves together with one error line and no MPI_ABORT banner."""
    import stat

    try:
        os.mknod(tmp_path / "full", stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("mknod needs root")
    proc = generate(2, "--model", llama5, "--prompt-ids", "1,2", "--max-tokens", "2",
                    "--quiet", "--json", str(tmp_path / "full"))
    assert proc.returncode == 1, proc.stderr
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error")] == [
        f"error: --json {tmp_path / 'full'}: cannot write: no space left on device"]
    assert "MPI_ABORT" not in proc.stderr and "Traceback" not in proc.stderr
