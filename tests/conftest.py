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

import json
import os
from pathlib import Path

for _key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_key, "1")
# Open MPI's ranks spin on their core while they wait unless they outnumber the cores: a
# 2-rank job thinks it has this machine's 2 cores to itself, and its waiting rank takes the
# core from the other worker's jobs. Two 2-rank jobs at once (one rank computing 0.6 s,
# the other waiting in a barrier; load 28-33): 5.5-7.8 s wall spinning, 1.9-4.1 s yielding,
# the waiting rank 0.6-1.2 s of CPU against 0.12 s. (make test-mpi sets it for its ranks.)
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


# -- pytest-xdist (make test-unit: -n 2 --dist loadfile) ----------------------------------
#
# One worker runs a whole file (but for SPLIT's), so a module's shared fixtures (servers,
# checkpoints, converted GGUFs) start once. With --dist loadfile a worker takes the next
# work unit (a file) when it has run all but two tests of its own, so the phase ends no
# sooner than the longest unit, and a long unit handed out last keeps one worker busy while
# the other has nothing left: the units go out longest first (with --no-loadscope-reorder),
# by the seconds tests/unit/durations.json gives each (a unit it does not name: first if
# it holds a ``slow`` test, else in the middle: a docs block is named by its line, so an
# edit above it makes it such a unit). The end of the phase prints where its
# wall time went (the longest units, each worker's span); HPCMAC_STORE_DURATIONS=FILE
# writes every unit's seconds of this run to FILE (the form durations.json has).
# (--dist loadgroup would let a file's independent tests spread, but xdist 3.8 cannot set
# pytest 9.2's node ids: every test would be its own group.)


# Files cut into several work units, each of which may go to either worker: the docs'
# blocks share nothing (each runs in a directory of its own), so each is a unit, and as
# one file they kept one worker for minutes; the MLX matrix's cells share only their
# family's folders and jobs (module fixtures: each folder written when a cell first asks
# for it, each layout's job run for all the family's forms when its first cell asks), so
# a family is a unit, and must stay one (tests/unit/generate_cells.py): 13 of 60-220 s at
# load 13-28 in one worker (16 cells each). The serve files start one server per layout
# (a module fixture with a parameter a layout): a layout's tests are a unit, so each
# server still starts once (test_llm_serve.py as one file: over 590 s at load 20, its
# three servers in turn).
# test_stops.py's tests share nothing (each starts its own jobs): each is a unit (its 20
# stops at np 1 took 538 s at load 22, 56 s of CPU; the 22 at np 2 as many again). So
# with test_comm_ring.py's launcher tests (each starts its own job; as one file 1040 s at
# load 15-37, its 4-rank contracts 117 s and 84 s of it at load 16, MLX's ring spinning on
# 2 cores): each is a unit, but for its singleton contract class (a fraction of a second).
def _each_test(nodeid: str) -> str:
    return nodeid


def _each_test_a_class_whole(nodeid: str) -> str:
    """``FILE::Class::test[p]`` -> ``FILE::Class``; a test outside a class: itself."""
    parts = nodeid.split("::")
    return "::".join(parts[:2]) if len(parts) > 2 else nodeid


def _first_param(nodeid: str) -> str:
    """``FILE::test[a-b-c]`` -> ``FILE::test[a``; a test without parameters: its file."""
    head, bracket, params = nodeid.partition("[")
    return head + bracket + params.split("-", 1)[0] if bracket else head.split("::", 1)[0]


def _param_id(nodeid: str) -> str:
    """``FILE::test[np2-tp2]`` -> ``FILE[np2-tp2``; a test without parameters: its file."""
    head, bracket, params = nodeid.partition("[")
    return head.split("::", 1)[0] + bracket + params.rstrip("]") if bracket else \
        head.split("::", 1)[0]


SPLIT = {"tests/unit/test_docs_commands.py": _each_test,
         "tests/unit/test_stops.py": _each_test,
         "tests/unit/test_comm_ring.py": _each_test_a_class_whole,
         "tests/unit/test_llm_mlx_matrix.py": _first_param,
         "tests/unit/test_llm_serve.py": _param_id,
         "tests/unit/test_llm_serve_structured.py": _param_id,
         "tests/unit/test_llm_serve_ops.py": _param_id}
