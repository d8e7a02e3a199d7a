"""BiCGSTAB and MINRES on distributed vectors (short recurrences: a fixed handful of vectors).

As ``krylov.py``, the operator is a square DistMatrix or a function
``matvec(x_local) -> y_local`` on BlockVector pieces, and dot products are
the only communication the solvers add. Both follow scipy.sparse.linalg's
algorithms, stopping rules and ``info`` codes:

* ``bicgstab`` (van der Vorst's, right preconditioned): stop when
  ``||b - A x|| <= max(rtol ||b||, atol)``; ``info`` 0, the iteration count
  when ``maxiter`` ran out, -10 / -11 on a rho / omega breakdown. Four
  reductions per step (two of them fused pairs).
* ``minres`` (Paige and Saunders, for symmetric A and a symmetric positive
  definite ``M``): stops on scipy's relative backward error
  ``||r|| / (||A|| ||x||) <= rtol``; ``info`` 0, or ``maxiter``. Three
  reductions per step.
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg.distmatrix import DistMatrix
from hpcmac.linalg.krylov import KrylovResult, _setup, _sums


def bicgstab(A, b, x0=None, *, rtol: float = 1e-5, atol: float = 0.0,
             maxiter: int | None = None, M=None, callback=None) -> KrylovResult:
    """Collective: preconditioned BiCGSTAB for any square A; arguments as ``krylov.cg``."""
    if isinstance(A, DistMatrix) and not A.grid.in_grid:
        return KrylovResult(None, 0, 0, [])
    b, matvec, prec, x, back = _setup(A, b, x0, M)
    group = b.group
    maxiter = 10 * b.n if maxiter is None else int(maxiter)
    bnorm = b.norm()
    tol = max(rtol * bnorm, atol)
    if bnorm == 0.0:
        return KrylovResult(back(b.like(np.zeros_like(x))), 0, 0, [0.0])
    r = b.local - matvec(x) if x0 is not None else b.local.astype(x.dtype, copy=True)
    rtilde = r.copy()
    eps2 = np.finfo(x.real.dtype).eps ** 2
    history: list[float] = []
    p = v = None
    rho_prev = omega = alpha = 1.0
    it, info = 0, None
    while True:
        rr, rho = _sums(group, np.vdot(r, r).real, np.vdot(rtilde, r))
        history.append(float(np.sqrt(rr.real)))
        if history[-1] <= tol:
            info = 0
            break
        if it >= maxiter:
            info = maxiter
            break
        if abs(rho) < eps2:
            info = -10
            break
        if it == 0:
            p = r.copy()
        else:
            if abs(omega) < eps2:
                info = -11
                break
            beta = (rho / rho_prev) * (alpha / omega)
            p -= omega * v
            p *= beta
            p += r
        phat = prec(p)
        v = matvec(phat)
        rv = _sums(group, np.vdot(rtilde, v))[0]
        if rv == 0:
            info = -11
            break
        alpha = rho / rv
        r -= alpha * v                       # now s
        ss = float(np.sqrt(_sums(group, np.vdot(r, r).real)[0].real))
        it += 1
        if ss <= tol:
            x += alpha * phat
            history.append(ss)
            info = 0
            if callback is not None:
                callback(x)
            break
        shat = prec(r)
        t = matvec(shat)
        ts, tt = _sums(group, np.vdot(t, r), np.vdot(t, t).real)
        omega = ts / tt if tt != 0 else 0.0
        x += alpha * phat
        x += omega * shat
        r -= omega * t
        rho_prev = rho
        if callback is not None:
            callback(x)
    return KrylovResult(back(b.like(x)), int(info), it, history)


def minres(A, b, x0=None, *, rtol: float = 1e-5, shift: float = 0.0,
           maxiter: int | None = None, M=None, callback=None) -> KrylovResult:
    """Collective: MINRES for symmetric (possibly indefinite) A, solving ``(A - shift I) x = b``.

    ``M`` must be symmetric positive definite; an indefinite one raises
    ValueError on every rank. ``residuals`` holds MINRES's residual estimate
    (the M^-1-norm of r when preconditioned).
    """
    if isinstance(A, DistMatrix) and not A.grid.in_grid:
        return KrylovResult(None, 0, 0, [])
    b, matvec, prec, x, back = _setup(A, b, x0, M)
    group = b.group
    maxiter = 5 * b.n if maxiter is None else int(maxiter)
    eps = np.finfo(x.real.dtype).eps
    r1 = b.local - matvec(x) if x0 is not None else b.local.astype(x.dtype, copy=True)
    y = prec(r1)
    beta1 = float(_sums(group, np.vdot(r1, y).real)[0])
    if beta1 < 0:
        raise ValueError("minres: the preconditioner M is not positive definite")
    beta1 = np.sqrt(beta1)
    history = [float(beta1)]
    if beta1 == 0:
        return KrylovResult(back(b.like(x)), 0, 0, history)
    oldb, beta, dbar, epsln, phibar = 0.0, beta1, 0.0, 0.0, beta1
    tnorm2, cs, sn = 0.0, -1.0, 0.0
    w = np.zeros_like(x)
    w2 = np.zeros_like(x)
    r2 = r1
    it, info = 0, maxiter
    while it < maxiter:
        it += 1
        v = y / beta
        y = np.asarray(matvec(v), dtype=x.dtype)
        if shift:
            y = y - shift * v
        if it >= 2:
            y = y - (beta / oldb) * r1
        alfa = float(_sums(group, np.vdot(v, y).real)[0])
        y = y - (alfa / beta) * r2
        r1, r2 = r2, y
        y = prec(r2)
        oldb = beta
        beta2 = float(_sums(group, np.vdot(r2, y).real)[0])
        if beta2 < 0:
            raise ValueError("minres: the preconditioner M is not positive definite")
        beta = np.sqrt(beta2)
        tnorm2 += alfa ** 2 + oldb ** 2 + beta ** 2
        oldeps = epsln
        delta = cs * dbar + sn * alfa          # the previous rotation, applied
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        root = np.hypot(gbar, dbar)
        gamma = max(np.hypot(gbar, beta), eps)  # the next rotation
        cs, sn = gbar / gamma, beta / gamma
        phi = cs * phibar
        phibar = sn * phibar
        w1, w2 = w2, w
        w = (v - oldeps * w1 - delta * w2) / gamma
        x += phi * w
        anorm = np.sqrt(tnorm2)
        ynorm = float(np.sqrt(_sums(group, np.vdot(x, x).real)[0]))
        history.append(float(phibar))
        if callback is not None:
            callback(x)
        test1 = phibar / (anorm * ynorm + eps)   # scipy's stopping rules
        test2 = root / (anorm + eps)
        if test1 <= rtol or test2 <= rtol or beta == 0 or phibar == 0:
            info = 0
            break
    return KrylovResult(back(b.like(x)), int(info), it, history)
