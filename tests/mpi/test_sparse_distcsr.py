"""DistCSR against scipy.sparse: every constructor, products, transpose, arithmetic, bad input."""

import os
import shutil
import tempfile

import numpy as np
import pytest
import scipy.io
import scipy.sparse as sp
from linalg_util import same_error_everywhere

from hpcmac.linalg import BlockVector
from hpcmac.linalg.sparse import DistCSR, assemble
from hpcmac.linalg.sparse import rows as rowpart
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


def matrices():
    """(name, scipy matrix, row_starts or None): empty rows, a rank with no rows, rectangular."""
    rng = np.random.default_rng(7)
    g = world()
    a = sp.random(41, 41, density=0.12, format="csr", random_state=rng) + sp.eye(41)
    a = sp.csr_matrix(a)
    a[[3, 17, 30], :] = 0.0          # empty rows
    a.eliminate_zeros()
    rect = sp.random(29, 46, density=0.15, format="csr", random_state=rng)
    tall = sp.random(46, 19, density=0.15, format="csr", random_state=rng)
    no_rows = (0, 0, *rowpart.even(41, g.size - 1)[1:]) if g.size > 1 else None
    return [("square", a, None), ("empty-rank0", a, no_rows), ("wide", rect, None),
            ("tall", tall, None)]


@pytest.fixture(scope="module")
def tmpdir_shared():
    g = world()
    path = g.bcast_obj(tempfile.mkdtemp(prefix="hpcmac-sp-") if g.rank == 0 else None)
    yield path
    g.barrier()
    if g.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def relerr(y, ref):
    return np.linalg.norm(y - ref) / max(np.linalg.norm(ref), 1e-300)


def check_products(A, a, label):
    m, n = a.shape
    rng = np.random.default_rng(3)
    x = rng.standard_normal(n)
    u = rng.standard_normal(m)
    parallel_assert(abs(A.to_scipy() - a).max() == 0 if a.nnz else True, f"{label}: entries")
    y = A @ x                                           # ndarray whole -> ndarray whole
    parallel_assert(relerr(y, a @ x) <= 1e-14, f"{label}: A @ x {relerr(y, a @ x)}")
    xb = A.vector(x)
    yb = A @ xb                                         # BlockVector -> BlockVector (row split)
    parallel_assert(isinstance(yb, BlockVector) and tuple(yb.counts) == A.row_counts, label)
    parallel_assert(relerr(yb.allgather(), a @ x) <= 1e-14, f"{label}: A @ BlockVector")
    t = A.T @ u
    parallel_assert(relerr(t, a.T @ u) <= 1e-14, f"{label}: A.T @ u {relerr(t, a.T @ u)}")
    tb = A.T @ A.vector(u, side="rows")
    parallel_assert(tuple(tb.counts) == A.col_counts and relerr(tb.allgather(), a.T @ u) <= 1e-14,
                    f"{label}: A.T @ BlockVector")
    parallel_assert(np.array_equal(A.diagonal().allgather(), a.diagonal()), f"{label}: diagonal")
    parallel_assert(A.nnz == a.nnz, f"{label}: nnz {A.nnz} != {a.nnz}")


@pytest.mark.parametrize("case", range(4))
def test_every_constructor_equals_scipy(case, tmpdir_shared):
    g = world()
    name, a, rs = matrices()[case]
    built = {
        "from_scipy root 0": DistCSR.from_scipy(a if g.rank == 0 else None, g, row_starts=rs),
        "from_scipy all": DistCSR.from_scipy(a, g, root=None, row_starts=rs),
    }
    starts = rs or rowpart.even(a.shape[0], g.size)
    lo, hi = starts[g.rank], starts[g.rank + 1]
    built["from_rows"] = DistCSR.from_rows(a[lo:hi], g, ncols=a.shape[1])
    # COO from every rank: shuffled, every entry split into two halves on different ranks
    c = a.tocoo()
    rng = np.random.default_rng(11)
    perm = rng.permutation(c.nnz)
    r = np.concatenate([c.row, c.row])[np.concatenate([perm, perm])]
    cc = np.concatenate([c.col, c.col])[np.concatenate([perm, perm])]
    v = np.concatenate([c.data * 0.5, c.data * 0.5])[np.concatenate([perm, perm])]
    mine = slice(g.rank, None, g.size)
    built["coo"] = assemble(r[mine], cc[mine], v[mine], a.shape, g, row_starts=rs)
    mm = os.path.join(tmpdir_shared, f"{name}.mtx")
    h5 = os.path.join(tmpdir_shared, f"{name}.h5")
    if g.rank == 0:
        scipy.io.mmwrite(mm, a)
    g.barrier()
    built["mmread root 0"] = DistCSR.mmread(mm, g, row_starts=rs)
    built["mmread parallel"] = DistCSR.mmread(mm, g, root=None, row_starts=rs)
    built["from_scipy root 0"].write_hdf5(h5, "A")
    built["read_hdf5"] = DistCSR.read_hdf5(h5, g, "A", row_starts=rs)
    for label, A in built.items():
        if rs is not None and label != "read_hdf5":
            parallel_assert(A.row_starts == rs, f"{label}: partition {A.row_starts}")
        check_products(A, a, f"{name} {label}")


