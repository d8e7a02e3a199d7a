"""The tensor group's kernel-side wait (llm/parallel/shmsum.py's Futex): two processes.

A parent sleeps on a word of a shared mapping; a child, once it sees the parent's
waiter flag, changes the word and wakes it. Every sleep has a timeout and every
child is joined with one, so a lost wake fails the test instead of hanging it.
"""

from __future__ import annotations

import mmap
import multiprocessing
import time

import numpy as np
import pytest

from hpcmac.llm.parallel import shmsum

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shmsum.futex_available(), reason="futex: Linux on x86-64 only"),
]


def _waker(mm: mmap.mmap, delay: float, out) -> None:
    """Child: wait for the parent's flag, let it fall asleep, publish, wake."""
    seq, flag = (np.frombuffer(mm, dtype=np.int64, count=1),
                 np.frombuffer(mm, dtype=np.int32, count=1, offset=8))
    t0 = time.monotonic()
    while not flag[0]:
        if time.monotonic() - t0 > 20:
            out.put(("no flag", -1))
            return
        time.sleep(1e-4)
    time.sleep(delay)
    seq[0] = 1
    flag[0] = 0
    out.put(("woke", shmsum.Futex().wake(seq.ctypes.data)))


def _fork():
    try:
        return multiprocessing.get_context("fork")
    except ValueError:
        pytest.skip("no fork start method")


def test_wait_returns_when_the_peer_wakes_it():
    ctx = _fork()
    mm = mmap.mmap(-1, 64)  # anonymous and shared: the child sees the same page
    seq, flag = (np.frombuffer(mm, dtype=np.int64, count=1),
                 np.frombuffer(mm, dtype=np.int32, count=1, offset=8))
    out = ctx.Queue()
    child = ctx.Process(target=_waker, args=(mm, 0.2, out))
    child.start()
    try:
        fx = shmsum.Futex()
        t0 = time.monotonic()
        flag[0] = 1
        woken = fx.wait(seq.ctypes.data, 0, 10.0)
        while woken and seq[0] == 0 and time.monotonic() - t0 < 10:  # a spurious return
            woken = fx.wait(seq.ctypes.data, 0, 10.0)
        took = time.monotonic() - t0
        what, n = out.get(timeout=20)
    finally:
        child.join(timeout=20)
        if child.is_alive():
            child.kill()
    assert what == "woke"
    assert woken and seq[0] == 1, "the parent came back only once the word changed"
    # it slept through the child's 0.2 s delay and came back at the wake, not the timeout
    assert 0.15 < took < 5.0, took
    assert n == 1, f"the wake found {n} sleepers, expected the parent"


def test_wait_on_a_changed_word_returns_at_once_and_a_silent_peer_times_out():
    mm = mmap.mmap(-1, 64)
    seq = np.frombuffer(mm, dtype=np.int64, count=1)
    fx = shmsum.Futex()
    seq[0] = 7
    t0 = time.monotonic()
    assert fx.wait(seq.ctypes.data, 6, 5.0)  # the word is no longer 6: EAGAIN
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert not fx.wait(seq.ctypes.data, 7, 0.1)  # nobody wakes it: the timeout
    assert 0.08 < time.monotonic() - t0 < 3.0
    assert fx.wake(seq.ctypes.data) == 0  # no sleeper left


def test_futex_off_by_environment(monkeypatch):
    monkeypatch.setenv("HPCMAC_TP_FUTEX", "0")
    assert not shmsum.futex_available()
