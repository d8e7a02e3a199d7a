"""DistMatrix: an M×N matrix in 2-D block-cyclic layout over a process grid.

Each rank of the grid holds ``local``, its (lm, ln) piece in Fortran order
(columns contiguous, as ScaLAPACK and HPL store them): rows are cut into
``mb``-blocks dealt cyclically over the P process rows, columns into
``nb``-blocks over the Q process columns, block (0, 0) on grid position (0, 0).
Ranks outside the grid hold an empty (0, 0) piece and take no part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpcmac.comm.grid import Grid
from hpcmac.linalg import layout


@dataclass
class DistMatrix:
    """``local`` is local; ``gshape``, ``mb``, ``nb``, ``grid`` are global (agree on all ranks)."""

    local: np.ndarray
    gshape: tuple[int, int]
    mb: int
    nb: int
    grid: Grid

    @property
    def dtype(self) -> np.dtype:
        return self.local.dtype

    @property
    def lshape(self) -> tuple[int, int]:
        return self.local.shape  # type: ignore[return-value]

    @property
    def rows(self) -> np.ndarray:
        """Global row indices of the local rows (local order)."""
        g = self.grid
        if not g.in_grid:
            return np.zeros(0, dtype=np.int64)
        return layout.global_indices(self.gshape[0], self.mb, g.myrow, g.nprow)

    @property
    def cols(self) -> np.ndarray:
        """Global column indices of the local columns (local order)."""
        g = self.grid
        if not g.in_grid:
            return np.zeros(0, dtype=np.int64)
        return layout.global_indices(self.gshape[1], self.nb, g.mycol, g.npcol)

    # -- constructors ---------------------------------------------------------
    @classmethod
    def empty(cls, shape, grid: Grid, mb: int, nb: int, dtype=np.float64) -> DistMatrix:
        """Not collective: uninitialised local storage for this rank's piece."""
        m, n = (int(s) for s in shape)
        if m < 0 or n < 0 or mb < 1 or nb < 1:
            raise ValueError(f"bad layout: shape {shape}, blocks {mb}x{nb}")
        if grid.in_grid:
            lm = layout.numroc(m, mb, grid.myrow, grid.nprow)
            ln = layout.numroc(n, nb, grid.mycol, grid.npcol)
        else:
            lm = ln = 0
        return cls(np.empty((lm, ln), dtype=dtype, order="F"), (m, n), mb, nb, grid)

    @classmethod
    def zeros(cls, shape, grid: Grid, mb: int, nb: int, dtype=np.float64) -> DistMatrix:
        out = cls.empty(shape, grid, mb, nb, dtype)
        out.local[...] = 0
        return out

    @classmethod
    def from_function(
        cls,
        f: Callable[[np.ndarray, np.ndarray], np.ndarray],
        shape,
        grid: Grid,
        mb: int,
        nb: int,
        dtype=np.float64,
    ) -> DistMatrix:
        """Not collective: ``f(i, j)`` gets global row indices (lm, 1) and columns (1, ln)
        and returns this rank's entries; no rank ever holds the whole matrix."""
        out = cls.empty(shape, grid, mb, nb, dtype)
        if out.local.size:
            out.local[...] = f(out.rows[:, None], out.cols[None, :])
        return out

    @classmethod
    def from_global(cls, a: np.ndarray | None, grid: Grid, mb: int, nb: int,
                    root: int = 0) -> DistMatrix:
        """Collective over the grid: scatter ``a`` (significant on grid rank ``root`` only)."""
        group = grid.all
        if not grid.in_grid:
            return cls(np.zeros((0, 0)), (0, 0), mb, nb, grid)
        mine = (np.shape(a), np.asarray(a).dtype.str) if group.rank == root else None
        meta = group.bcast_obj(mine, root)
        shape, dtype = meta
        if len(shape) != 2:
            raise ValueError(f"from_global needs a 2-D array, got shape {shape}")
        out = cls.empty(shape, grid, mb, nb, np.dtype(dtype))
        if group.rank == root:
            a = np.asarray(a)
            reqs = []
            for r in range(group.size):
                pr, pc = grid.coords(r)
                rows = layout.global_indices(shape[0], mb, pr, grid.nprow)
                cols = layout.global_indices(shape[1], nb, pc, grid.npcol)
                piece = np.ascontiguousarray(a[np.ix_(rows, cols)].ravel(order="F"))
                if r == root:
                    out.local[...] = piece.reshape(out.lshape, order="F")
                elif piece.size:
                    reqs.append((group.isend(piece, r, tag=17), piece))
            for req, _ in reqs:
                req.wait()
        elif out.local.size:
            buf = np.empty(out.local.size, dtype=out.dtype)
            group.recv(buf, root, tag=17)
            out.local[...] = buf.reshape(out.lshape, order="F")
        return out

    # -- whole-matrix views -----------------------------------------------------
    def gather(self, root: int = 0) -> np.ndarray | None:
        """Collective over the grid: the global matrix on grid rank ``root``, None elsewhere."""
        grid, group = self.grid, self.grid.all
        if not grid.in_grid:
            return None
        m, n = self.gshape
        if group.rank != root:
            if self.local.size:
                group.send(np.ascontiguousarray(self.local.ravel(order="F")), root, tag=18)
            return None
        out = np.empty((m, n), dtype=self.dtype)
        for r in range(group.size):
            pr, pc = grid.coords(r)
            rows = layout.global_indices(m, self.mb, pr, grid.nprow)
            cols = layout.global_indices(n, self.nb, pc, grid.npcol)
            if r == root:
                piece = self.local
            else:
                if rows.size == 0 or cols.size == 0:
                    continue
                buf = np.empty(rows.size * cols.size, dtype=self.dtype)
                group.recv(buf, r, tag=18)
                piece = buf.reshape((rows.size, cols.size), order="F")
            out[np.ix_(rows, cols)] = piece
        return out

    def allgather(self) -> np.ndarray | None:
        """Collective over the grid: the global matrix on every grid rank."""
        full = self.gather(0)
        if not self.grid.in_grid:
            return None
        if full is None:
            full = np.empty(self.gshape, dtype=self.dtype)
        return self.grid.all.bcast(full, 0)

    def copy(self) -> DistMatrix:
        return DistMatrix(self.local.copy(order="F"), self.gshape, self.mb, self.nb, self.grid)

    # -- more constructors and layout changes ---------------------------------
    @classmethod
    def eye(cls, n: int, grid: Grid, mb: int, nb: int, m: int | None = None,
            dtype=np.float64) -> DistMatrix:
        """Not collective: the ``n``×``m`` identity (``m`` defaults to ``n``)."""
        m = n if m is None else m
        return cls.from_function(lambda i, j: (i == j), (n, m), grid, mb, nb, dtype)

    def astype(self, dtype) -> DistMatrix:
        """Not collective: a copy with local entries converted to ``dtype``."""
        return DistMatrix(self.local.astype(dtype, order="F"), self.gshape, self.mb, self.nb,
                          self.grid)

    @property
    def shape(self) -> tuple[int, int]:
        """The global shape (same as ``gshape``), as numpy arrays name it."""
        return self.gshape

    def owner(self, i: int, j: int) -> tuple[int, int]:
        """Grid position (prow, pcol) that holds global entry (i, j)."""
        return (int(layout.owner(i, self.mb, self.grid.nprow)),
                int(layout.owner(j, self.nb, self.grid.npcol)))

    def g2l(self, i: int, j: int) -> tuple[int, int]:
        """Local index of global entry (i, j) on its owner (see ``owner``)."""
        return (int(layout.g2l(i, self.mb, self.grid.nprow)),
                int(layout.g2l(j, self.nb, self.grid.npcol)))

    def l2g(self, li: int, lj: int) -> tuple[int, int]:
        """Global index of this rank's local entry (li, lj)."""
        g = self.grid
        return (int(layout.l2g(li, self.mb, g.myrow, g.nprow)),
                int(layout.l2g(lj, self.nb, g.mycol, g.npcol)))

    def redistribute(self, grid: Grid | None = None, mb: int | None = None,
                     nb: int | None = None) -> DistMatrix:
        """Collective: the same matrix in another block-cyclic layout.

        ``grid`` (default: this one), ``mb``, ``nb`` (default: this matrix's)
        are global. On the same grid, only its ranks call. Onto another grid
        (built over the same group) every rank of the group calls; ranks in
        neither grid get an empty piece.
        """
        from hpcmac.linalg.remap import remap

        return remap(self, grid or self.grid, mb or self.mb, nb or self.nb, transpose=False)

    def transpose(self, conj: bool = False) -> DistMatrix:
        """Collective over the grid: ``self.T`` (``conj``: ``self.conj().T``) on the same grid,
        with ``mb`` and ``nb`` swapped."""
        from hpcmac.linalg.remap import remap

        out = remap(self, self.grid, self.nb, self.mb, transpose=True)
        if conj and np.iscomplexobj(out.local):
            np.conjugate(out.local, out=out.local)
        return out

    @property
    def T(self) -> DistMatrix:
        """Collective: ``transpose()``."""
        return self.transpose()

    def conj(self) -> DistMatrix:
        """Not collective: the complex conjugate (a copy), same layout."""
        return DistMatrix(np.asfortranarray(np.conjugate(self.local)), self.gshape, self.mb,
                          self.nb, self.grid)

    # -- arithmetic as numpy (hpcmac.linalg.arith) ------------------------------
    # numpy must hand ``ndarray <op> DistMatrix`` to our reflected methods
    __array_ufunc__ = None

    def __matmul__(self, other):
        """Collective: ``matmul`` (SUMMA) for a DistMatrix, else the product with an
        ndarray held whole on every rank, returned whole on every grid rank."""
        from hpcmac.linalg import arith
        from hpcmac.linalg.summa import matmul

        if isinstance(other, DistMatrix):
            return matmul(self, other)
        if isinstance(other, (np.ndarray, list, tuple)):
            return arith.matmul_dense(self, other)
        return NotImplemented

    def __rmatmul__(self, other):
        from hpcmac.linalg import arith

        if isinstance(other, (np.ndarray, list, tuple)):
            return arith.matmul_dense(self, other, reflected=True)
        return NotImplemented

    def _elementwise(self, other, name: str, reflected: bool = False):
        from hpcmac.linalg import arith

        return arith.elementwise(self, other, name, reflected)

    def __add__(self, other):
        """Elementwise, as numpy: ``other`` a scalar, an ndarray broadcasting to the global
        shape (the same on every rank) or a DistMatrix of this shape on this grid."""
        return self._elementwise(other, "add")

    def __radd__(self, other):
        return self._elementwise(other, "add", True)

    def __sub__(self, other):
        return self._elementwise(other, "sub")

    def __rsub__(self, other):
        return self._elementwise(other, "sub", True)

    def __mul__(self, other):
        return self._elementwise(other, "mul")

    def __rmul__(self, other):
        return self._elementwise(other, "mul", True)

    def __truediv__(self, other):
        return self._elementwise(other, "truediv")

    def __rtruediv__(self, other):
        return self._elementwise(other, "truediv", True)

    def __neg__(self) -> DistMatrix:
        return DistMatrix(np.asfortranarray(-self.local), self.gshape, self.mb, self.nb,
                          self.grid)

    def __pos__(self) -> DistMatrix:
        return self.copy()
