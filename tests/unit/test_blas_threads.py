"""BLAS thread policy (pure) and its application in a real process."""

import os
import subprocess
import sys

import pytest

from hpcmac import blas_threads as bt


def test_ranks_share_the_cores_and_one_rank_gets_all():
    assert bt.choose(None, 1, 32, env={}).threads == 32          # a single rank: every core
    assert bt.choose(None, 4, 32, env={}).threads == 8
    assert bt.choose(None, 2, 2, env={}).threads == 1            # ranks fill the cores
    assert bt.choose(None, 4, 2, env={}).threads == 1            # oversubscribed: still 1
    assert bt.choose(None, 3, 8, env={}).threads == 2


def test_binding_and_user_settings_win():
    c = bt.choose(None, 1, 32, usable=1, env={})                 # bound to one core
    assert c.threads == 1 and "bound to 1 core" in c.reason
    assert bt.choose(3, 4, 32, env={"OMP_NUM_THREADS": "5"}).threads == 3
    c = bt.choose(0, 4, 32, env={})
    assert c.threads is None and "requested 0" in c.reason
    c = bt.choose(None, 4, 32, env={"OPENBLAS_NUM_THREADS": "2"})
    assert c.threads is None and "OPENBLAS_NUM_THREADS=2" in c.reason


def test_requested_from_env():
    assert bt.requested_from_env({}) is None
    assert bt.requested_from_env({"HPCMAC_BLAS_THREADS": "3"}) == 3
    with pytest.raises(ValueError, match="HPCMAC_BLAS_THREADS: expected an integer >= 0"):
        bt.requested_from_env({"HPCMAC_BLAS_THREADS": "two"})


def _threads_after_init(env_extra: dict, start: str = "comm.init('local')") -> list[int]:
    code = (f"from hpcmac import comm; {start}\n"
            "from threadpoolctl import threadpool_info\n"
            "from hpcmac import blas_threads\n"
            "print([p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas'])\n"
            "print(blas_threads.describe())\n")
    env = {k: v for k, v in os.environ.items() if k not in bt.ENV_KEYS + ("HPCMAC_BLAS_THREADS",)}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.splitlines()
    return eval(out[0]), out[1]   # noqa: S307 (our own printed list)


def test_comm_init_applies_the_choice():
    cores = min(os.cpu_count() or 1, len(os.sched_getaffinity(0)))
    threads, line = _threads_after_init({})
    assert threads and all(t == cores for t in threads), (threads, line)
    assert line.startswith(f"{cores} per rank")
    threads, line = _threads_after_init({"HPCMAC_BLAS_THREADS": "1"})
    assert threads == [1] * len(threads) and line == "1 per rank (requested)"


def test_a_lone_command_applies_the_choice():
    """generate and serve on one process without a launcher start no MPI
    (``comm.job_group``), and still take ``HPCMAC_BLAS_THREADS`` (a lone serve once
    skipped it and ran every core's threads: 10.3 s of CPU for 2.1 with one)."""
    threads, line = _threads_after_init({"HPCMAC_BLAS_THREADS": "1"}, start="comm.job_group()")
    assert threads == [1] * len(threads) and line == "1 per rank (requested)"


def test_runtime_run_holds_threads_while_it_runs(monkeypatch):
    """``--threads`` of generate and serve: the rank's BLAS runs that many threads while
    the runtime runs, and its own choice again after (serve once ignored the flag, and
    its 2 OpenBLAS threads spent 10x the CPU of one on a busy 2-core host)."""
    from types import SimpleNamespace

    from threadpoolctl import threadpool_info

    from hpcmac.llm.parallel import runtime

    def blas() -> list[int]:
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

    before = blas()
    want = 1 if max(before) > 1 else 2
    seen = []
    monkeypatch.setattr(runtime, "run_tensor_pipeline", lambda *a, **kw: seen.append(blas()))
    rt = runtime.Runtime(placement=SimpleNamespace(stages=[None]),
                         groups=SimpleNamespace(stage=0), tensor=None, stage=None, hidden=8,
                         timeout=0.0)
    rt.run(None, threads=want)
    assert seen == [[want] * len(before)] and blas() == before
    rt.run(None)
    assert seen[-1] == before
