"""Building a DistCSR: from scipy matrices, from each rank's rows, from COO triplets.

``assemble`` is PETSc's ``MatSetValues(ADD_VALUES)`` + ``MatAssemblyBegin/End``:
any rank may hold entries of any row; they travel to the rows' owners
(point-to-point, only between ranks that have entries for each other) and
duplicates are summed. Every function here is collective over ``group`` and
checks its input collectively, so a bad argument raises the same one-line
``ValueError`` (naming the argument) on every rank.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from hpcmac.comm.base import Group
from hpcmac.linalg.sparse import rows as rowpart
from hpcmac.linalg.sparse.distcsr import DistCSR, agree

TAG_COUNTS, TAG_ROWS, TAG_COLS, TAG_VALS = 7311, 7312, 7313, 7314


def _finite(values: np.ndarray, name: str) -> str | None:
    if values.size and not np.isfinite(values).all():
        k = int(np.flatnonzero(~np.isfinite(values))[0])
        return f"{name} must not contain infs or NaNs (entry {k} is {values[k]})"
    return None


def _partitions(group, shape, row_starts, col_starts, row_nnz=None):
    """Global row and column partitions (checked); rows balanced by nonzeros by default."""
    m, n = shape
    if row_starts is None:
        row_starts = rowpart.by_nonzeros(row_nnz, group.size) if row_nnz is not None else \
            rowpart.even(m, group.size)
    rows = rowpart.check(row_starts, m, group.size)
    if col_starts is None:
        col_starts = rows if m == n else rowpart.even(n, group.size)
    return rows, rowpart.check(col_starts, n, group.size, "col_starts")


def _shape(shape) -> tuple[int, int]:
    try:
        m, n = (int(v) for v in shape)
    except (TypeError, ValueError):
        raise ValueError(f"shape must be two integers, got {shape!r}") from None
    if m < 0 or n < 0:
        raise ValueError(f"shape must not be negative, got {shape!r}")
    return m, n


def assemble(rows, cols, vals, shape, group: Group, row_starts=None, col_starts=None,
             check_finite: bool = True) -> DistCSR:
    """Collective: COO triplets set by global index on any rank, summed into a DistCSR.

    Parameters
    ----------
    rows, cols, vals : array_like (local)
        This rank's entries; any rank may set any entry, duplicates add up.
    shape : (M, N) (global)
    row_starts, col_starts : sequence of size + 1 ints, optional (global)
        The partitions; rows default to balanced by nonzeros (counted after the
        triplets are summed over ranks, before duplicates merge).
    """
    shape = _shape(shape)
    rows = np.asarray(rows).reshape(-1)
    cols = np.asarray(cols).reshape(-1)
    vals = np.asarray(vals).reshape(-1)
    msg = None
    if not (rows.size == cols.size == vals.size):
        msg = f"rows, cols and vals must have one length, got {rows.size}, {cols.size}, {vals.size}"
    elif rows.size and not (np.issubdtype(rows.dtype, np.integer)
                            and np.issubdtype(cols.dtype, np.integer)):
        msg = f"rows and cols must be integers, got {rows.dtype} and {cols.dtype}"
    elif rows.size and (rows.min() < 0 or rows.max() >= shape[0]):
        bad = rows[(rows < 0) | (rows >= shape[0])][0]
        msg = f"rows: index {bad} is outside 0..{shape[0] - 1}"
    elif cols.size and (cols.min() < 0 or cols.max() >= shape[1]):
        bad = cols[(cols < 0) | (cols >= shape[1])][0]
        msg = f"cols: index {bad} is outside 0..{shape[1] - 1}"
    elif check_finite:
        msg = _finite(vals, "vals")
    agree(group, msg)
    rows, cols = rows.astype(np.int64), cols.astype(np.int64)
    dtype = np.result_type(*group.allgather_obj(vals.dtype if vals.size else np.dtype(np.float64)))
    vals = vals.astype(dtype, copy=False)
    row_nnz = None
    if row_starts is None:
        row_nnz = group.allreduce(np.bincount(rows, minlength=shape[0]).astype(np.int64))
    rs, cs = _partitions(group, shape, row_starts, col_starts, row_nnz)
    owner = rowpart.owners(rs, rows)
    order = np.argsort(owner, kind="stable")
    rows, cols, vals, owner = rows[order], cols[order], vals[order], owner[order]
    bounds = np.searchsorted(owner, np.arange(group.size + 1))
    table = group.allgather(np.diff(bounds).astype(np.int64))      # [src, dst] entries
    me = group.rank
    keep = slice(bounds[me], bounds[me + 1])
    parts = [(rows[keep], cols[keep], vals[keep])]
    reqs = []
    for src in range(group.size):
        k = int(table[src, me])
        if src != me and k:
            bufs = (np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, dtype))
            parts.append(bufs)
            reqs += [group.irecv(b, src, t) for b, t in zip(bufs, (TAG_ROWS, TAG_COLS, TAG_VALS))]
    for dst in range(group.size):
        a, b = bounds[dst], bounds[dst + 1]
        if dst != me and b > a:
            reqs += [group.isend(arr[a:b], dst, t)
                     for arr, t in ((rows, TAG_ROWS), (cols, TAG_COLS), (vals, TAG_VALS))]
    group.waitall(reqs)
    r = np.concatenate([p[0] for p in parts]) - rs[me]
    c = np.concatenate([p[1] for p in parts])
    v = np.concatenate([p[2] for p in parts])
    local = sp.csr_matrix((v, (r, c)), shape=(rs[me + 1] - rs[me], shape[1]), dtype=dtype)
    return DistCSR(local, shape, rs, cs, group)


def from_coo(rows, cols, vals, shape, group: Group, row_starts=None, col_starts=None) -> DistCSR:
    """Collective: ``assemble`` under scipy's ``coo_matrix((vals, (rows, cols)), shape)`` order."""
    return assemble(rows, cols, vals, shape, group, row_starts, col_starts)


