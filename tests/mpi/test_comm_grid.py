"""The P×Q process grid at np 1, 2, 4: every grid that fits, both rank placements."""

import numpy as np
import pytest

from hpcmac import comm
from hpcmac.comm.grid import Grid
from hpcmac.testing import parallel_assert

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def grids_that_fit(size):
    return [(p, q) for p in range(1, size + 1) for q in range(1, size + 1) if p * q <= size]


@pytest.mark.parametrize("order", ["row", "col"])
def test_every_grid_that_fits(order):
    w = comm.init("mpi")
    for p, q in grids_that_fit(w.size):
        g = Grid(w, p, q, order)
        where = f"{p}x{q} {order} rank {w.rank}"
        parallel_assert(g.shape == (p, q) and g.in_grid == (w.rank < p * q), where, w)
        # placement: netlib HPL's row-major (PMAP 0) or column-major (PMAP 1)
        for r in range(p * q):
            pr, pc = g.coords(r)
            expect = divmod(r, q) if order == "row" else (r % p, r // p)
            parallel_assert((pr, pc) == expect and g.rank_of(pr, pc) == r,
                            f"{where}: coords({r}) = {(pr, pc)}", w)
        ok, why = True, ""
        if g.in_grid:  # ranks outside the grid must not touch its groups
            ok, why = _check_groups(g, w.rank, p, q)
        parallel_assert(ok, f"{where}: {why}", w)


def _check_groups(g, wrank, p, q):
    """Local verdict on the row/column/all groups of an in-grid rank."""
    if (g.myrow, g.mycol) != g.coords(wrank):
        return False, f"at {(g.myrow, g.mycol)}"
    # the row group: my process row, ordered by column; the column group likewise
    row_ranks = g.row.allgather_obj(wrank)
    col_ranks = g.col.allgather_obj(wrank)
    ok = (g.row.size == q and g.row.rank == g.mycol
          and row_ranks == [g.rank_of(g.myrow, c) for c in range(q)]
          and g.col.size == p and g.col.rank == g.myrow
          and col_ranks == [g.rank_of(r, g.mycol) for r in range(p)]
          and g.all.size == p * q and g.all.rank == wrank)
    # sums along rows and columns agree with the placement
    rs = g.row.allreduce(np.array([wrank], dtype=np.int64))[0]
    cs = g.col.allreduce(np.array([wrank], dtype=np.int64))[0]
    ok = ok and (rs == sum(g.rank_of(g.myrow, c) for c in range(q))
                 and cs == sum(g.rank_of(r, g.mycol) for r in range(p)))
    return ok, f"row {row_ranks} sum {rs}, col {col_ranks} sum {cs}"


def test_bad_grids_are_refused_on_every_rank():
    w = comm.init("mpi")
    for args, msg in [((0, 1), "at least 1x1"), ((1, 1, "diag"), "'row' or 'col'"),
                      ((w.size + 1, 1), f"needs {w.size + 1} ranks, have {w.size}")]:
        with pytest.raises(ValueError, match=msg):
            Grid(w, *args)
    parallel_assert(True, "", w)
