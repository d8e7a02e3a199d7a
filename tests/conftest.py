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


# -- pytest-xdist (make test-unit: -n 2 --dist loadfile) ----------------------------------
#
# One worker runs a whole file (but for SPREAD's), so a module's shared fixtures (servers,
# checkpoints, converted GGUFs) start once. Files holding a ``slow`` test are handed out first
# (with --no-loadscope-reorder), so the longest pieces do not start last and leave the
# other worker idle. (--dist loadgroup would let a file's independent tests spread, but
# xdist 3.8 cannot set pytest 9.2's node ids: every test would be its own group.)


# Files whose tests share nothing (no module-scoped fixture: each docs block runs in a
# directory of its own), so each test may go to either worker: the docs' blocks are the
# suite's longest tests, and as one file they would keep one worker for minutes.
SPREAD = ("tests/unit/test_docs_commands.py",)

try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:   # no pytest-xdist: one process, nothing to schedule
    LoadFileScheduling = None
else:
    class _SpreadFileScheduling(LoadFileScheduling):
        """--dist loadfile, but a test of a SPREAD file is a work unit of its own."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path.endswith(SPREAD) else path

    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") == "loadfile":
            return _SpreadFileScheduling(config, log)
        return None


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow = {item.nodeid.split("::")[0] for item in items
                if item.get_closest_marker("slow")}
        # a stable sort: files keep their own order of tests, and pytest's order otherwise
        items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)
