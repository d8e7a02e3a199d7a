"""HPL.dat: netlib HPL's 31-line input file, parsed strictly, pure (no MPI).

The format (line: content; lists start with their count on the line before)::

     1-2  free text (title)
       3  output file name             4  device out (6=stdout, 7=stderr, else the file)
       5  number of Ns                 6  Ns (>= 0)
       7  number of NBs                8  NBs (>= 1)
       9  PMAP (0=row-major, 1=column-major process mapping)
      10  number of grids           11-12  Ps, Qs (>= 1)
      13  threshold (residual check; <= 0 skips the check)
   14-15  PFACTs (0=left, 1=Crout, 2=right)       16-17  NBMINs (>= 1)
   18-19  NDIVs (>= 2)                             20-21  RFACTs (0=left, 1=Crout, 2=right)
   22-23  BCASTs (0=1ring 1=1ringM 2=2ring 3=2ringM 4=long 5=longM)
   24-25  DEPTHs (look-ahead: 0 or 1)
      26  SWAP (0=binary-exchange, 1=spread-roll, 2=mix)   27  swapping threshold (>= 0)
      28  L1 form (0=transposed, 1=no-transposed)          29  U form (same codes)
      30  EQUIL (0=no, 1=yes)                              31  ALIGN (in doubles, > 0)

Every value line may carry a comment after its values (netlib's own files do).
Unlike netlib, which maps unknown codes to a default, anything out of range is
a :class:`~hpcmac.errors.UsageError` naming the file, the line and what was
expected. Lines after 31 are ignored, as netlib does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from hpcmac.errors import UsageError
from hpcmac.io.inputs import parse_float, parse_int

#: netlib's HPL_MAX_PARAM: most values a list line may hold
MAX_PARAM = 20
HPL_DAT_LINES = 31
#: largest ALIGN (in doubles): each panel buffer is over-allocated by ALIGN words
MAX_ALIGN = 4096
#: largest integer any line may hold (netlib reads C ints)
MAX_INT = 2**31 - 1

FACT_NAMES = {0: "left", 1: "crout", 2: "right"}
#: letter in the T/V code (netlib HPL_pdtest)
FACT_LETTERS = {0: "L", 1: "C", 2: "R"}
FACT_LABELS = {0: "Left", 1: "Crout", 2: "Right"}
BCAST_NAMES = {0: "1ring", 1: "1ringM", 2: "2ring", 3: "2ringM", 4: "long", 5: "longM"}
BCAST_LABELS = {0: "1ring", 1: "1ringM", 2: "2ring", 3: "2ringM", 4: "Blong", 5: "BlongM"}
SWAP_NAMES = {0: "binexch", 1: "spread", 2: "mix"}
#: look-ahead depths the hpcmac LU implements
DEPTHS = (0, 1)

# HPL.dat written into the package for when no file is given; P and Q are
# filled in from the rank count (see :func:`default_config`).
DEFAULT_N = 6000
DEFAULT_NB = 192
DEFAULT_DAT = """\
HPLinpack benchmark input file
hpcmac embedded default (P x Q chosen from the rank count)
HPL.out      output file name (if any)
6            device out (6=stdout,7=stderr,file)
1            # of problems sizes (N)
{n}         Ns
1            # of NBs
{nb}          NBs
0            PMAP process mapping (0=Row-,1=Column-major)
1            # of process grids (P x Q)
{p}            Ps
{q}            Qs
16.0         threshold
1            # of panel fact
2            PFACTs (0=left, 1=Crout, 2=Right)
1            # of recursive stopping criterium
4            NBMINs (>= 1)
1            # of panels in recursion
2            NDIVs
1            # of recursive panel fact.
1            RFACTs (0=left, 1=Crout, 2=Right)
1            # of broadcast
1            BCASTs (0=1rg,1=1rM,2=2rg,3=2rM,4=Lng,5=LnM)
1            # of lookahead depth
1            DEPTHs (>=0)
2            SWAP (0=bin-exch,1=long,2=mix)
64           swapping threshold
0            L1 in (0=transposed,1=no-transposed) form
0            U  in (0=transposed,1=no-transposed) form
1            Equilibration (0=no,1=yes)
8            memory alignment in double (> 0)
"""


@dataclass(frozen=True)
class Variant:
    """One algorithm combination of an HPL run (global: the same on every rank)."""

    pmap: int  # 0 row-major, 1 column-major
    depth: int
    bcast: int  # 0..5
    rfact: int  # 0 left, 1 Crout, 2 right
    ndiv: int
    pfact: int
    nbmin: int

    @property
    def tv(self) -> str:
        """Netlib's T/V code, e.g. ``WR11C2R4``: wall time, PMAP, DEPTH, BCAST,
        RFACT, NDIV, PFACT, NBMIN (``HPL_pdtest``'s ``W%c%1d%c%c%1d%c%1d``)."""
        return (
            f"W{'C' if self.pmap == 1 else 'R'}{self.depth:1d}{self.bcast:d}"
            f"{FACT_LETTERS[self.rfact]}{self.ndiv:1d}{FACT_LETTERS[self.pfact]}{self.nbmin:1d}"
        )


@dataclass
class HPLConfig:
    """The parsed HPL.dat (global: every rank parses the same text)."""

    source: str
    outfile: str = "HPL.out"
    device: int = 6
    ns: list[int] = field(default_factory=list)
    nbs: list[int] = field(default_factory=list)
    pmap: int = 0
    grids: list[tuple[int, int]] = field(default_factory=list)
    threshold: float = 16.0
    pfacts: list[int] = field(default_factory=list)
    nbmins: list[int] = field(default_factory=list)
    ndivs: list[int] = field(default_factory=list)
    rfacts: list[int] = field(default_factory=list)
    bcasts: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    swap: int = 2
    swap_threshold: int = 64
    l1_notrans: int = 0
    u_notrans: int = 0
    equil: int = 1
    align: int = 8
    #: where the grids came from, for error messages ("" = lines 11-12 of ``source``)
    grid_where: str = ""
    #: where the Ns came from ("" = line 6 of ``source``)
    ns_where: str = ""

    def variants(self) -> Iterator[Variant]:
        """The algorithm combinations in xhpl's loop order (DEPTH outermost, NDIV innermost)."""
        for depth, bcast, rfact, pfact, nbmin, ndiv in itertools.product(
            self.depths, self.bcasts, self.rfacts, self.pfacts, self.nbmins, self.ndivs
        ):
            yield Variant(self.pmap, depth, bcast, rfact, ndiv, pfact, nbmin)

    def runs(self, nprocs: int) -> Iterator[tuple[tuple[int, int], int, int, Variant]]:
        """Every ((P, Q), N, NB, variant) xhpl runs on ``nprocs`` ranks, grids outermost.

        Grids needing more than ``nprocs`` ranks are left out (see :func:`check_grids`).
        """
        for p, q in self.grids:
            if p * q > nprocs:
                continue
            for n, nb in itertools.product(self.ns, self.nbs):
                for v in self.variants():
                    yield (p, q), n, nb, v

    def lu_options(self, v: Variant) -> dict:
        """Keyword arguments for ``hpcmac.linalg.lu.LUOptions`` for variant ``v``."""
        return dict(
            pfact=FACT_NAMES[v.pfact],
            nbmin=v.nbmin,
            ndiv=v.ndiv,
            rfact=FACT_NAMES[v.rfact],
            bcast=BCAST_NAMES[v.bcast],
            depth=v.depth,
            swap=SWAP_NAMES[self.swap],
            swap_threshold=self.swap_threshold,
            l1_transposed=self.l1_notrans == 0,
            u_transposed=self.u_notrans == 0,
            equil=self.equil == 1,
            align=self.align,
        )


class _Lines:
    """HPL.dat lines with 1-based numbers, raising located errors."""

    def __init__(self, text: str, source: str):
        # lines end at \n only (netlib's fgets), not at the other breaks splitlines() knows
        self.lines = [line.rstrip("\r") for line in text.split("\n")]
        if self.lines and self.lines[-1] == "":
            self.lines.pop()
        self.source = source

    def error(self, lineno: int, what: str, expected: str, found: str) -> UsageError:
        return UsageError(f"{self.source}:{lineno}: {what}: expected {expected}, found {found}")

    def line(self, lineno: int, what: str) -> str:
        if lineno > len(self.lines):
            raise self.error(
                lineno, what, "a line",
                f"end of file after {len(self.lines)} lines (HPL.dat has {HPL_DAT_LINES})",
            )
        return self.lines[lineno - 1]

    def tokens(self, lineno: int, what: str, count: int, expected: str) -> list[str]:
        toks = self.line(lineno, what).split()
        if len(toks) < count:
            found = "an empty line" if not toks else f"{len(toks)} value(s) {' '.join(toks)!r}"
            raise self.error(lineno, what, f"{count} value(s) ({expected})", found)
        return toks[:count]

    def ints(self, lineno: int, what: str, count: int, expected: str, ok) -> list[int]:
        out = []
        for tok in self.tokens(lineno, what, count, expected):
            value = parse_int(tok)
            if value is None or abs(value) > MAX_INT:
                raise self.error(
                    lineno, what, f"{count} integer(s) ({expected})", repr(tok)
                )
            if not ok(value):
                raise self.error(lineno, what, expected, repr(tok))
            out.append(value)
        return out

    def one_int(self, lineno: int, what: str, expected: str, ok=lambda v: True) -> int:
        return self.ints(lineno, what, 1, expected, ok)[0]

    def count(self, lineno: int, what: str) -> int:
        return self.one_int(
            lineno, f"number of {what}", f"an integer from 1 to {MAX_PARAM}",
            lambda v: 1 <= v <= MAX_PARAM,
        )

    def values(self, lineno: int, what: str, expected: str, ok) -> list[int]:
        """A count line at ``lineno`` and its value list on the next line."""
        k = self.count(lineno, what)
        return self.ints(lineno + 1, what, k, expected, ok)


def _codes(codes: dict[int, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in codes.items())


def parse_hpl_dat(text: str, source: str = "HPL.dat") -> HPLConfig:
    """Parse the text of an HPL.dat; ``source`` names the file in error messages.

    Raises
    ------
    UsageError
        ``source:line: field: expected ..., found ...`` for the first bad line.
    """
    f = _Lines(text, source)
    cfg = HPLConfig(source=source)
    f.line(1, "title")
    f.line(2, "title")
    out = f.tokens(3, "output file name", 1, "a file name")
    cfg.outfile = out[0]
    cfg.device = f.one_int(
        4, "device out", "an integer (6=stdout, 7=stderr, else the file of line 3)"
    )
    cfg.ns = f.values(5, "Ns", "N >= 0", lambda v: v >= 0)
    cfg.nbs = f.values(7, "NBs", "NB >= 1", lambda v: v >= 1)
    cfg.pmap = f.one_int(9, "PMAP", "0 (row-major) or 1 (column-major)", lambda v: v in (0, 1))
    k = f.count(10, "process grids")
    ps = f.ints(11, "Ps", k, "P >= 1", lambda v: v >= 1)
    qs = f.ints(12, "Qs", k, "Q >= 1", lambda v: v >= 1)
    cfg.grids = list(zip(ps, qs))
    tok = f.tokens(13, "threshold", 1, "a number")[0]
    threshold = parse_float(tok)
    if threshold is None:  # NaN would switch the residual check off
        raise f.error(13, "threshold", "a finite number (e.g. 16.0; <= 0 skips the check)",
                      repr(tok))
    cfg.threshold = threshold
    fact = f"one of {_codes(FACT_NAMES)}"
    cfg.pfacts = f.values(14, "PFACTs", fact, lambda v: v in FACT_NAMES)
    cfg.nbmins = f.values(16, "NBMINs", "NBMIN >= 1", lambda v: v >= 1)
    cfg.ndivs = f.values(18, "NDIVs", "NDIV >= 2", lambda v: v >= 2)
    cfg.rfacts = f.values(20, "RFACTs", fact, lambda v: v in FACT_NAMES)
    cfg.bcasts = f.values(22, "BCASTs", f"one of {_codes(BCAST_NAMES)}", lambda v: v in BCAST_NAMES)
    cfg.depths = f.values(
        24, "DEPTHs", "0 or 1 (the look-ahead depths hpcmac implements)", lambda v: v in DEPTHS
    )
    cfg.swap = f.one_int(26, "SWAP", f"one of {_codes(SWAP_NAMES)}", lambda v: v in SWAP_NAMES)
    cfg.swap_threshold = f.one_int(27, "swapping threshold", "an integer >= 0", lambda v: v >= 0)
    form = "0 (transposed) or 1 (no-transposed)"
    cfg.l1_notrans = f.one_int(28, "L1 form", form, lambda v: v in (0, 1))
    cfg.u_notrans = f.one_int(29, "U form", form, lambda v: v in (0, 1))
    cfg.equil = f.one_int(30, "EQUIL", "0 (no) or 1 (yes)", lambda v: v in (0, 1))
    cfg.align = f.one_int(31, "ALIGN", f"an integer from 1 to {MAX_ALIGN} (doubles)",
                          lambda v: 0 < v <= MAX_ALIGN)
    return cfg


def square_grid(nprocs: int) -> tuple[int, int]:
    """The most square P x Q = nprocs with P <= Q (netlib's advice: P <= Q, near square)."""
    p = max(d for d in range(1, int(nprocs**0.5) + 1) if nprocs % d == 0)
    return p, nprocs // p


def default_config(nprocs: int) -> HPLConfig:
    """The embedded default HPL.dat, its grid P x Q using all ``nprocs`` ranks."""
    p, q = square_grid(max(1, nprocs))
    text = DEFAULT_DAT.format(n=DEFAULT_N, nb=DEFAULT_NB, p=p, q=q)
    return parse_hpl_dat(text, "<embedded default HPL.dat>")


def apply_overrides(
    cfg: HPLConfig,
    nprocs: int,
    ns: list[int] | None = None,
    nbs: list[int] | None = None,
    p: int | None = None,
    q: int | None = None,
) -> HPLConfig:
    """Replace Ns, NBs and the grids by command-line values (validated like the file's).

    With only one of ``p``/``q`` given, the other is ``nprocs // given`` (at least 1).
    """
    if ns is not None:
        if not ns or any(n < 0 or n > MAX_INT for n in ns) or len(ns) > MAX_PARAM:
            raise UsageError(f"-N: expected 1 to {MAX_PARAM} sizes from 0 to {MAX_INT}, "
                             f"found {ns}")
        cfg = replace(cfg, ns=list(ns), ns_where="-N")
    if nbs is not None:
        if not nbs or any(nb < 1 or nb > MAX_INT for nb in nbs) or len(nbs) > MAX_PARAM:
            raise UsageError(f"--nb: expected 1 to {MAX_PARAM} block sizes from 1 to {MAX_INT}, "
                             f"found {nbs}")
        cfg = replace(cfg, nbs=list(nbs))
    for flag, v in (("-P", p), ("-Q", q)):
        if v is not None and not 1 <= v <= MAX_INT:
            raise UsageError(f"{flag}: expected an integer >= 1, found {v}")
    if p is not None or q is not None:
        if p is None:
            p = max(1, nprocs // q)
        if q is None:
            q = max(1, nprocs // p)
        cfg = replace(cfg, grids=[(p, q)], grid_where="-P/-Q")
    return cfg


def check_grids(cfg: HPLConfig, nprocs: int) -> list[str]:
    """Notes for grids too big for ``nprocs`` ranks; UsageError when every grid is.

    Call on every rank before any collective (the verdict is the same everywhere).
    """
    notes = [
        f"grid {p}x{q} needs {p * q} ranks, have {nprocs}: skipped"
        for p, q in cfg.grids
        if p * q > nprocs
    ]
    if len(notes) == len(cfg.grids):
        where = cfg.grid_where or (
            cfg.source if cfg.source.startswith("<") else f"{cfg.source}:11-12"
        )
        grids = " ".join(f"{p}x{q}" for p, q in cfg.grids)
        raise UsageError(
            f"{where}: Ps x Qs: expected at least one grid with P*Q <= {nprocs} "
            f"(the rank count), found {grids}"
        )
    return notes


def run_bytes(n: int, nb: int, p: int, q: int) -> int:
    """Bytes the largest rank of a P x Q grid holds for one run of size ``n``, block ``nb``.

    Its block of [A | b] (rank (0, 0) owns the most), the panel workspace
    (its rows and columns times one block) and the replicated solution.
    """
    from hpcmac.linalg.layout import numroc  # here: importing hpcmac.linalg loads scipy

    rows = numroc(n, nb, 0, p)
    cols = numroc(n + 1, nb, 0, q)
    jb = min(nb, max(n, 1))
    return 8 * (rows * cols + (rows + cols + jb) * jb + 2 * n)


def largest_n(nb: int, p: int, q: int, nbytes: int) -> int:
    """The largest N with :func:`run_bytes` <= ``nbytes`` (0 when even N = 1 does not fit)."""
    lo, hi = 0, 1
    while run_bytes(hi, nb, p, q) <= nbytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if run_bytes(mid, nb, p, q) <= nbytes else (lo, mid)
    return lo


def check_memory(cfg: HPLConfig, nprocs: int, per_rank: int) -> None:
    """UsageError (one line) when some run's matrix cannot fit ``per_rank`` bytes per rank.

    Pure; call on every rank with the same ``per_rank`` (the smallest rank's
    share, agreed collectively) so the verdict is the same everywhere.
    """
    for p, q in cfg.grids:
        if p * q > nprocs:
            continue
        for nb in cfg.nbs:
            for n in cfg.ns:
                need = run_bytes(n, nb, p, q)
                if need > per_rank:
                    where = cfg.ns_where or (
                        cfg.source if cfg.source.startswith("<") else f"{cfg.source}:6")
                    from hpcmac.limits import gib

                    raise UsageError(
                        f"{where}: Ns: N={n} needs {gib(need)} per rank on the {p}x{q} grid "
                        f"(NB={nb}), expected at most the {gib(per_rank)} available per rank "
                        f"(largest N that fits: {largest_n(nb, p, q, per_rank)})")
