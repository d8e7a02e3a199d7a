"""A P×Q process grid over a Group, with row and column sub-groups.

Grid coordinates are (myrow, mycol) with 0 <= myrow < P, 0 <= mycol < Q.
``order="row"`` places rank r at (r // Q, r % Q) (netlib HPL's PMAP 0 is
row-major); ``order="col"`` at (r % P, r // P). Ranks beyond P*Q are not in
the grid (``in_grid`` False); they must not call the grid's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hpcmac.comm.base import Group


@dataclass
class Grid:
    """Collective to build: every rank of ``group`` constructs it with the same P, Q, order."""

    group: Group
    nprow: int
    npcol: int
    order: str = "row"
    myrow: int = field(init=False, default=-1)
    mycol: int = field(init=False, default=-1)
    in_grid: bool = field(init=False, default=False)
    all: Group | None = field(init=False, default=None, repr=False)
    row: Group | None = field(init=False, default=None, repr=False)
    col: Group | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.nprow < 1 or self.npcol < 1:
            raise ValueError(f"grid must be at least 1x1, got {self.nprow}x{self.npcol}")
        if self.order not in ("row", "col"):
            raise ValueError(f"grid order must be 'row' or 'col', got {self.order!r}")
        if self.nprow * self.npcol > self.group.size:
            raise ValueError(
                f"grid {self.nprow}x{self.npcol} needs {self.nprow * self.npcol} ranks, "
                f"have {self.group.size}"
            )
        r = self.group.rank
        self.in_grid = r < self.nprow * self.npcol
        if self.in_grid:
            self.myrow, self.mycol = self.coords(r)
        # every rank of the group takes part in the splits, idle ranks with color 1
        inside = 0 if self.in_grid else 1
        self.all = self.group.split(inside, r)
        self.row = self.group.split(self.myrow if self.in_grid else 10**6, self.mycol)
        self.col = self.group.split(self.mycol if self.in_grid else 10**6, self.myrow)

    @property
    def shape(self) -> tuple[int, int]:
        return self.nprow, self.npcol

    def coords(self, rank: int) -> tuple[int, int]:
        """(prow, pcol) of a rank of the grid."""
        if self.order == "row":
            return divmod(rank, self.npcol)
        pcol, prow = divmod(rank, self.nprow)
        return prow, pcol

    def rank_of(self, prow: int, pcol: int) -> int:
        """Rank (in ``group``) of grid position (prow, pcol)."""
        if self.order == "row":
            return prow * self.npcol + pcol
        return pcol * self.nprow + prow