DURATIONS = Path(__file__).parent / "unit" / "durations.json"


def unit_of(nodeid: str) -> str:
    """The work unit of a test under --dist loadfile: its file, or SPLIT's part of it."""
    path = nodeid.split("::", 1)[0]
    for name, cut in SPLIT.items():
        if path.endswith(name):
            return cut(nodeid)
    return path


def handout_order(items, weights: dict[str, float]) -> None:
    """Sort ``items`` in place, their units longest first by ``weights`` (seconds); a unit
    not in it counts as the longest if it holds a slow test, else as the median. Stable:
    a unit's tests keep their order."""
    slow = {unit_of(i.nodeid) for i in items if i.get_closest_marker("slow")}
    known = sorted(weights.values())
    middle = known[len(known) // 2] if known else 0.0
    top = known[-1] + 1 if known else 1.0

    def weight(item) -> float:
        u = unit_of(item.nodeid)
        return weights.get(u, top if u in slow else middle)

    items.sort(key=lambda item: -weight(item))


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:   # no pytest-xdist: one process, nothing to schedule
    LoadFileScheduling = None
else:
    class _SplitFileScheduling(LoadFileScheduling):
        """--dist loadfile, but SPLIT's files are cut into several work units."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        if config.getoption("dist") == "loadfile":
            return _SplitFileScheduling(config, log)
        return None


#: run first where they are collected outside the xdist workers (make test's serial phase):
#: the calibration measures this machine, best before the serial tests that start and kill
#: jobs (after them its tensor-2 decode once came 1.20x its prediction, the limit 1.2)
FIRST = ("tests/unit/test_plan_calibration.py",)


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            weights = json.loads(DURATIONS.read_text())["seconds"]
        except (OSError, ValueError, KeyError):
            weights = {}
        handout_order(items, weights)
        return
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST)  # stable


# -- where the wall time went (the xdist controller) ---------------------------------------

_SPANS: dict[str, list] = {}     # unit -> [first start, last stop, seconds, worker]


def _controller(config) -> bool:
    """This process hands tests to xdist workers (make test's unit workers; not the
    MPI phases' ranks, whose every rank would print the summary)."""
    return config.pluginmanager.hasplugin("dsession")


def pytest_runtest_logreport(report):
    if not getattr(report, "start", 0) or not hasattr(report, "node"):
        return   # reports reach the controller with the worker that ran them
    worker = getattr(getattr(report.node, "gateway", None), "id", "?")
    span = _SPANS.setdefault(unit_of(report.nodeid), [report.start, report.stop, 0.0, worker])
    span[0], span[1] = min(span[0], report.start), max(span[1], report.stop)
    span[2] += report.stop - report.start


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _controller(config) or len(_SPANS) < 2:
        return
    t0 = min(s[0] for s in _SPANS.values())
    tr = terminalreporter
    tr.write_sep("-", "where the wall time went (units: a file, or SPLIT's parts of one)")
    for unit, (a, b, secs, w) in sorted(_SPANS.items(), key=lambda kv: -kv[1][2])[:15]:
        tr.write_line(f"{secs:7.1f} s  {w:4s} {a - t0:6.0f}-{b - t0:<6.0f} {unit}")
    workers = sorted({s[3] for s in _SPANS.values()})
    for w in workers:
        mine = [s for s in _SPANS.values() if s[3] == w]
        last = max(mine, key=lambda s: s[1])
        tail = next(u for u, s in _SPANS.items() if s is last)
        tr.write_line(f"{w}: {len(mine)} units, {sum(s[2] for s in mine):.0f} s of tests, "
                      f"done at {last[1] - t0:.0f} s (last: {tail})")
    out = os.environ.get("HPCMAC_STORE_DURATIONS")
    if out:
        doc = {"seconds": {u: round(s[2], 1) for u, s in sorted(_SPANS.items())},
               "load": round(os.getloadavg()[0], 1)}
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
        tr.write_line(f"durations of {len(_SPANS)} units written to {out}")
