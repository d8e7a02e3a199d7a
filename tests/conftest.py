"""The whole suite's settings, for pytest and every process it starts.

One BLAS thread per process: the suite's processes share the machine's cores (pytest,
its clients, each rank of each job), which is when hpcmac-mpirun gives ranks one thread
each, and two OpenBLAS threads that share cores with anything else spin against each
other. A one-rank job would otherwise get every core (tools/mpirun, or a plain
``python -m hpcmac.llm serve``): an np 1 server's 313-token prefill took 18 s of CPU
with two threads against 2.1 s with one, at load 11 on 2 cores. What a developer set
wins; the tests of the thread rule itself clear these variables.
"""

from __future__ import annotations

import os

for _key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_key, "1")
