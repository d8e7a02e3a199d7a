"""The pipeline's waiting policy and the allocator setting decode relies on."""

from __future__ import annotations

import sys

import pytest

from hpcmac.comm.local import LocalGroup
from hpcmac.llm.parallel.link import Watchdog, _cores


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("HPCMAC_PIPELINE_SPIN", raising=False)


def test_spins_when_each_rank_has_a_core():
    g = LocalGroup()
    assert Watchdog(g, ["a"], timeout=0).spin_s == Watchdog.SPIN_OWN_CORE_S
    # this host runs more ranks than it has cores: spin briefly, then sleep
    crowded = ["a"] * (_cores() + 1)
    assert Watchdog(g, crowded, timeout=0).spin_s == Watchdog.SPIN_SHARED_S
    # ranks on other hosts do not count
    spread = ["a"] + ["b"] * (_cores() + 1)
    assert Watchdog(g, spread, timeout=0).spin_s == Watchdog.SPIN_OWN_CORE_S


def test_spin_override(monkeypatch):
    g = LocalGroup()
    monkeypatch.setenv("HPCMAC_PIPELINE_SPIN", "0.003")
    assert Watchdog(g, ["a"], timeout=0).spin_s == 0.003
    assert Watchdog(g, ["a"], timeout=0, spin=0.0).spin_s == 0.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_allocator_keeps_freed_memory():
    """On glibc the numpy backend makes mid-sized arrays (a step's logits) come from
    the heap, not from a fresh mmap each time (glibc's default above 128 KiB)."""
    import ctypes

    import numpy as np

    from hpcmac.llm.model.backend import get_backend

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    get_backend("numpy")
    before = libc.mallinfo2().hblks
    logits = np.empty((4, 49152), dtype=np.float32)  # 768 KiB
    during = libc.mallinfo2().hblks
    del logits
    assert during == before, "a 768 KiB array was given its own mmap"


def test_bad_wait_settings_are_one_line(monkeypatch):
    from hpcmac.errors import UsageError

    g = LocalGroup()
    monkeypatch.setenv("HPCMAC_PIPELINE_SPIN", "fast")
    with pytest.raises(UsageError, match="HPCMAC_PIPELINE_SPIN='fast': expected seconds"):
        Watchdog(g, ["a"], timeout=0)
    monkeypatch.delenv("HPCMAC_PIPELINE_SPIN")
    monkeypatch.setenv("HPCMAC_PIPELINE_MAX_SLEEP", "-1")
    with pytest.raises(UsageError, match="HPCMAC_PIPELINE_MAX_SLEEP='-1'"):
        Watchdog(g, ["a"], timeout=0)
    monkeypatch.setenv("HPCMAC_PIPELINE_MAX_SLEEP", "0.002")
    assert Watchdog(g, ["a"], timeout=0).max_sleep == 0.002


def test_default_prefill_chunk():
    from hpcmac.llm.parallel.pipeline import default_chunk

    assert default_chunk(10_000, 1) == 512          # one stage: only bounds activations
    assert default_chunk(256, 2) == 32              # 8 chunks for 2 stages
    assert default_chunk(2048, 2) == 256
    assert default_chunk(100, 4) == 32              # never below 32 tokens
    assert default_chunk(100_000, 4) == 512         # nor above 512


def test_a_prompt_alone_takes_the_lone_chunk():
    """serve's scheduler: a prompt with nothing decoding beside it goes in chunks of
    ``lone_chunk`` (each chunk pays every weight once more), one beside a decoding
    stream in ``chunk``s (the stream keeps flowing); a given chunk (lone 0) always."""
    from types import SimpleNamespace as NS

    from hpcmac.llm.parallel.pipeline import LONE_CHUNK, STREAM_CHUNK, _Scheduler

    def seq(n_prompt, fed, total):
        return NS(ready=True, last_mb=0, tokens=[0] * total, fed=fed, n_prompt=n_prompt)

    def form(active, lone):
        plan = NS(micro_batches=1, chunk=STREAM_CHUNK, lone_chunk=lone)
        return [n for _, n in _Scheduler.form(NS(st=NS(plan=plan), active=active, prefix=None))]

    prompt = seq(700, 0, 700)
    assert form([prompt], LONE_CHUNK) == [LONE_CHUNK]
    assert form([prompt, seq(40, 10, 40)], LONE_CHUNK) == [LONE_CHUNK]  # both prefill
    decoding = seq(40, 45, 46)  # its prompt fed, one token to feed
    assert form([decoding, prompt], LONE_CHUNK) == [1, STREAM_CHUNK - 1]
    assert form([prompt], 0) == [STREAM_CHUNK]
