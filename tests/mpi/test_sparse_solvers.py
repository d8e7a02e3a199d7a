"""cg, gmres, bicgstab, minres on DistCSR with each preconditioner, against scipy's answers."""

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as sla
from linalg_util import same_error_everywhere

from hpcmac.linalg.sparse import (
    DistCSR,
    LinearOperator,
    amg,
    asm,
    bicgstab,
    block_jacobi,
    cg,
    gmres,
    jacobi,
    minres,
)
from hpcmac.testing import parallel_assert, world

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]


def lap1(n):
    return sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1])


def poisson2d(n, eps=1.0):
    """5-point Laplacian; eps != 1 makes it anisotropic (-u_xx - eps u_yy)."""
    i = sp.identity(n)
    return sp.csr_matrix(sp.kron(i, lap1(n)) + eps * sp.kron(lap1(n), i))


def poisson3d(n):
    i, t = sp.identity(n), lap1(n)
    return sp.csr_matrix(sp.kron(sp.kron(i, i), t) + sp.kron(sp.kron(i, t), i)
                         + sp.kron(sp.kron(t, i), i))


def convdiff2d(n, peclet=20.0):
    """-Laplace u + c . grad u, first-order upwind: non-symmetric."""
    h = 1.0 / (n + 1)
    up = sp.diags([-np.ones(n - 1), np.ones(n)], [-1, 0]) * (peclet * h)
    i = sp.identity(n)
    return sp.csr_matrix(poisson2d(n) + sp.kron(i, up) + sp.kron(up, i) * 0.5)


PROBLEMS = {"poisson2d": (poisson2d(14), True), "poisson3d": (poisson3d(6), True),
            "anisotropic": (poisson2d(14, 0.01), True), "convdiff": (convdiff2d(14), False)}
PRECS = {"jacobi": jacobi, "block_jacobi": block_jacobi, "asm": asm, "amg": amg}


@pytest.fixture(scope="module")
def built():
    g = world()
    out = {}
    for name, (a, _) in PROBLEMS.items():
        A = DistCSR.from_scipy(a, g, root=None)
        out[name] = (A, {p: f(A) for p, f in PRECS.items()})
    return out


@pytest.mark.parametrize("problem", list(PROBLEMS))
def test_each_solver_and_preconditioner_reaches_scipys_solution(problem, built):
    a, symmetric = PROBLEMS[problem]
    A, precs = built[problem]
    rng = np.random.default_rng(5)
    b = rng.standard_normal(a.shape[0])
    ref = sla.spsolve(sp.csc_matrix(a), b)
    solvers = [cg, minres, gmres, bicgstab] if symmetric else [gmres, bicgstab]
    for solver in solvers:
        for pname, M in precs.items():
            res = solver(A, b, rtol=1e-10, M=M)
            err = np.linalg.norm(res.x - ref) / np.linalg.norm(ref)
            parallel_assert(res.info == 0 and err < 1e-6,
                            f"{problem} {solver.__name__} {pname}: info {res.info} err {err:.1e}")
    # the non-symmetric variants, for the solvers that allow them
    for pname, M in (("ilu", block_jacobi(A, solver="ilu")), ("ras", asm(A, restrict=True))):
        for solver in (gmres, bicgstab):
            res = solver(A, b, rtol=1e-10, M=M)
            err = np.linalg.norm(res.x - ref) / np.linalg.norm(ref)
            parallel_assert(res.info == 0 and err < 1e-6,
                            f"{problem} {solver.__name__} {pname}: info {res.info} err {err:.1e}")
    # the name works as M= too, and AMG's iteration count is small
    res = (cg if symmetric else gmres)(A, b, rtol=1e-8, M="amg")
    parallel_assert(res.info == 0 and res.iterations <= 25, f"{problem} amg: {res.iterations}")


