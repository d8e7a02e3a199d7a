"""The Group contract on the mpi transport, and transport selection under mpirun."""

import numpy as np
import pytest

from hpcmac import comm
from hpcmac.errors import UsageError
from hpcmac.testing import parallel_assert, world
from tests.group_contract import GroupContract

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


class TestMPIContract(GroupContract):
    transport = "mpi"

    @pytest.fixture
    def group(self):
        return comm.init("mpi")


class TestMPISubgroupContract(GroupContract):
    """The contract again on a sub-group (every rank but the last when there are 3+)."""

    transport = "mpi"

    @pytest.fixture
    def group(self):
        w = comm.init("mpi")
        inside = w.size < 3 or w.rank < w.size - 1
        sub = w.split(0 if inside else 1, key=w.rank)
        if not inside:
            pytest.skip("this rank is outside the sub-group")
        return sub


def test_init_is_cached():
    parallel_assert(comm.init("mpi") is comm.init("mpi"), "two mpi groups", world())


def test_auto_is_mpi_on_linux_and_logs_why(capfd, monkeypatch):
    from hpcmac.comm import select

    monkeypatch.delenv("HPCMAC_QUIET_TRANSPORT", raising=False)
    monkeypatch.setattr(select, "_cached", {})
    g = comm.init("auto", strict=False)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("transport:")]
    if g.rank == 0:
        ok = lines == ["transport: mpi (rdma: mlx has no jaccl backend on Linux)"]
    else:
        ok = lines == []
    parallel_assert(g.transport == "mpi" and ok, f"{g.transport}: {lines}", world())


def test_rdma_strict_is_an_error_on_every_rank(monkeypatch):
    from hpcmac.comm import select

    monkeypatch.setattr(select, "_cached", {})
    with pytest.raises(UsageError, match="rdma: mlx has no jaccl backend on Linux"):
        comm.init("rdma", strict=True)
    monkeypatch.setenv("HPCMAC_TRANSPORT_STRICT", "1")
    with pytest.raises(UsageError, match="jaccl"):
        comm.init("rdma")
    parallel_assert(True, "", world())


def test_rdma_non_strict_falls_back_to_mpi(monkeypatch):
    from hpcmac.comm import select

    monkeypatch.setattr(select, "_cached", {})
    monkeypatch.setenv("HPCMAC_TRANSPORT", "rdma")
    g = comm.init()
    s = g.allreduce(np.ones(1))
    parallel_assert(g.transport == "mpi" and s[0] == g.size, g.transport, world())


def test_ranks_that_disagree_agree_on_mpi(monkeypatch):
    # the last rank claims rdma is usable; the others do not: nobody may start jaccl
    from hpcmac.comm import mlx as mlx_backend
    from hpcmac.comm import select

    w = world()
    monkeypatch.setattr(select, "_cached", {})
    if w.rank == w.size - 1:
        monkeypatch.setattr(mlx_backend, "is_available", lambda name: (True, ""))
    if w.size == 1:
        pytest.skip("needs two ranks to disagree")
    g = comm.init("auto", strict=False)
    parallel_assert(g.transport == "mpi", g.transport, w)


def test_ranks_asking_for_different_transports_all_fail(monkeypatch):
    from hpcmac.comm import select

    w = world()
    if w.size == 1:
        pytest.skip("needs two ranks to disagree")
    monkeypatch.setattr(select, "_cached", {})
    asked = "auto" if w.rank == w.size - 1 else "mpi"
    with pytest.raises(UsageError, match=f"rank {w.size - 1} asks auto"):
        comm.init(asked, strict=False)
    parallel_assert(True, "", w)


def test_jaccl_side_channel_over_mpi_gathers_bytes_in_rank_order():
    from hpcmac.comm.mlx import mpi_all_gather_factory

    w = world()
    gather = mpi_all_gather_factory(w.comm)(w.rank, w.size)
    got = gather(bytes([w.rank + 1]) * 5 + b"extra", 5)  # only n_bytes count
    expect = b"".join(bytes([r + 1]) * 5 for r in range(w.size))
    parallel_assert(got == expect, repr(got), w)
    with pytest.raises(RuntimeError, match="jaccl asks for rank"):
        mpi_all_gather_factory(w.comm)(w.rank, w.size + 1)


def test_bad_device_matrix_stops_rdma_on_every_rank(tmp_path, monkeypatch):
    # the matrix is checked and the verdict agreed before MLX is asked for anything
    import json

    from hpcmac.comm import mlx as mlx_backend

    w = world()
    bad = [[None] * (w.size + 1)] * (w.size + 1)
    monkeypatch.setenv("HPCMAC_IBV_DEVICES", json.dumps(bad))
    with pytest.raises(RuntimeError, match=f"rdma: device matrix has {w.size + 1} rows"):
        mlx_backend._jaccl_over_mpi(None, w)
    parallel_assert(True, "", w)


def test_auto_rejects_rdma_whose_matrix_does_not_fit(monkeypatch, capfd):
    # as on a Mac mesh with jaccl: everything usable but the matrix (two ranks on one host)
    import json

    from hpcmac.comm import mlx as mlx_backend
    from hpcmac.comm import rdma_env, select

    w = world()
    monkeypatch.setattr(select, "_cached", {})
    monkeypatch.delenv("HPCMAC_QUIET_TRANSPORT", raising=False)
    monkeypatch.setattr(mlx_backend, "is_available", lambda name: (True, ""))
    monkeypatch.setattr(rdma_env, "local_devices", lambda: ["rdma_en2"])
    matrix = [[None if i == j else "rdma_en2" for j in range(w.size)] for i in range(w.size)]
    if w.size > 1:
        matrix[0][1] = matrix[1][0] = None
    monkeypatch.setenv("HPCMAC_IBV_DEVICES", json.dumps(matrix))
    if w.size == 1:  # one rank: [[null]] is a valid (empty) mesh
        got, why = mlx_backend.rdma_matrix_problem(1, 0)
        parallel_assert(got == [[None]] and why == "", why, w)
        return
    g = comm.init("auto")
    err = capfd.readouterr().err
    expect = "transport: mpi (rdma: device matrix [0][1] is null: ranks 0 and 1 are not cabled)"
    parallel_assert(g.transport == "mpi" and (expect in err) == (w.rank == 0), err, w)
    with pytest.raises(UsageError, match="not cabled"):
        comm.init("rdma", strict=True)


def test_unknown_transport_is_usage_error_listing_valid_ones(monkeypatch):
    with pytest.raises(UsageError, match="auto, mpi, rdma, ring, local"):
        comm.init("infiniband")
    monkeypatch.setenv("HPCMAC_TRANSPORT", "tcp")
    with pytest.raises(UsageError, match="HPCMAC_TRANSPORT: unknown transport 'tcp'"):
        comm.init()
    parallel_assert(True, "", world())
