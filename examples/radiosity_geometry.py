"""A flatland radiosity problem shared by the serial and distributed examples.

A square room, each wall cut into ``m`` patches; a lamp in the middle of the
ceiling. Patch i's radiosity B_i satisfies B_i = E_i + rho_i sum_j F_ij B_j,
so (I - diag(rho) F) B = E: a dense, non-symmetric, well-conditioned system.
F_ij = cos(theta_i) cos(theta_j) / (2 r_ij) * L_j is the 2-D form factor
(the room is convex: every patch sees every other one off its own wall).
"""

import numpy as np


def patches(m: int):
    """Centres (N, 2), inward normals (N, 2), lengths (N,), reflectance and emission (N,)."""
    t = (np.arange(m) + 0.5) / m
    one, zero = np.ones(m), np.zeros(m)
    walls = [  # (centres, normal, reflectance) for floor, right, ceiling, left
        (np.c_[t, zero], (0.0, 1.0), 0.3),
        (np.c_[one, t], (-1.0, 0.0), 0.7),
        (np.c_[1 - t, one], (0.0, -1.0), 0.8),
        (np.c_[zero, 1 - t], (1.0, 0.0), 0.7),
    ]
    centres = np.vstack([w[0] for w in walls])
    normals = np.vstack([np.tile(w[1], (m, 1)) for w in walls])
    rho = np.concatenate([np.full(m, w[2]) for w in walls])
    lengths = np.full(4 * m, 1.0 / m)
    emission = np.zeros(4 * m)
    ceiling = slice(2 * m, 3 * m)
    emission[ceiling] = np.where(np.abs(centres[ceiling, 0] - 0.5) < 0.1, 1.0, 0.0)
    return centres, normals, lengths, rho, emission


def system_entries(m: int):
    """``f(i, j)`` -> entries of A = I - diag(rho) F for global index arrays i, j (broadcast)."""
    c, nrm, length, rho, _ = patches(m)

    def f(i, j):
        d = c[j] - c[i]                                   # (..., 2) from patch i to patch j
        r = np.sqrt((d**2).sum(-1))
        safe = np.where(r > 0, r, 1.0)
        cos_i = np.maximum((nrm[i] * d).sum(-1) / safe, 0.0)
        cos_j = np.maximum(-(nrm[j] * d).sum(-1) / safe, 0.0)
        form = np.where(r > 0, cos_i * cos_j / (2 * safe) * length[j], 0.0)
        return (i == j) - rho[i] * form

    return f


def input_mismatch(path: str, m: int) -> str | None:
    """Why the existing HDF5 file ``path`` cannot be the input for ``--m m``, or None.

    A file written by an earlier run with another ``--m`` holds a system of
    another size: reading it silently would solve the wrong problem.
    """
    import h5py

    n = 4 * m
    with h5py.File(path, "r") as f:
        shapes = {k: f[k].shape for k in ("A", "E") if k in f}
    if shapes.get("A") != (n, n) or shapes.get("E") not in ((n, 1), (n,)):
        found = " x ".join(map(str, shapes["A"])) if "A" in shapes else "no dataset 'A'"
        return (f"{path} holds a {found} system, but --m {m} needs {n} x {n}: "
                "delete the file or give another --input")
    return None
