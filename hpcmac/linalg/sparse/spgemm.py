"""``A @ B`` for two DistCSR (moderate sizes: the rows of B that A's ghosts touch travel).

Rank r multiplies its rows of A by the rows of B they reach: its own rows of
B (B's rows are partitioned as A's columns) and the ghost rows, fetched once
through A's ghost plan. The result has A's rows and B's columns partitions.
Collective over the group.
"""

from __future__ import annotations

import scipy.sparse as sp

from hpcmac.linalg.sparse.distcsr import DistCSR


def spgemm(a: DistCSR, b: DistCSR) -> DistCSR:
    """Collective: the DistCSR ``a @ b``."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"B has shape {b.shape}, A @ B needs {a.shape[1]} rows")
    if b.group.size != a.group.size:
        raise ValueError("B lives on another group than A")
    b = b.redistribute(a.col_starts, b.col_starts)
    own = b.local_rows()
    ptr, ind, dat = a.plan.fetch_rows(own.indptr, own.indices, own.data)
    ghost_rows = sp.csr_matrix((dat, ind, ptr), shape=(a.ghosts.size, b.shape[1]))
    b_ext = sp.vstack([own, ghost_rows], format="csr")            # rows: own cols, then ghosts
    a_ext = sp.hstack([a.diag, a.off], format="csr")              # cols: own cols, then ghosts
    local = a_ext @ b_ext
    return DistCSR(local, (a.shape[0], b.shape[1]), a.row_starts, b.col_starts, a.group)
