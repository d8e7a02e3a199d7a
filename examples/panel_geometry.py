"""Potential flow past a circular cylinder by the source-panel method: the physics shared by
the serial and the distributed example (a dense boundary-element solve).

Where it comes from: Lesson 10, "Source panel method", of AeroPython by Lorena A. Barba
and Olivier Mesnard (github.com/barbagroup/AeroPython, lessons/
10_Lesson10_sourcePanelMethod.ipynb; Barba & Mesnard, "Aero Python: classical
aerodynamics of potential flow using Python", Journal of Open Source Education 2(15), 45,
2019, doi:10.21105/jose.00045; code under the BSD 3-clause licence). This is our own
code for the lesson's method and conventions, not a copy of the notebook:

* a cylinder of radius R in a uniform stream u_inf along x, its boundary cut into N
  flat panels with end-points on the circle, counter-clockwise from the point (R, 0)
  (the lesson's ``x_ends = R cos(linspace(0, 2 pi, N + 1))``, y likewise);
* each panel carries a constant source strength sigma_j; panel i's normal makes the
  angle beta_i with the x axis; the normal velocity at every centre is zero, so
  A sigma = b with A_ii = 1/2, A_ij = 1/(2 pi) int_j d/dn_i ln r ds, b_i = -u_inf cos
  beta_i (the integrals by adaptive quadrature, ``scipy.integrate.quad``, as the lesson);
* then the tangential velocity v_t = A_t sigma - u_inf sin beta (A_t has a zero
  diagonal) and the pressure coefficient cp = 1 - (v_t / u_inf)^2, which the lesson
  compares with the exact cp = 1 - 4 sin^2 theta.
"""

import numpy as np
from scipy import integrate


def panels(n: int, radius: float = 1.0):
    """End-points (xa, ya, xb, yb), centres (xc, yc), lengths and normal angles beta, (n,)."""
    t = np.linspace(0.0, 2.0 * np.pi, n + 1)
    xe, ye = radius * np.cos(t), radius * np.sin(t)
    xa, ya, xb, yb = xe[:-1], ye[:-1], xe[1:], ye[1:]  # panel k: from end k to end k + 1
    xc, yc = (xa + xb) / 2, (ya + yb) / 2
    length = np.hypot(xb - xa, yb - ya)
    # angle of the outward normal with the x axis, as the lesson's Panel class
    beta = np.where(xb - xa <= 0.0, np.arccos(np.clip((yb - ya) / length, -1, 1)),
                    np.pi + np.arccos(np.clip(-(yb - ya) / length, -1, 1)))
    return xa, ya, xb, yb, xc, yc, length, beta


def _influence(geom, i: int, j: int, normal: bool) -> float:
    """1/(2 pi) times the integral over panel j of the derivative of ln r at panel i's
    centre, along panel i's normal (``normal``) or tangent."""
    xa, ya, _, _, xc, yc, length, beta = geom
    dx_i, dy_i = (np.cos(beta[i]), np.sin(beta[i])) if normal else \
        (-np.sin(beta[i]), np.cos(beta[i]))
    sb, cb = np.sin(beta[j]), np.cos(beta[j])

    def integrand(s):
        rx = xc[i] - (xa[j] - sb * s)
        ry = yc[i] - (ya[j] + cb * s)
        return (rx * dx_i + ry * dy_i) / (rx * rx + ry * ry)

    return integrate.quad(integrand, 0.0, length[j])[0] / (2.0 * np.pi)


def normal_entries(n: int):
    """``f(i, j)`` -> entries of A (normal velocity) for global index arrays i, j."""
    geom = panels(n)
    one = np.vectorize(lambda i, j: 0.5 if i == j else _influence(geom, i, j, True),
                       otypes=[float])
    return lambda i, j: one(*np.broadcast_arrays(i, j))


def tangent_entries(n: int):
    """``f(i, j)`` -> entries of A_t (tangential velocity) for global index arrays i, j."""
    geom = panels(n)
    one = np.vectorize(lambda i, j: 0.0 if i == j else _influence(geom, i, j, False),
                       otypes=[float])
    return lambda i, j: one(*np.broadcast_arrays(i, j))


def freestream(n: int, u_inf: float = 1.0):
    """b (normal) and b_t (tangential) of the uniform stream at the centres, (n,) each."""
    beta = panels(n)[7]
    return -u_inf * np.cos(beta), -u_inf * np.sin(beta)  # (u_inf, 0) . n and . t


def exact_cp(n: int) -> np.ndarray:
    """cp = 1 - 4 sin^2 theta at the panel centres (the exact potential flow)."""
    xc, yc = panels(n)[4:6]
    return 1.0 - 4.0 * np.sin(np.arctan2(yc, xc)) ** 2
