"""BlockVector: a length-n vector cut into contiguous pieces, one per rank of a group.

This is the vector type of the iterative solvers: rank r holds entries
``[offset, offset + len(local))`` in ``local``, the natural layout of a
domain decomposition (a slab of grid points per rank). By default the pieces
are as even as possible, the first ``n % size`` ranks one entry longer; any
split is allowed (``from_local``). Dense operators take the block-cyclic
DistMatrix; an N×1 DistMatrix converts with ``from_distmatrix``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpcmac.comm.base import Group


def block_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """Global half-open range ``[start, stop)`` of rank ``rank``'s piece in the even split. Pure."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass
class BlockVector:
    """``local`` is local; ``n``, ``counts`` (each rank's piece length), ``group`` are global."""

    local: np.ndarray
    n: int
    counts: tuple[int, ...]
    group: Group

    @property
    def offset(self) -> int:
        """Global index of ``local[0]``."""
        return int(sum(self.counts[: self.group.rank]))

    @property
    def dtype(self) -> np.dtype:
        return self.local.dtype

    @property
    def indices(self) -> np.ndarray:
        """Global indices of the local entries."""
        o = self.offset
        return np.arange(o, o + self.local.size, dtype=np.int64)

    # -- constructors -----------------------------------------------------------
    @classmethod
    def zeros(cls, n: int, group: Group, dtype=np.float64) -> BlockVector:
        """Not collective: zeros in the even split."""
        counts = tuple(block_range(n, group.size, r)[1] - block_range(n, group.size, r)[0]
                       for r in range(group.size))
        return cls(np.zeros(counts[group.rank], dtype=dtype), n, counts, group)

    @classmethod
    def from_function(cls, f: Callable[[np.ndarray], np.ndarray], n: int, group: Group,
                      dtype=np.float64) -> BlockVector:
        """Not collective: ``f(global_indices)`` fills this rank's piece (even split)."""
        out = cls.zeros(n, group, dtype)
        if out.local.size:
            out.local[...] = f(out.indices)
        return out

    @classmethod
    def from_global(cls, x: np.ndarray, group: Group) -> BlockVector:
        """Not collective: this rank's piece of ``x`` (the whole vector, on every rank)."""
        x = np.asarray(x)
        if x.ndim != 1:
            raise ValueError(f"BlockVector.from_global needs a 1-D array, got shape {x.shape}")
        start, stop = block_range(x.size, group.size, group.rank)
        out = cls.zeros(x.size, group, x.dtype)
        out.local[...] = x[start:stop]
        return out

    @classmethod
    def from_local(cls, local: np.ndarray, group: Group) -> BlockVector:
        """Collective: wrap each rank's own piece (any lengths, in rank order)."""
        local = np.ascontiguousarray(local).reshape(-1)
        counts = tuple(int(c) for c in group.allgather_obj(local.size))
        return cls(local, int(sum(counts)), counts, group)

    @classmethod
    def from_distmatrix(cls, d, group: Group | None = None) -> BlockVector:
        """Collective over ``d.grid``: an (n, 1) DistMatrix as a BlockVector over its ranks."""
        if d.gshape[1] != 1:
            raise ValueError(f"from_distmatrix needs an (n, 1) DistMatrix, got {d.gshape}")
        full = d.allgather()
        return cls.from_global(full[:, 0], group or d.grid.all)

    def like(self, local: np.ndarray) -> BlockVector:
        """A BlockVector with this one's split and ``local`` as its piece."""
        return BlockVector(local, self.n, self.counts, self.group)

    def copy(self) -> BlockVector:
        return self.like(self.local.copy())

    # -- reductions and whole-vector views ---------------------------------------
    def dot(self, other: BlockVector) -> complex | float:
        """Collective: ``vdot(self, other)`` (conjugates ``self``), the same on every rank."""
        s = np.array([np.vdot(self.local, other.local)])
        return self.group.allreduce(s)[0].item()

    def norm(self) -> float:
        """Collective: the 2-norm."""
        s = np.array([np.vdot(self.local, self.local).real])
        return float(np.sqrt(self.group.allreduce(s)[0]))

    def allgather(self) -> np.ndarray:
        """Collective: the whole vector on every rank."""
        width = max(self.counts) if self.counts else 0
        buf = np.zeros(width, dtype=self.dtype)
        buf[: self.local.size] = self.local
        parts = self.group.allgather(buf)
        return np.concatenate([parts[r, :c] for r, c in enumerate(self.counts)]) if width else \
            np.zeros(0, dtype=self.dtype)

    def gather(self, root: int = 0) -> np.ndarray | None:
        """Collective: the whole vector on ``root``, None elsewhere."""
        full = self.allgather()
        return full if self.group.rank == root else None
