"""The Group contract on the local (size-1) transport, and its own refusals."""

import numpy as np
import pytest

from hpcmac import comm
from hpcmac.comm.local import LocalGroup
from tests.group_contract import GroupContract


class TestLocalContract(GroupContract):
    transport = "local"

    @pytest.fixture
    def group(self):
        return comm.init("local")


def test_local_refuses_other_peers_and_unmatched_recv():
    g = LocalGroup()
    with pytest.raises(ValueError, match="only rank 0"):
        g.send(np.zeros(1), 1)
    with pytest.raises(RuntimeError, match="deadlock"):
        g.recv(np.zeros(1), 0, tag=7)
