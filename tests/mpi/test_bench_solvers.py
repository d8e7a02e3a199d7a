"""hpcmac.bench.solvers runs at any rank count and reports the same records everywhere."""

import pytest

from hpcmac.bench.solvers import run
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(60)]


def test_solvers_bench_small():
    g = world()
    recs = run(g, 40, 8, 1)
    parallel_assert([r["op"] for r in recs] == ["eigh", "lstsq", "inv"], "ops", g)
    parallel_assert(all(r["seconds"] > 0 and r["scipy_1core_seconds"] > 0 for r in recs),
                    "times", g)
    parallel_assert(len({str(recs)} | set(map(str, g.allgather_obj(recs)))) == 1,
                    "same on every rank", g)
