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