def test_balanced_by_nonzeros_and_arithmetic():
    g = world()
    a = matrices()[0][1]
    heavy = a.copy()
    heavy[:5, :] = 1.0                                   # the first rows carry most entries
    A = DistCSR.from_scipy(heavy, g, root=None)
    B = DistCSR.from_scipy(a, g, root=None, row_starts=rowpart.even(41, g.size))
    nnz = np.diff(A.row_starts)
    parallel_assert(g.size == 1 or nnz[0] < 41 // g.size, f"not balanced: {A.row_starts}")
    for got, ref in (((A + B).to_scipy(), heavy + a), ((A - 2.0 * B).to_scipy(), heavy - 2 * a),
                     ((B * 3).to_scipy(), 3 * a), ((-B / 2).to_scipy(), -a / 2),
                     ((A @ B).to_scipy(), heavy @ a)):
        parallel_assert(abs(got - ref).max() <= 1e-13, "arithmetic")
    parallel_assert((A + B).row_starts == A.row_starts, "A + B keeps A's rows")
    C = B.redistribute(A.row_starts)
    parallel_assert(abs(C.to_scipy() - a).max() == 0 and C.row_starts == A.row_starts, "redist")


def test_bad_input_names_the_argument():
    g = world()
    a = matrices()[0][1]
    A = DistCSR.from_scipy(a, g, root=None)
    msg = same_error_everywhere(g, lambda: A @ np.ones(40), ValueError)
    assert msg.startswith("x has shape (40,)")
    wrong = BlockVector.zeros(41, g)
    if tuple(wrong.counts) != A.col_counts:
        assert "x is split" in same_error_everywhere(g, lambda: A @ wrong, ValueError)
    nan = a.copy()
    nan[2, 2] = np.nan
    msg = same_error_everywhere(g, lambda: DistCSR.from_scipy(nan if g.rank == 0 else None, g),
                                ValueError)
    assert msg.startswith("a must not contain infs or NaNs")
    vals = np.ones(3)
    if g.rank == g.size - 1:
        vals[1] = np.nan
    msg = same_error_everywhere(g, lambda: assemble([0, 1, 2], [0, 1, 2], vals, (3, 3), g),
                                ValueError)
    assert msg.startswith("vals must not contain infs or NaNs")
    msg = same_error_everywhere(g, lambda: assemble([0, 5], [0, 1], [1.0, 2.0], (3, 3), g),
                                ValueError)
    assert msg == "rows: index 5 is outside 0..2"
    msg = same_error_everywhere(g, lambda: assemble([0], [0, 1], [1.0], (3, 3), g), ValueError)
    assert msg.startswith("rows, cols and vals must have one length")
    B = DistCSR.from_scipy(sp.eye(40), g, root=None)
    assert same_error_everywhere(g, lambda: A + B, ValueError) == \
        "B has shape (40, 40), A has (41, 41)"
    assert "B has shape" in same_error_everywhere(g, lambda: A @ B, ValueError)
    msg = same_error_everywhere(g, lambda: DistCSR.from_scipy(a, g, root=None, row_starts=[0, 3]),
                                ValueError) if g.size != 1 else "row_starts must"
    assert msg.startswith("row_starts must")
    msg = same_error_everywhere(g, lambda: DistCSR.from_rows(sp.eye(2, 3 + (g.rank == 0)), g),
                                ValueError) if g.size > 1 else "local: every rank"
    assert msg.startswith("local: every rank")


def test_unreadable_files_get_one_line(tmpdir_shared):
    from hpcmac.errors import UsageError

    g = world()
    missing = os.path.join(tmpdir_shared, "nope.mtx")
    for root in (0, None):
        msg = same_error_everywhere(g, lambda r=root: DistCSR.mmread(missing, g, root=r),
                                    UsageError)
        assert msg.startswith(f"{missing}: cannot read")
    bad = os.path.join(tmpdir_shared, "bad.mtx")
    if g.rank == 0:
        with open(bad, "w") as f:
            f.write("%%MatrixMarket matrix coordinate real general\n3 3 4\n1 1 1.0\n2 2 2.0\n")
    g.barrier()
    msg = same_error_everywhere(g, lambda: DistCSR.mmread(bad, g, root=None), UsageError)
    assert msg == f"{bad}:2: the size line promises 4 entries, found 2"
    h5 = os.path.join(tmpdir_shared, "none.h5")
    msg = same_error_everywhere(g, lambda: DistCSR.read_hdf5(h5, g, "A"), UsageError)
    assert msg.startswith(f"{h5}:A: cannot read the CSR arrays")
