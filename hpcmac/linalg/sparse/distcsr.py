"""DistCSR: a sparse matrix whose rows are dealt to ranks in contiguous blocks (PETSc's MPIAIJ).

Rank r owns the global rows ``[row_starts[r], row_starts[r + 1])`` and the
entries ``[col_starts[r], col_starts[r + 1])`` of the vectors ``A @ x`` reads
(for a square matrix the two partitions are the same). Its rows are kept as two
scipy CSR blocks:

* ``diag``: the columns this rank owns, indexed locally (``col - col_start``);
* ``off``: the other ("ghost") columns, compressed to ``0..len(ghosts)-1``,
  ``ghosts`` holding their sorted global indices.

``A @ x`` posts the neighbour-only ghost exchange (planned once, at
construction, ``ghost.py``), multiplies ``diag`` while it travels, then adds
``off`` times the ghosts. Building a DistCSR is collective over its group;
``@`` is collective among neighbours.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from hpcmac.comm.base import Group
from hpcmac.linalg.sparse import rows as rowpart
from hpcmac.linalg.sparse.ghost import GhostPlan
from hpcmac.linalg.vectors import BlockVector

try:  # the kernels behind scipy's own `csr @ vector`: they accumulate into y, no temporaries
    from scipy.sparse._sparsetools import csc_matvec as _csc_matvec
    from scipy.sparse._sparsetools import csr_matvec as _csr_matvec
except ImportError:  # pragma: no cover - a scipy that moved them
    _csr_matvec = _csc_matvec = None


def agree(group: Group, message: str | None) -> None:
    """Collective: raise ``ValueError`` on every rank with the first rank's message, if any."""
    msgs = group.allgather_obj(message)
    first = next((m for m in msgs if m), None)
    if first:
        raise ValueError(first)


def _index_dtype(n: int):
    return np.int32 if n < 2**31 - 1 else np.int64


