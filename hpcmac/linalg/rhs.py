"""Right-hand sides given as plain arrays: ``b`` whole on every rank, as while porting.

Every solver that takes a DistMatrix right-hand side also takes an ndarray
(n,) or (n, k) holding the whole ``b`` on every rank; the answer then comes
back whole on every grid rank, in ``b``'s shape. Building the DistMatrix
needs no communication (each rank copies its own entries); turning the
answer back is one allgather.
"""

from __future__ import annotations

import numpy as np

from hpcmac.linalg.checks import require, same_grid
from hpcmac.linalg.distmatrix import DistMatrix


def as_dist(b, like: DistMatrix, what: str):
    """``(bd, back)``: ``b`` as a DistMatrix on ``like``'s grid, and a function turning
    an answer in ``bd``'s layout back into ``b``'s kind (DistMatrix: unchanged; ndarray:
    the whole array on every grid rank, None elsewhere). ``b`` is global."""
    if isinstance(b, DistMatrix):
        same_grid(what, like, b)
        return b, lambda x: x
    arr = np.asarray(b)
    require(arr.ndim in (1, 2), f"{what}: b must be 1-D or 2-D, got shape {arr.shape}")
    b2 = arr.reshape(arr.shape[0], -1)
    nb = like.mb
    bd = DistMatrix.from_function(lambda i, j: b2[i, j], b2.shape, like.grid, nb, nb, b2.dtype)

    def back(x: DistMatrix):
        full = x.allgather()
        if full is None:
            return None
        return full.reshape(-1) if arr.ndim == 1 else full

    return bd, back
