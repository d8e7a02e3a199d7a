"""The tensor group's shared-memory all-reduce (llm/parallel/shmsum.py) == its MPI one.

Every rank's part is random; the sum through the shared mapping must be the
same bits as through MPI and as the parts added in rank order, call after call
(the two slots alternate), for decode-sized, prefill-sized and oversized
arrays (the last go through MPI), and the mapping's file must be gone.
"""

from __future__ import annotations

import glob
import socket

import numpy as np
import pytest

from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_shm_sum_equals_mpi_sum():
    from hpcmac.llm.parallel import shmsum
    from hpcmac.llm.parallel.tensor import TensorGroup

    g = world()
    hosts = g.allgather_obj(socket.gethostname())
    if g.size == 1 or not shmsum.eligible(hosts):
        pytest.skip("one rank, several hosts or not x86-64: the group sums through MPI")
    tg = TensorGroup(g, hosts, 30.0)
    parallel_assert(tg.shm is not None, "the group mapped its shared memory")
    parallel_assert(not glob.glob("/dev/shm/hpcmac-tp-*"), "the mapping's file is unlinked")
    shm = tg.shm
    rng = np.random.default_rng(100 + g.rank)
    big = shmsum.MAX_BYTES // 4 + 1  # one float over: through MPI
    shapes = [(1, 1024), (3, 40), (16, 1024), (1, big), (2, 7)] * 7
    for i, shape in enumerate(shapes):
        a = rng.standard_normal(shape, dtype=np.float32) * (1 + i)
        parts = g.allgather_obj(a)
        want = parts[0] + parts[1]
        for p in parts[2:]:
            want += p
        got = tg.allreduce(a)
        tg.shm = None  # the same call through MPI (collective: every rank switches)
        via_mpi = tg.allreduce(a)
        tg.shm = shm
        parallel_assert(got.shape == shape and got.dtype == np.float32, f"call {i}: shape")
        parallel_assert(np.array_equal(got, want), f"call {i} {shape}: rank-order sum")
        parallel_assert(np.array_equal(got, via_mpi), f"call {i} {shape}: same bits as MPI")
    # decode-sized calls went through the mapping (7 rounds x 4 shapes), the rest through MPI
    parallel_assert(shm.s == 28, f"shared-memory reductions: {shm.s}")


def test_shm_sum_sleeps_in_the_kernel_for_a_late_peer(monkeypatch):
    """On Linux a rank whose peer is late sleeps on the peer's sequence word and is
    woken by its publish: the sums are still right, and the sleeps were woken."""
    import time

    from hpcmac.llm.parallel import shmsum
    from hpcmac.llm.parallel.tensor import TensorGroup

    g = world()
    hosts = g.allgather_obj(socket.gethostname())
    if g.size == 1 or not shmsum.eligible(hosts):
        pytest.skip("one rank, several hosts or not x86-64: the group sums through MPI")
    monkeypatch.setenv("HPCMAC_PIPELINE_SPIN", "1e-4")  # a 0.1 ms poll budget, then sleep
    tg = TensorGroup(g, hosts, 30.0)
    shm = tg.shm
    parallel_assert(shm is not None, "the group mapped its shared memory")
    on = g.allgather_obj(shmsum.futex_available())
    if not all(on):
        parallel_assert(shm.futex is None, "no futex unless every rank has one")
        pytest.skip("no futex here (macOS, or HPCMAC_TP_FUTEX=0)")
    parallel_assert(shm.futex is not None, "every rank has a futex: the group uses it")
    late = g.size - 1  # the last rank is 10 ms late for every other reduction
    for i in range(6):
        a = np.full((1, 1024), float(g.rank + 1 + i), dtype=np.float32)
        if g.rank == late and i % 2 == 0:
            time.sleep(0.01)
        got = tg.allreduce(a)
        want = sum(float(r + 1 + i) for r in range(g.size))
        parallel_assert(np.all(got == want), f"call {i}: the sum")
    slept, ran_out, _ = shm.counts
    if g.rank != late:  # 10 ms is far past the budget: the others slept, and were woken
        # (a sleep that ran to its 50 ms end is taken again; a lost wake would leave
        # only those: a peer descheduled that long on a crowded host, seldom)
        assert slept - ran_out >= 3, f"rank {g.rank}: {slept} sleeps, {ran_out} ran out"
    woke = g.allgather_obj(shm.counts[2])
    parallel_assert(woke[late] >= 3, f"the late rank woke its peers: {woke}")


def test_followers_wait_on_the_leaders_doorbell(monkeypatch):
    """The leader's steps ring the mapping's doorbell once posted; a follower past its poll
    budget sleeps on it and is woken. A step with a message too big to go eagerly (a
    prefill's hidden states) is rung before its sends complete: no deadlock."""
    import time

    from hpcmac.llm.parallel import shmsum
    from hpcmac.llm.parallel.tags import TAG_STEP
    from hpcmac.llm.parallel.tensor import PING, TensorGroup

    g = world()
    hosts = g.allgather_obj(socket.gethostname())
    if g.size == 1 or not shmsum.eligible(hosts):
        pytest.skip("one rank, several hosts or not x86-64: the group sends through MPI")
    monkeypatch.setenv("HPCMAC_PIPELINE_SPIN", "1e-4")  # a 0.1 ms poll budget, then sleep
    tg = TensorGroup(g, hosts, 30.0)
    shm = tg.shm
    parallel_assert(shm is not None, "the group mapped its shared memory")
    big = np.arange(1 << 18, dtype=np.float32)  # 1 MB: past any eager limit
    for i in range(6):
        payload = big + i
        if g.rank == 0:
            time.sleep(0.01)  # the followers are past their budget: asleep, if futex
            tg._send_all([np.array([PING, i, 0, 0], dtype=np.int32), payload])
            continue
        tg.wait_step(0.0)
        hdr = tg._recv(np.empty(4, dtype=np.int32), TAG_STEP, 0, "to send a step")
        got = tg._recv(np.empty_like(big), TAG_STEP, 0, "to send a step")
        assert int(hdr[1]) == i and np.array_equal(got, payload), f"step {i}"
    rings = g.allgather_obj(shm.rings)
    parallel_assert(rings == [6] * g.size, f"every step rung and taken once: {rings}")
    if shm.futex is not None:
        slept, ran_out, woke = shm.counts
        if g.rank != 0:  # woken by the leader, not by the end of a 50 ms slice
            assert slept - ran_out >= 3, f"rank {g.rank}: {slept} sleeps, {ran_out} ran out"
        parallel_assert(g.allgather_obj(woke)[0] >= 3, "the leader woke its followers")
