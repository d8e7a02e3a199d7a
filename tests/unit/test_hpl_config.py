"""HPL.dat parsing (netlib's 31-line format), overrides, grid checks, T/V codes."""

import pytest

from hpcmac.errors import UsageError
from hpcmac.hpl import config

# netlib HPL 2.3's testing/ptest/HPL.dat, line for line
NETLIB_DAT = """\
HPLinpack benchmark input file
Innovative Computing Laboratory, University of Tennessee
HPL.out      output file name (if any)
6            device out (6=stdout,7=stderr,file)
4            # of problems sizes (N)
29 30 34 35  Ns
4            # of NBs
1 2 3 4      NBs
0            PMAP process mapping (0=Row-,1=Column-major)
3            # of process grids (P x Q)
2 1 4        Ps
2 4 1        Qs
16.0         threshold
3            # of panel fact
0 1 2        PFACTs (0=left, 1=Crout, 2=Right)
2            # of recursive stopping criterium
2 4          NBMINs (>= 1)
1            # of panels in recursion
2            NDIVs
3            # of recursive panel fact.
0 1 2        RFACTs (0=left, 1=Crout, 2=Right)
1            # of broadcast
0            BCASTs (0=1rg,1=1rM,2=2rg,3=2rM,4=Lng,5=LnM)
1            # of lookahead depth
0            DEPTHs (>=0)
2            SWAP (0=bin-exch,1=long,2=mix)
64           swapping threshold
0            L1 in (0=transposed,1=no-transposed) form
0            U  in (0=transposed,1=no-transposed) form
1            Equilibration (0=no,1=yes)
8            memory alignment in double (> 0)
"""


def with_line(lineno: int, text: str) -> str:
    lines = NETLIB_DAT.splitlines()
    lines[lineno - 1] = text
    return "\n".join(lines) + "\n"


def test_netlib_sample_parses():
    cfg = config.parse_hpl_dat(NETLIB_DAT, "HPL.dat")
    assert cfg.outfile == "HPL.out" and cfg.device == 6
    assert cfg.ns == [29, 30, 34, 35] and cfg.nbs == [1, 2, 3, 4]
    assert cfg.pmap == 0 and cfg.grids == [(2, 2), (1, 4), (4, 1)]
    assert cfg.threshold == 16.0
    assert cfg.pfacts == [0, 1, 2] and cfg.nbmins == [2, 4] and cfg.ndivs == [2]
    assert cfg.rfacts == [0, 1, 2] and cfg.bcasts == [0] and cfg.depths == [0]
    assert (cfg.swap, cfg.swap_threshold) == (2, 64)
    assert (cfg.l1_notrans, cfg.u_notrans, cfg.equil, cfg.align) == (0, 0, 1, 8)


def test_loop_order_and_count_match_xhpl():
    cfg = config.parse_hpl_dat(NETLIB_DAT)
    vs = list(cfg.variants())
    assert len(vs) == 1 * 1 * 3 * 3 * 2 * 1  # depth, bcast, rfact, pfact, nbmin, ndiv
    # xhpl: rfact outside pfact outside nbmin
    assert [v.tv for v in vs[:3]] == ["WR00L2L2", "WR00L2L4", "WR00L2C2"]
    runs = list(cfg.runs(4))
    assert len(runs) == 3 * 4 * 4 * 18
    assert runs[0][0] == (2, 2) and runs[-1][0] == (4, 1)
    assert len(list(cfg.runs(2))) == 0  # every grid needs 4 ranks


def test_tv_code_as_netlib_encodes_it():
    v = config.Variant(pmap=0, depth=1, bcast=1, rfact=1, ndiv=2, pfact=2, nbmin=4)
    assert v.tv == "WR11C2R4"
    v = config.Variant(pmap=1, depth=0, bcast=5, rfact=0, ndiv=3, pfact=1, nbmin=16)
    assert v.tv == "WC05L3C16"


def test_lu_options_mapping():
    cfg = config.parse_hpl_dat(with_line(28, "1  L1"))
    v = config.Variant(pmap=0, depth=1, bcast=4, rfact=1, ndiv=2, pfact=0, nbmin=8)
    opts = cfg.lu_options(v)
    assert opts == dict(pfact="left", nbmin=8, ndiv=2, rfact="crout", bcast="long", depth=1,
                        swap="mix", swap_threshold=64, l1_transposed=False, u_transposed=True,
                        equil=True, align=8)


def test_lines_after_31_ignored_and_comments_allowed():
    cfg = config.parse_hpl_dat(NETLIB_DAT + "##### extra lines (hpcc) ####\n1 2 3\n")
    assert cfg.align == 8


