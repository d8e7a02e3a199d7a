"""The MPI world through hpcmac.comm, at any rank count."""

import numpy as np
import pytest

from hpcmac import comm
from hpcmac.testing import parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_allreduce_sum_of_ranks():
    g = comm.init("mpi")
    out = g.allreduce(np.array([g.rank], dtype=np.int64))
    parallel_assert(out[0] == g.size * (g.size - 1) // 2, f"got {out[0]}", g)


def test_info_runs_on_every_rank(capsys):
    from hpcmac.info import main

    assert main([]) == 0
    out = capsys.readouterr().out
    g = comm.init("mpi")
    parallel_assert((f"ranks        {g.size}" in out) == (g.rank == 0), out[:200], g)
