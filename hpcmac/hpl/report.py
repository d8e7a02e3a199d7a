"""HPL.out text (netlib HPL 2.3's layout, line for line) and the --json records.

Pure formatting: the driver decides where the text goes (rank 0 only). Tools
that read netlib's HPL.out (the ``T/V`` header, the result line after it, the
``||Ax-b||_oo/(...)= ... PASSED`` line, the final counts) read this too.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from hpcmac import __version__
from hpcmac.hpl.config import BCAST_LABELS, FACT_LABELS, HPLConfig

RULE_EQ = "=" * 80
RULE_DASH = "-" * 80


@dataclass
class RunResult:
    """One HPL run; every field global (the same on every rank of the grid)."""

    tv: str
    n: int
    nb: int
    p: int
    q: int
    time_s: float
    gflops: float
    residual: float | None  # None when the check is off (threshold <= 0)
    passed: bool | None
    norm_a_inf: float
    norm_x_inf: float
    norm_b_inf: float
    norm_a_1: float = 0.0
    norm_x_1: float = 0.0
    resid0: float = 0.0  # ||Ax - b||_oo
    start: float = 0.0  # wall-clock epoch seconds, for the start/end lines
    end: float = 0.0
    # the driver's phase measurements (time_generate_s, time_check_s, peak_rss_mb per
    # grid rank, peak_rss_phase_mb per phase, matrix_mb per grid rank); None: not measured
    phases: dict | None = None

    def record(self) -> dict:
        """The --json record: the fields the issue lists, in that order, then the
        phase times and memory peaks when measured."""
        keys = ("tv", "n", "nb", "p", "q", "time_s", "gflops", "residual", "passed",
                "norm_a_inf", "norm_x_inf", "norm_b_inf")
        d = asdict(self)
        out = {k: d[k] for k in keys}
        if self.phases:
            out.update(self.phases)
        return out


def gflops(n: int, seconds: float) -> float:
    """Netlib's rate: (2/3 N^3 + 3/2 N^2) flops over the wall time, in Gflop/s."""
    if seconds <= 0.0:
        return 0.0
    return ((n / 1.0e9) * (n / seconds)) * ((2.0 / 3.0) * n + (3.0 / 2.0))


def _row(label: str, items: list[str]) -> str:
    """netlib's parameter rows: 8 items per line, continuation lines indented 8."""
    lines = []
    for k in range(0, max(len(items), 1), 8):
        lines.append("".join(items[k:k + 8]))
    return f"{label}:" + "\n        ".join(lines)


def header(cfg: HPLConfig, eps: float, banner: list[str] | None = None) -> str:
    """The banner and the regurgitated input, as ``HPL_pdinfo`` prints them.

    ``banner`` replaces the three title lines (hpcmac.hpl_mxp names itself there).
    """
    ints = lambda vals: [f"{v:8d} " for v in vals]  # noqa: E731
    facts = lambda vals: [f"{FACT_LABELS[v]:>8} " for v in vals]  # noqa: E731
    swap = {0: " Binary-exchange", 1: " Spread-roll (long)",
            2: f" Mix (threshold = {cfg.swap_threshold})"}[cfg.swap]
    out = [
        RULE_EQ,
        *(banner or [
            "HPLinpack 2.3  --  High-Performance Linpack benchmark  --   December 2, 2018",
            f"hpcmac {__version__}: netlib HPL's algorithm and output, in Python over hpcmac.comm",
            "Algorithm by A. Petitet and R. Clint Whaley,  Innovative Computing Laboratory, UTK",
        ]),
        RULE_EQ,
        "",
        "An explanation of the input/output parameters follows:",
        "T/V    : Wall time / encoded variant.",
        "N      : The order of the coefficient matrix A.",
        "NB     : The partitioning blocking factor.",
        "P      : The number of process rows.",
        "Q      : The number of process columns.",
        "Time   : Time in seconds to solve the linear system.",
        "Gflops : Rate of execution for solving the linear system.",
        "",
        "The following parameter values will be used:",
        "",
        _row("N      ", ints(cfg.ns)),
        _row("NB     ", ints(cfg.nbs)),
        "PMAP   : " + ("Column-major" if cfg.pmap == 1 else "Row-major") + " process mapping",
        _row("P      ", ints([p for p, _ in cfg.grids])),
        _row("Q      ", ints([q for _, q in cfg.grids])),
        _row("PFACT  ", facts(cfg.pfacts)),
        _row("NBMIN  ", ints(cfg.nbmins)),
        _row("NDIV   ", ints(cfg.ndivs)),
        _row("RFACT  ", facts(cfg.rfacts)),
        _row("BCAST  ", [f"{BCAST_LABELS[v]:>8} " for v in cfg.bcasts]),
        _row("DEPTH  ", ints(cfg.depths)),
        "SWAP   :" + swap,
        "L1     : " + ("no-transposed" if cfg.l1_notrans else "transposed") + " form",
        "U      : " + ("no-transposed" if cfg.u_notrans else "transposed") + " form",
        "EQUIL  : " + ("yes" if cfg.equil else "no"),
        f"ALIGN  : {cfg.align} double precision words",
        "",
    ]
    if cfg.threshold > 0.0:
        out += [
            RULE_DASH,
            "",
            "- The matrix A is randomly generated for each test.",
            "- The following scaled residual check will be computed:",
            "      ||Ax-b||_oo / ( eps * ( || x ||_oo * || A ||_oo + || b ||_oo ) * N )",
            "- The relative machine precision (eps) is taken to be     " + f" {eps:21.6e}",
            "- Computational tests pass if scaled residuals are less than      "
            + f"   {cfg.threshold:11.1f}",
            "",
        ]
    return "\n".join(out) + "\n"


