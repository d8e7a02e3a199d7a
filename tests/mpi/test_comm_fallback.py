"""``auto`` falls back when the MLX transport fails to initialise (strict: error).

The failure is real: JACCL's bootstrap over MPI (hpcmac.comm.mlx.init_group) on this
Linux machine, given a device matrix for cables it does not have, refuses on every
rank; the ranks agree on it and fall back to MPI with the reason.
"""

import json

import pytest

from hpcmac import comm
from hpcmac.comm import select
from hpcmac.errors import UsageError
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def test_a_failed_jaccl_init_is_agreed_and_reported(monkeypatch):
    pytest.importorskip("mlx.core")
    w = comm.init("mpi")
    n = w.size
    matrix = [[None if i == j else "rdma_en3" for j in range(n)] for i in range(n)]
    monkeypatch.setenv("HPCMAC_IBV_DEVICES", json.dumps(matrix))
    group, why = select.init_or_fallback(w, "rdma")
    if n == 1:  # a single rank needs no cable: MLX's singleton group
        parallel_assert(group is not None and why == "", f"size 1: {why}", world())
        return
    parallel_assert(group is None, "a failed jaccl init returned a group", world())
    parallel_assert(why.startswith("rdma: jaccl failed to initialise on rank 0 (")
                    and "rdma_en3" in why and "not in ibv_devices" in why, why, world())
    # every rank holds the same reason
    reasons = w.allgather_obj(why)
    parallel_assert(len(set(reasons)) == 1, f"ranks disagree: {reasons}", world())


def test_strict_turns_the_fallback_into_an_error(monkeypatch):
    pytest.importorskip("mlx.core")
    w = comm.init("mpi")
    if w.size == 1:
        pytest.skip("one rank always initialises")
    matrix = [[None if i == j else "rdma_en3" for j in range(w.size)] for i in range(w.size)]
    monkeypatch.setenv("HPCMAC_IBV_DEVICES", json.dumps(matrix))
    # JACCL's availability probe cannot pass on Linux: skip it, so that init itself fails
    monkeypatch.setattr(select, "_mlx_reason", lambda world, name: "")
    monkeypatch.setattr(select, "_cached", {})
    monkeypatch.setenv("HPCMAC_QUIET_TRANSPORT", "1")
    g = select.init("rdma", strict=False)
    parallel_assert(g.transport == "mpi", f"fell back to {g.transport}", world())
    with pytest.raises(UsageError, match="jaccl failed to initialise"):
        select.init("rdma", strict=True)