def test_info_and_iterations_as_scipy():
    g = world()
    a = poisson2d(12)
    A = DistCSR.from_scipy(a if g.rank == 0 else None, g)
    b = np.linspace(1.0, 2.0, a.shape[0])
    dinv = 1.0 / a.diagonal()
    Ms = sla.LinearOperator(a.shape, lambda r: dinv * r)
    for ours, theirs, kw in ((cg, sla.cg, {}), (bicgstab, sla.bicgstab, {}),
                             (minres, sla.minres, {}),
                             (gmres, sla.gmres, {"callback_type": "pr_norm"})):
        count = [0]
        _, info_ref = theirs(a, b, rtol=1e-8, M=Ms, callback=lambda *_, c=count: c.__setitem__(
            0, c[0] + 1), **kw)
        res = ours(A, b, rtol=1e-8, M="jacobi")
        parallel_assert(res.info == info_ref == 0 and abs(res.iterations - count[0]) <= 1,
                        f"{ours.__name__}: {res.iterations} iterations, scipy {count[0]}")
        x_ref, info_ref = theirs(a, b, rtol=1e-14, maxiter=3, **({"restart": 2}
                                 if ours is gmres else {}))
        res = ours(A, b, rtol=1e-14, maxiter=3, **({"restart": 2} if ours is gmres else {}))
        parallel_assert(res.info == info_ref == 3, f"{ours.__name__} maxiter: {res.info} vs "
                        f"{info_ref}")


def test_singular_and_indefinite_to_cg_end_with_info():
    g = world()
    n = 64
    neumann = sp.csr_matrix(lap1(n) - sp.diags([[1.0] + [0.0] * (n - 2) + [1.0]], [0]))
    A = DistCSR.from_scipy(neumann, g, root=None)
    b = np.ones(n)                                        # not in the range: no solution
    res = cg(A, b, rtol=1e-10, maxiter=300)
    parallel_assert(res.info > 0, f"singular: info {res.info}")
    indef = DistCSR.from_scipy(sp.diags(np.linspace(-1.0, 1.0, n) + 0.013), g, root=None)
    res = cg(indef, b, rtol=1e-10, maxiter=300)
    r = np.linalg.norm(b - (np.linspace(-1.0, 1.0, n) + 0.013) * res.x)
    parallel_assert(res.info > 0 or r <= 1e-10 * np.linalg.norm(b) * 1.01, f"indef {res.info}")
    res = minres(indef, b, rtol=1e-10)
    parallel_assert(res.info == 0, f"minres on the indefinite matrix: {res.info}")
    zero = DistCSR.from_scipy(sp.csr_matrix((n, n)), g, root=None)
    msg = same_error_everywhere(g, lambda: cg(zero, b, M="jacobi"), ValueError)
    assert msg.startswith("jacobi: the diagonal of A is zero at row 0")


def test_bad_vectors_and_linear_operator():
    g = world()
    a = poisson2d(8)
    A = DistCSR.from_scipy(a, g, root=None)
    assert same_error_everywhere(g, lambda: cg(A, np.ones(63)), ValueError).startswith(
        "b has shape (63,)")
    bad = np.ones(64)
    bad[7] = np.nan
    assert same_error_everywhere(g, lambda: gmres(A, bad), ValueError) == \
        "b must not contain infs or NaNs"
    assert "x0 has shape" in same_error_everywhere(g, lambda: cg(A, np.ones(64), np.ones(3)),
                                                   ValueError)
    assert "scipy object" in same_error_everywhere(g, lambda: cg(a, np.ones(64)), ValueError)
    op = LinearOperator(A.shape, A.matvec, counts=A.row_counts)
    b = A.vector(np.ones(64))
    res = cg(op, b, rtol=1e-10, M=jacobi(A))
    parallel_assert(res.info == 0 and np.allclose(res.x.allgather(),
                                                  sla.spsolve(sp.csc_matrix(a), np.ones(64))),
                    "LinearOperator")