def results_header() -> str:
    """The table head printed before a run (netlib prints it before each checked run)."""
    return (
        f"{RULE_EQ}\n"
        "T/V                N    NB     P     Q               Time                 Gflops\n"
        f"{RULE_DASH}\n"
    )


def result_lines(res: RunResult, threshold: float) -> str:
    """The timing line, start/end times and (when checking) the residual verdict."""
    out = []
    if res.time_s > 0.0:
        out.append(
            f"{res.tv}{res.n:12d} {res.nb:5d} {res.p:5d} {res.q:5d} "
            f"{res.time_s:18.2f}    {res.gflops:19.4e}"
        )
        # ctime() ends in a newline in C, hence netlib's blank lines
        out.append(f"HPL_pdgesv() start time {time.ctime(res.start)}\n")
        out.append(f"HPL_pdgesv() end time   {time.ctime(res.end)}\n")
    if threshold > 0.0 and res.residual is not None:
        out.append(RULE_DASH)
        out.append(
            "||Ax-b||_oo/(eps*(||A||_oo*||x||_oo+||b||_oo)*N)= "
            f"{res.residual:16.8e} ...... {'PASSED' if res.passed else 'FAILED'}"
        )
        if not res.passed:
            dots = [
                ("||Ax-b||_oo  . . . . . . . . . . . . . . . . . = ", res.resid0),
                ("||A||_oo . . . . . . . . . . . . . . . . . . . = ", res.norm_a_inf),
                ("||A||_1  . . . . . . . . . . . . . . . . . . . = ", res.norm_a_1),
                ("||x||_oo . . . . . . . . . . . . . . . . . . . = ", res.norm_x_inf),
                ("||x||_1  . . . . . . . . . . . . . . . . . . . = ", res.norm_x_1),
                ("||b||_oo . . . . . . . . . . . . . . . . . . . = ", res.norm_b_inf),
            ]
            out += [f"{label}{value:18.6f}" for label, value in dots]
    return "\n".join(out) + "\n" if out else ""


def phase_lines(res: RunResult) -> str:
    """The optional per-phase lines (``--phases``), in the dotted style of netlib's
    detailed timing: the slowest rank's time per phase and the peak memory per rank."""
    ph = res.phases
    if not ph:
        return ""
    dots = "Max aggregated wall time {:<9} . . . . . . . . . . : {:12.2f}"
    out = [dots.format("generate", ph["time_generate_s"]),
           dots.format("pdgesv", res.time_s)]
    if ph.get("time_check_s") is not None:
        out.append(dots.format("check", ph["time_check_s"]))
    peaks = ph["peak_rss_mb"]
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    out.append("Peak resident memory per rank (MB) . . . . . . . : "
               + " ".join(f"{v:.1f}" for v in peaks))
    out.append(f"  max {peaks[worst]:.1f} MB on grid rank {worst}, whose piece of [A|b] is "
               f"{ph['matrix_mb'][worst]:.1f} MB; by phase: "
               + ", ".join(f"{k} {v:.1f}" for k, v in ph["peak_rss_phase_mb"].items()))
    return "\n".join(out) + "\n"


def footer(kpass: int, kfail: int, kskip: int, threshold: float) -> str:
    """The closing counts, as ``HPL_pddriver`` prints them."""
    out = [RULE_EQ, "", f"Finished {kpass + kfail + kskip:6d} tests with the following results:"]
    if threshold > 0.0:
        out += [
            f"         {kpass:6d} tests completed and passed residual checks,",
            f"         {kfail:6d} tests completed and failed residual checks,",
            f"         {kskip:6d} tests skipped because of illegal input values.",
        ]
    else:
        out += [
            f"         {kpass:6d} tests completed without checking,",
            f"         {kskip:6d} tests skipped because of illegal input values.",
        ]
    out += [RULE_DASH, "", "End of Tests.", RULE_EQ]
    return "\n".join(out) + "\n"


def write_json(path: str, results: list[RunResult]) -> None:
    """Replace ``path`` with the records (a JSON list, one object per run), atomically:
    a kill mid-write leaves the previous list whole (hpcmac.io.outputs)."""
    from hpcmac.io.outputs import write_atomic

    write_atomic(path, json.dumps([r.record() for r in results], indent=1) + "\n", what="--json")
