"""The sweep both HPL drivers share: every grid, N, NB and variant of an HPL.dat, in
xhpl's order, each run reported as it ends.

:class:`Sweep` walks the combinations (grids too big for the job are skipped
with a note; ranks beyond P*Q sit idle), writes HPL.out's header, the results
header and footer, hands each run's results to ``on_result`` and checks every
output took them. A driver (``hpcmac.hpl.driver.Driver``,
``hpcmac.hpl_mxp.driver.Driver``) gives the header and one run (``_one``).
Collective calls say so; everything else is local.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, TextIO

from hpcmac.comm.base import Group
from hpcmac.comm.grid import Grid
from hpcmac.hpl.config import HPLConfig, Variant
from hpcmac.hpl.report import footer, results_header


class Sweep(abc.ABC):
    """Every combination of an HPLConfig on a world group (collective: every rank).

    ``out`` is the HPL.out stream on world rank 0 (None elsewhere); ``notes`` takes
    rank 0's notes (skipped grids); ``on_result(results)`` runs on rank 0 after
    each run (the ``--json`` writer).
    """

    def __init__(self, world: Group, cfg: HPLConfig, out: TextIO | None,
                 show_progress: bool = False, notes: TextIO | None = None,
                 on_result: Callable[[list[Any]], None] | None = None):
        self.world, self.cfg, self.out = world, cfg, out
        self.show_progress = show_progress and world.rank == 0
        self.notes = notes
        self.on_result = on_result
        self.results: list[Any] = []
        self.kpass = self.kfail = self.kskip = 0

    # -- what a driver gives ------------------------------------------------
    @abc.abstractmethod
    def header(self) -> str:
        """HPL.out's opening block."""

    def results_header_due(self, first: bool) -> bool:
        """Whether the T/V results header goes before this run (every run by default)."""
        return True

    @abc.abstractmethod
    def _one(self, grid: Grid, n: int, nb: int, v: Variant) -> None:
        """Collective over ``grid.all``: one run, counted, written and reported."""

    # -- the sweep ------------------------------------------------------------
    def _write(self, text: str) -> None:
        if self.out is not None and text:
            self.out.write(text)
            self.out.flush()

    def _report(self, grid: Grid) -> None:
        """Collective over the grid: hand the results to ``on_result`` (rank 0) and check
        that every output took them; a failed write (a full disk) is then one line on
        every rank at once, not rank 0's abort."""
        from hpcmac.io.outputs import OutputError

        err = None
        if self.world.rank == 0:
            try:
                if self.on_result is not None:
                    self.on_result(self.results)
            except OutputError as exc:
                err = str(exc)
            err = err or getattr(self.out, "error", None)
        err = grid.all.bcast_obj(err, 0)
        if err:
            raise OutputError(err, local=False)

    def _note(self, text: str) -> None:
        if self.world.rank == 0 and self.notes is not None:
            self.notes.write(f"note: {text}\n")
            self.notes.flush()

    def run(self) -> int:
        """Collective: all runs; returns the number of runs that FAILED."""
        cfg, world = self.cfg, self.world
        self._write(self.header())
        per_grid = len(cfg.ns) * len(cfg.nbs) * sum(1 for _ in cfg.variants())
        first = True
        for p, q in cfg.grids:
            if p * q > world.size:
                self._note(f"grid {p}x{q} needs {p * q} ranks, have {world.size}: skipped")
                self.kskip += per_grid
                continue
            grid = Grid(world, p, q, order="col" if cfg.pmap == 1 else "row")
            if not grid.in_grid:
                continue  # idle for this grid
            for n in cfg.ns:
                for nb in cfg.nbs:
                    for v in cfg.variants():
                        if self.results_header_due(first):
                            self._write(results_header())
                        first = False
                        self._one(grid, n, nb, v)
        self._write(footer(self.kpass, self.kfail, self.kskip, cfg.threshold))
        return self.kfail