@pytest.mark.parametrize(
    "lineno, text, expect",
    [
        (6, "29 30 -34 35  Ns", "HPL.dat:6: Ns: expected N >= 0, found '-34'"),
        (6, "29 thirty 34 35  Ns", "HPL.dat:6: Ns: expected 4 integer(s)"),
        (6, "29 30 34", "HPL.dat:6: Ns: expected 4 value(s)"),
        (5, "many  # of N", "HPL.dat:5: number of Ns: expected 1 integer(s)"),
        (5, "0  # of N", "HPL.dat:5: number of Ns: expected an integer from 1 to 20"),
        (8, "1 2 0 4", "HPL.dat:8: NBs: expected NB >= 1, found '0'"),
        (9, "2  PMAP", "HPL.dat:9: PMAP: expected 0 (row-major) or 1 (column-major)"),
        (11, "2 0 4  Ps", "HPL.dat:11: Ps: expected P >= 1, found '0'"),
        (13, "sixteen", "HPL.dat:13: threshold: expected a finite number"),
        (15, "0 1 3  PFACTs", "HPL.dat:15: PFACTs: expected one of 0=left, 1=crout, 2=right"),
        (19, "1  NDIVs", "HPL.dat:19: NDIVs: expected NDIV >= 2, found '1'"),
        (21, "0 1 7", "HPL.dat:21: RFACTs: expected one of"),
        (23, "6  BCASTs", "HPL.dat:23: BCASTs: expected one of 0=1ring"),
        (25, "2  DEPTHs", "HPL.dat:25: DEPTHs: expected 0 or 1"),
        (26, "3  SWAP", "HPL.dat:26: SWAP: expected one of 0=binexch"),
        (27, "-1", "HPL.dat:27: swapping threshold: expected an integer >= 0"),
        (28, "2  L1", "HPL.dat:28: L1 form: expected 0 (transposed) or 1"),
        (31, "0  ALIGN", "HPL.dat:31: ALIGN: expected an integer from 1 to 4096"),
        (3, "", "HPL.dat:3: output file name: expected 1 value(s)"),
    ],
)
def test_bad_lines_name_file_line_and_expectation(lineno, text, expect):
    with pytest.raises(UsageError) as err:
        config.parse_hpl_dat(with_line(lineno, text), "HPL.dat")
    msg = str(err.value)
    assert msg.startswith(expect), msg
    assert "\n" not in msg


def test_missing_line():
    text = "\n".join(NETLIB_DAT.splitlines()[:20]) + "\n"
    with pytest.raises(UsageError, match=r"^x.dat:21: RFACTs: expected a line, found end of file"):
        config.parse_hpl_dat(text, "x.dat")


def test_every_grid_too_big_is_an_error_some_too_big_is_a_note():
    cfg = config.parse_hpl_dat(NETLIB_DAT, "HPL.dat")
    with pytest.raises(UsageError, match=r"^HPL.dat:11-12: Ps x Qs: expected at least one grid "
                                         r"with P\*Q <= 2 .*found 2x2 1x4 4x1"):
        config.check_grids(cfg, 2)
    cfg = config.parse_hpl_dat(with_line(11, "2 1 1").replace("2 4 1        Qs", "2 4 2  Qs"))
    notes = config.check_grids(cfg, 2)
    assert len(notes) == 2 and "grid 2x2 needs 4 ranks, have 2: skipped" in notes[0]


def test_overrides():
    cfg = config.parse_hpl_dat(NETLIB_DAT)
    out = config.apply_overrides(cfg, 4, ns=[100], nbs=[16, 32], p=1, q=2)
    assert out.ns == [100] and out.nbs == [16, 32] and out.grids == [(1, 2)]
    assert config.apply_overrides(cfg, 4, p=2).grids == [(2, 2)]
    assert config.apply_overrides(cfg, 6, q=3).grids == [(2, 3)]
    with pytest.raises(UsageError, match="^-N: expected 1 to 20 sizes from 0"):
        config.apply_overrides(cfg, 4, ns=[-5])
    with pytest.raises(UsageError, match="^-P: expected an integer >= 1"):
        config.apply_overrides(cfg, 4, p=0)
    big = config.apply_overrides(cfg, 2, p=2, q=2)
    with pytest.raises(UsageError, match=r"^-P/-Q: Ps x Qs"):
        config.check_grids(big, 2)


@pytest.mark.parametrize("nprocs, grid", [(1, (1, 1)), (2, (1, 2)), (4, (2, 2)), (6, (2, 3)),
                                          (7, (1, 7)), (12, (3, 4))])
def test_default_config_uses_every_rank(nprocs, grid):
    cfg = config.default_config(nprocs)
    assert cfg.grids == [grid]
    assert cfg.ns == [config.DEFAULT_N] and cfg.nbs == [config.DEFAULT_NB]
    assert [v.tv for v in cfg.variants()] == ["WR11C2R4"]
    assert config.check_grids(cfg, nprocs) == []


@pytest.mark.parametrize("name, runs", [("sweep.dat", 2 * 3 * 36), ("bench.dat", 2)])
def test_example_files_parse(name, runs):
    from pathlib import Path

    path = Path(config.__file__).parent / "examples" / name
    cfg = config.parse_hpl_dat(path.read_text(), str(path))
    assert len(list(cfg.runs(4))) == runs
