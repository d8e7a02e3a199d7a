"""Block-cyclic index math (ScaLAPACK semantics), pure: no communication.

One dimension of size ``n`` is cut into blocks of ``nb``; block ``k`` lives on
process ``(k + isrc) % nprocs``. All functions accept Python ints or numpy
integer arrays for the index arguments. ``g`` is a *global* index (agrees on
all ranks), ``l`` a *local* index (meaningful on the owning process only).
"""

from __future__ import annotations

import numpy as np


def numroc(n: int, nb: int, iproc: int, nprocs: int, isrc: int = 0) -> int:
    """Number of rows (or columns) of an ``n``-long dimension that process ``iproc`` owns."""
    mydist = (nprocs + iproc - isrc) % nprocs
    nblocks = n // nb
    count = (nblocks // nprocs) * nb
    extra = nblocks % nprocs
    if mydist < extra:
        count += nb
    elif mydist == extra:
        count += n % nb
    return count


def lshape(gshape: tuple[int, int], mb: int, nb: int, prow: int, pcol: int, nprow: int,
           npcol: int) -> tuple[int, int]:
    """Local shape of grid position (prow, pcol)'s piece of a ``gshape`` matrix (mb x nb blocks)."""
    return numroc(gshape[0], mb, prow, nprow), numroc(gshape[1], nb, pcol, npcol)


def owner(g, nb: int, nprocs: int, isrc: int = 0):
    """Process that owns global index ``g``."""
    return (g // nb + isrc) % nprocs


def g2l(g, nb: int, nprocs: int):
    """Local index of global index ``g`` on its owner."""
    return (g // (nb * nprocs)) * nb + g % nb


def l2g(l, nb: int, iproc: int, nprocs: int, isrc: int = 0):
    """Global index of local index ``l`` on process ``iproc``."""
    return ((l // nb) * nprocs + (nprocs + iproc - isrc) % nprocs) * nb + l % nb


def global_indices(n: int, nb: int, iproc: int, nprocs: int, isrc: int = 0) -> np.ndarray:
    """The global indices process ``iproc`` owns, in local order (int64 array)."""
    local = np.arange(numroc(n, nb, iproc, nprocs, isrc), dtype=np.int64)
    return l2g(local, nb, iproc, nprocs, isrc)


def first_local_at_or_after(g: int, nb: int, iproc: int, nprocs: int, isrc: int = 0) -> int:
    """Local index of the first locally owned global index >= ``g`` (the local
    length when none is): where a trailing sub-matrix starting at ``g`` begins
    on process ``iproc`` (ScaLAPACK's ``indxg2l`` + ownership adjustment)."""
    blk = g // nb
    mydist = (nprocs + iproc - isrc) % nprocs
    # full local blocks that lie entirely before block ``blk``
    before = blk // nprocs + (1 if blk % nprocs > mydist else 0)
    if (blk + isrc) % nprocs == iproc:  # g's own block is mine: start inside it
        return before * nb + g % nb
    return before * nb
