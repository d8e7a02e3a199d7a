"""One rank dies in the middle of collectives: run only by tests/unit/test_comm_ring.py.

``python case_comm_peer_dies.py TRANSPORT MARKER``: every rank runs
allreduces; the last rank calls ``os._exit(3)`` in the fifth. The launcher
must end the job (non-zero) instead of leaving the others waiting. MARKER
only makes these processes easy for the test to find afterwards.
"""

import os
import sys

import numpy as np

from hpcmac import comm
from hpcmac.lifecycle import run_cli


def main(argv=None):
    transport = (argv or sys.argv[1:])[0]
    g = comm.init(transport, strict=True)
    buf = np.ones(1 << 16)
    for i in range(10_000):
        if i == 5 and g.rank == g.size - 1:
            print(f"rank {g.rank} dies now", file=sys.stderr, flush=True)
            os._exit(3)
        g.allreduce(buf, out=buf)
        buf[:] = 1.0
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