def from_rows(local, group: Group, ncols: int | None = None, col_starts=None,
              check_finite: bool = True) -> DistCSR:
    """Collective: each rank's own rows (any scipy sparse matrix, global column indices).

    The ranks' rows stack in rank order, so the row partition is given by
    how many rows each rank passes. ``ncols`` defaults to ``local.shape[1]``.
    """
    msg = None
    try:
        local = sp.csr_matrix(local)
    except Exception as exc:  # noqa: BLE001 - anything scipy refuses
        local, msg = sp.csr_matrix((0, 0)), f"local must be a scipy sparse matrix ({exc})"
    shapes = group.allgather_obj(local.shape)
    n = int(ncols) if ncols is not None else shapes[0][1]
    if msg is None and any(s[1] != n for s in shapes):
        msg = f"local: every rank's rows must have {n} columns, got {[s[1] for s in shapes]}"
    if msg is None and check_finite:
        msg = _finite(local.data, "local")
    agree(group, msg)
    counts = [s[0] for s in shapes]
    rs = rowpart.from_counts(counts)
    shape = (rs[-1], n)
    _, cs = _partitions(group, shape, rs, col_starts)
    dtype = np.result_type(*group.allgather_obj(local.dtype))
    return DistCSR(local.astype(dtype), shape, rs, cs, group)


def from_scipy(a, group: Group, root: int | None = 0, row_starts=None, col_starts=None,
               check_finite: bool = True) -> DistCSR:
    """Collective: a scipy sparse matrix held by rank ``root`` (or, ``root=None``, by every rank).

    Rank ``root`` sends each rank its rows (rows balanced by nonzeros unless
    ``row_starts`` is given); with ``root=None`` each rank slices its own.
    """
    holder = group.rank == root or root is None
    msg, csr = None, None
    if holder:
        try:
            csr = sp.csr_matrix(a)
            csr.sum_duplicates()
        except Exception as exc:  # noqa: BLE001
            msg = f"a must be a scipy sparse matrix or a 2-D array ({exc})"
        if msg is None and check_finite:
            msg = _finite(csr.data, "a")
    if root is None:
        agree(group, msg)
        shape = csr.shape
        rs, cs = _partitions(group, shape, row_starts, col_starts, np.diff(csr.indptr))
        lo, hi = rs[group.rank], rs[group.rank + 1]
        return DistCSR(csr[lo:hi], shape, rs, cs, group)
    info = None
    if holder and msg is None:
        try:
            info = (csr.shape, _partitions(group, csr.shape, row_starts, col_starts,
                                           np.diff(csr.indptr)), csr.dtype)
        except ValueError as exc:
            msg = str(exc)
    msg = group.bcast_obj(msg, root)
    if msg:
        raise ValueError(msg)
    shape, (rs, cs), dtype = group.bcast_obj(info, root)
    me = group.rank
    nloc = rs[me + 1] - rs[me]
    if holder:
        reqs = []
        keep = []
        for r in range(group.size):
            lo, hi = rs[r], rs[r + 1]
            ptr = (csr.indptr[lo: hi + 1] - csr.indptr[lo]).astype(np.int64)
            ind = csr.indices[csr.indptr[lo]: csr.indptr[hi]].astype(np.int64)
            dat = np.ascontiguousarray(csr.data[csr.indptr[lo]: csr.indptr[hi]])
            if r == me:
                mine = (dat, ind, ptr)
                continue
            count = np.array([ind.size], dtype=np.int64)
            keep.append((count, ptr, ind, dat))    # alive until the sends complete
            reqs.append(group.isend(count, r, TAG_COUNTS))
            reqs += [group.isend(ptr, r, TAG_ROWS), group.isend(ind, r, TAG_COLS),
                     group.isend(dat, r, TAG_VALS)]
        group.waitall(reqs)
        dat, ind, ptr = mine
    else:
        k = group.recv(np.empty(1, dtype=np.int64), root, TAG_COUNTS)[0]
        ptr = group.recv(np.empty(nloc + 1, dtype=np.int64), root, TAG_ROWS)
        ind = group.recv(np.empty(k, dtype=np.int64), root, TAG_COLS)
        dat = group.recv(np.empty(k, dtype=dtype), root, TAG_VALS)
    local = sp.csr_matrix((dat, ind, ptr), shape=(nloc, shape[1]))
    return DistCSR(local, shape, rs, cs, group)


def assemble_vector(rows, vals, n: int, group: Group, row_starts=None):
    """Collective: a vector from (index, value) pairs set on any rank, duplicates summed
    (``VecSetValues(ADD_VALUES)``); a BlockVector split by ``row_starts`` (default even)."""
    from hpcmac.linalg.vectors import BlockVector

    rows = np.asarray(rows).reshape(-1)
    rs = rowpart.check(row_starts, n, group.size) if row_starts is not None else \
        rowpart.even(n, group.size)
    v = assemble(rows, np.zeros(rows.size, dtype=np.int64), vals, (n, 1), group, rs,
                 (0,) + (1,) * group.size)
    local = np.ascontiguousarray(v.local_rows().toarray()[:, 0])
    return BlockVector(local, n, tuple(np.diff(rs).tolist()), group)
