"""The Group contract on the ring transport: run only by tests/unit/test_comm_ring.py.

Started by mpirun (MPI bootstrap, ``HPCMAC_CASE_LAUNCH=mpirun``) or by
mlx.launch (no MPI, ``HPCMAC_CASE_LAUNCH=mlx``), at 2 or 4 ranks.
"""

import os

import pytest

from hpcmac import comm
from tests.group_contract import GroupContract

UNDER_MLX = os.environ.get("HPCMAC_CASE_LAUNCH") == "mlx"


class TestRingContract(GroupContract):
    transport = "ring"
    # under mlx.launch there is no MPI to fall back on: MLX ring limits show
    any_peer = not UNDER_MLX
    tags = not UNDER_MLX
    any_split = not UNDER_MLX

    @pytest.fixture
    def group(self):
        return comm.init("ring", strict=True)


def test_ring_runs_over_mlx():
    g = comm.init("ring", strict=True)
    from hpcmac.comm.mlx import MLXGroup

    assert isinstance(g, MLXGroup)
    assert (g.fallback is None) == UNDER_MLX