def _gemv(a: sp.csr_matrix, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a @ x`` in place."""
    if a.nnz == 0:
        return
    if _csr_matvec is not None and a.dtype == x.dtype == y.dtype:
        _csr_matvec(a.shape[0], a.shape[1], a.indptr, a.indices, a.data, x, y)
    else:
        y += a @ x


def _gemv_t(a: sp.csr_matrix, x: np.ndarray, y: np.ndarray) -> None:
    """``y += a.T @ x`` in place (a's CSR arrays read as the CSC arrays of a.T)."""
    if a.nnz == 0:
        return
    if _csc_matvec is not None and a.dtype == x.dtype == y.dtype:
        _csc_matvec(a.shape[1], a.shape[0], a.indptr, a.indices, a.data, x, y)
    else:
        y += a.T @ x


class DistCSR:
    """A distributed CSR matrix. ``diag``, ``off``, ``ghosts`` are local; the rest global."""

    __array_priority__ = 20.0  # ndarray @ DistCSR defers to us

    def __init__(self, local_rows: sp.spmatrix, shape: tuple[int, int], row_starts, col_starts,
                 group: Group):
        """Collective: this rank's rows ((nlocal, N) scipy matrix, global columns), split, planned.

        Prefer the constructors (``from_scipy``, ``from_rows``, ``from_coo``,
        ``mmread``, ``read_hdf5``), which check their input.
        """
        self.group = group
        self.shape = (int(shape[0]), int(shape[1]))
        self.row_starts = tuple(int(v) for v in row_starts)
        self.col_starts = tuple(int(v) for v in col_starts)
        me = group.rank
        r0, r1 = self.row_starts[me], self.row_starts[me + 1]
        c0, c1 = self.col_starts[me], self.col_starts[me + 1]
        csr = sp.csr_matrix(local_rows)
        csr.sum_duplicates()  # also sorts the column indices
        nloc = r1 - r0
        cols = csr.indices.astype(np.int64, copy=False)
        rowid = np.repeat(np.arange(nloc), np.diff(csr.indptr))
        mine = (cols >= c0) & (cols < c1)
        self.dtype = csr.dtype
        self.ghosts = np.unique(cols[~mine])
        self.diag = self._block(rowid[mine], cols[mine] - c0, csr.data[mine], nloc, c1 - c0)
        off_cols = np.searchsorted(self.ghosts, cols[~mine])
        self.off = self._block(rowid[~mine], off_cols, csr.data[~mine], nloc, self.ghosts.size)
        self.plan = GhostPlan(self.ghosts, self.col_starts, group)
        self._gbuf: dict = {}
        self._offc = None

    @staticmethod
    def _block(rowid, cols, data, nrows, ncols) -> sp.csr_matrix:
        """CSR from entries already in row order (columns sorted within rows): no sort."""
        it = _index_dtype(max(ncols, data.size))
        indptr = np.zeros(nrows + 1, dtype=it)
        np.cumsum(np.bincount(rowid, minlength=nrows), out=indptr[1:])
        return sp.csr_matrix((np.ascontiguousarray(data), cols.astype(it), indptr),
                             shape=(nrows, ncols))

    def _like(self, diag: sp.csr_matrix, off: sp.csr_matrix) -> DistCSR:
        """The same layout and plan with other values (not collective)."""
        out = object.__new__(DistCSR)
        out.__dict__.update(self.__dict__)
        out.diag, out.off, out.dtype, out._gbuf, out._offc = diag, off, diag.dtype, {}, None
        return out

    def _off_compressed(self) -> tuple[np.ndarray, sp.csr_matrix]:
        """(rows with ghost entries, ``off`` restricted to them): few rows touch ghosts, and a
        kernel over all of ``off``'s rows would walk every local row (PETSc's compressed rows)."""
        if self._offc is None:
            rows = np.flatnonzero(np.diff(self.off.indptr))
            self._offc = (rows, sp.csr_matrix(self.off[rows]))
        return self._offc

    # -- sizes --------------------------------------------------------------------
    @property
    def lrange(self) -> tuple[int, int]:
        """This rank's global rows ``[start, stop)``."""
        r = self.group.rank
        return self.row_starts[r], self.row_starts[r + 1]

    @property
    def lcols(self) -> tuple[int, int]:
        """This rank's piece ``[start, stop)`` of the vectors ``A @ x`` takes."""
        r = self.group.rank
        return self.col_starts[r], self.col_starts[r + 1]

    @property
    def row_counts(self) -> tuple[int, ...]:
        return tuple(np.diff(self.row_starts).tolist())

    @property
    def col_counts(self) -> tuple[int, ...]:
        return tuple(np.diff(self.col_starts).tolist())

    @property
    def nnz(self) -> int:
        """Collective: the number of stored entries, all ranks."""
        n = np.array([self.diag.nnz + self.off.nnz], dtype=np.int64)
        return int(self.group.allreduce(n)[0])

    @property
    def T(self) -> Transposed:  # noqa: N802 - scipy's name
        return Transposed(self)

    def __repr__(self) -> str:
        return (f"<DistCSR {self.shape[0]}x{self.shape[1]} {self.dtype} rank {self.group.rank}"
                f"/{self.group.size}: rows {self.lrange}, {self.diag.nnz}+{self.off.nnz} local "
                f"entries, {self.ghosts.size} ghosts>")

    # -- vectors in this matrix's layouts -------------------------------------------
    def vector(self, values=None, side: str = "cols", dtype=None) -> BlockVector:
        """Not collective: a BlockVector split as ``A @ x`` needs (``side="cols"``) or
        as it returns (``"rows"``); ``values`` is the whole vector (on every rank), a
        function of the global indices, or None for zeros."""
        starts = self.col_starts if side == "cols" else self.row_starts
        counts = tuple(np.diff(starts).tolist())
        me = self.group.rank
        lo, hi = starts[me], starts[me + 1]
        if values is None:
            local = np.zeros(hi - lo, dtype=dtype or self.dtype)
        elif callable(values):
            local = np.asarray(values(np.arange(lo, hi)), dtype=dtype)
        else:
            values = np.asarray(values, dtype=dtype)
            if values.shape != (starts[-1],):
                raise ValueError(f"values has shape {values.shape}, expected ({starts[-1]},)")
            local = values[lo:hi].copy()
        return BlockVector(np.ascontiguousarray(local), starts[-1], counts, self.group)

    def _as_local(self, x, starts, name: str) -> tuple[np.ndarray, bool]:
        """(this rank's piece of x, was x a BlockVector); ValueError naming ``x``."""
        n = starts[-1]
        counts = tuple(np.diff(starts).tolist())
        if isinstance(x, BlockVector):
            if x.n != n:
                raise ValueError(f"{name} has length {x.n}, the matrix needs {n}")
            if tuple(x.counts) != counts:
                raise ValueError(f"{name} is split {list(x.counts)} but the matrix needs "
                                 f"{list(counts)}: build it with A.vector(...)")
            return x.local, True
        x = np.asarray(x)
        if x.ndim == 2 and x.shape[1] == 1:
            x = x[:, 0]
        if x.shape != (n,):
            raise ValueError(f"{name} has shape {x.shape}, the matrix needs ({n},)")
        me = self.group.rank
        return x[starts[me]: starts[me + 1]], False

    # -- products -----------------------------------------------------------------------
    def _ghost_buffer(self, dtype) -> np.ndarray:
        buf = self._gbuf.get(dtype)
        if buf is None:
            buf = self._gbuf[dtype] = np.empty(self.ghosts.size, dtype=dtype)
        return buf

    def matvec(self, x_local: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Collective among neighbours: this rank's rows of ``A @ x`` from its piece of x."""
        dtype = np.result_type(self.dtype, x_local.dtype)
        x_local = np.ascontiguousarray(x_local, dtype=dtype)
        if out is None:
            out = np.zeros(self.diag.shape[0], dtype=dtype)
        else:
            out.fill(0)
        g = self._ghost_buffer(dtype)
        reqs = self.plan.start(x_local, g)
        _gemv(self.diag, x_local, out)        # while the ghosts travel
        self.plan.finish(reqs)
        rows, offc = self._off_compressed()
        if offc.nnz:
            part = np.zeros(rows.size, dtype=dtype)
            _gemv(offc, g, part)
            out[rows] += part
        return out

    def rmatvec(self, x_local: np.ndarray) -> np.ndarray:
        """Collective among neighbours: this rank's piece of ``A.T @ x`` (x split as the rows)."""
        dtype = np.result_type(self.dtype, x_local.dtype)
        x_local = np.ascontiguousarray(x_local, dtype=dtype)
        g = np.zeros(self.ghosts.size, dtype=dtype)
        rows, offc = self._off_compressed()
        if offc.nnz:
            _gemv_t(offc, np.ascontiguousarray(x_local[rows]), g)
        pending = self.plan.reverse_start(g)
        y = np.zeros(self.diag.shape[1], dtype=dtype)
        _gemv_t(self.diag, x_local, y)        # while the ghost sums travel
        self.plan.reverse_finish(pending, y)
        return y

    def _apply(self, x, transpose: bool):
        src, dst = (self.row_starts, self.col_starts) if transpose else \
            (self.col_starts, self.row_starts)
        xl, was_block = self._as_local(x, src, "x")
        yl = self.rmatvec(xl) if transpose else self.matvec(xl)
        y = BlockVector(yl, dst[-1], tuple(np.diff(dst).tolist()), self.group)
        return y if was_block else y.allgather()

    def __matmul__(self, other):
        if isinstance(other, DistCSR):
            from hpcmac.linalg.sparse.spgemm import spgemm

            return spgemm(self, other)
        return self._apply(other, transpose=False)

    def dot(self, other):
        return self @ other

    # -- entries ---------------------------------------------------------------------------
    def local_rows(self) -> sp.csr_matrix:
        """Not collective: this rank's rows as a (nlocal, N) CSR with global columns."""
        c0 = self.lcols[0]
        cmap = np.concatenate([np.arange(c0, c0 + self.diag.shape[1]), self.ghosts])
        both = sp.hstack([self.diag, self.off], format="csr")
        out = sp.csr_matrix((both.data, cmap[both.indices], both.indptr),
                            shape=(self.diag.shape[0], self.shape[1]))
        out.sort_indices()
        return out

    def to_scipy(self) -> sp.csr_matrix:
        """Collective: the whole matrix on every rank (tests and small matrices only)."""
        parts = self.group.allgather_obj(self.local_rows())
        return sp.vstack(parts, format="csr") if parts else sp.csr_matrix(self.shape)

    def diagonal(self) -> BlockVector:
        """Not collective: the main diagonal (length min(M, N)), split as the rows."""
        m = min(self.shape)
        starts = tuple(min(s, m) for s in self.row_starts)
        r0, r1 = starts[self.group.rank], starts[self.group.rank + 1]
        c0, c1 = self.lcols
        if r0 >= c0 and r1 <= c1:
            d = self.diag.diagonal(k=r0 - c0)[: r1 - r0]
        else:
            d = self.local_rows().diagonal(k=r0)[: r1 - r0]
        d = np.ascontiguousarray(d, dtype=self.dtype)
        return BlockVector(d, m, tuple(np.diff(starts).tolist()), self.group)

    def redistribute(self, row_starts, col_starts=None) -> DistCSR:
        """Collective: the same matrix with other row (and column) partitions."""
        from hpcmac.linalg.sparse.build import assemble

        rows = rowpart.check(row_starts, self.shape[0], self.group.size)
        if col_starts is None:
            col_starts = rows if self.shape[0] == self.shape[1] else self.col_starts
        cols = rowpart.check(col_starts, self.shape[1], self.group.size, "col_starts")
        if rows == self.row_starts and cols == self.col_starts:
            return self
        coo = self.local_rows().tocoo()
        r0 = self.lrange[0]
        return assemble(coo.row + r0, coo.col, coo.data, self.shape, self.group, rows, cols)

    def transpose(self) -> DistCSR:
        """Collective: ``A.T`` formed (rows partitioned as A's columns; entries move)."""
        from hpcmac.linalg.sparse.build import assemble

        coo = self.local_rows().tocoo()
        return assemble(coo.col, coo.row + self.lrange[0], coo.data, self.shape[::-1],
                        self.group, self.col_starts, self.row_starts)

    # -- arithmetic --------------------------------------------------------------------------
    def __mul__(self, alpha):
        if not np.isscalar(alpha):
            return NotImplemented
        return self._like(self.diag * alpha, self.off * alpha)

    __rmul__ = __mul__

    def __truediv__(self, alpha):
        if not np.isscalar(alpha):
            return NotImplemented
        return self * (1.0 / alpha)

    def __neg__(self):
        return self * -1

    def __add__(self, other):
        return self._combine(other, 1)

    def __sub__(self, other):
        return self._combine(other, -1)

    def _combine(self, other, sign) -> DistCSR:
        if not isinstance(other, DistCSR):
            return NotImplemented
        if other.shape != self.shape:
            raise ValueError(f"B has shape {other.shape}, A has {self.shape}")
        if other.group.size != self.group.size:
            raise ValueError("B lives on another group than A")
        other = other.redistribute(self.row_starts, self.col_starts)
        same = other.ghosts.size == self.ghosts.size and np.array_equal(other.ghosts, self.ghosts) \
            and _same_pattern(self.diag, other.diag) and _same_pattern(self.off, other.off)
        same = self.group.allreduce(np.array([1 if same else 0]), op="min")[0] == 1
        if same:  # every rank keeps the plan, or every rank builds a new one
            return self._like(self.diag + sign * other.diag, self.off + sign * other.off)
        local = self.local_rows() + sign * other.local_rows()
        return DistCSR(local, self.shape, self.row_starts, self.col_starts, self.group)


def _same_pattern(a: sp.csr_matrix, b: sp.csr_matrix) -> bool:
    return a.nnz == b.nnz and np.array_equal(a.indptr, b.indptr) and \
        np.array_equal(a.indices, b.indices)


class Transposed:
    """``A.T``: a view whose ``@`` is A's transpose product (no copy of the matrix)."""

    def __init__(self, a: DistCSR):
        self.a = a
        self.shape = (a.shape[1], a.shape[0])
        self.dtype = a.dtype

    @property
    def T(self) -> DistCSR:  # noqa: N802
        return self.a

    def matvec(self, x_local: np.ndarray) -> np.ndarray:
        return self.a.rmatvec(x_local)

    def __matmul__(self, other):
        if isinstance(other, DistCSR):
            raise ValueError("A.T @ B: form the transpose with A.transpose() first")
        return self.a._apply(other, transpose=True)

    def __repr__(self) -> str:
        return f"<transpose of {self.a!r}>"
