"""HPL-MxP's HPL.out: netlib's layout, both precisions named, and the refinement's lines.

Pure formatting (rank 0 prints). The T/V table, the start/end lines, the
``||Ax-b||_oo/(...)= ... PASSED|FAILED`` line and the closing counts are
netlib HPL's, so tools that read HPL.out read this too; between them each run
adds one line naming the factorisation's precision and one with the split of
the time and GMRES's iteration count.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from hpcmac import __version__
from hpcmac.hpl import report as hpl_report
from hpcmac.hpl.config import HPLConfig
from hpcmac.hpl.report import RULE_DASH, RunResult

#: the HPL.out banner (replaces netlib's three title lines)
BANNER = [
    "HPL-MxP  --  mixed-precision High-Performance Linpack (rules of hpl-mxp.org)",
    f"hpcmac {__version__}: LU without pivoting in low precision, GMRES refinement in FP64",
    "Factorisation: hpcmac.linalg's block-cyclic LU (netlib HPL's phases and variants)",
]


def precision_label(precision: str, backend: str) -> str:
    """How the factorisation ran, in words."""
    if backend == "mlx":
        return (f"{precision} (panels float32 on the CPU, trailing update {precision} "
                "through MLX; no pivoting)")
    return f"{precision} (numpy BLAS; no pivoting)"


def header(cfg: HPLConfig, eps: float, precision: str, backend: str, maxit: int,
           restart: int, diag: float) -> str:
    """netlib's header with the banner of HPL-MxP and the precisions named."""
    text = hpl_report.header(cfg, eps, BANNER)
    lines = [
        f"PRECISION: LU {precision_label(precision, backend)}; GMRES refinement and "
        "residual check float64",
        f"GMRES  : flexible, restart {restart}, at most {maxit} iterations, preconditioned by "
        "the LU",
        "MATRIX : HPL's random entries, a_ii = sum of |a_ij| over the row (diagonally dominant)"
        if diag == 1.0 else
        f"MATRIX : a_ii = {diag:g} x sum of |a_ij| over the row: NOT HPL-MxP's matrix "
        "(results are not valid HPL-MxP runs)",
        "",
    ]
    return text + "\n".join(lines) + "\n"


@dataclass
class MxPResult(RunResult):
    """One HPL-MxP run (global). ``time_s`` is factorisation plus refinement."""

    precision: str = "float32"
    backend: str = "numpy"
    iterations: int = 0  # GMRES iterations (each: one FP64 product with A, one LU solve)
    restarts: int = 0
    converged: bool = False
    time_factor_s: float = 0.0
    time_refine_s: float = 0.0
    history: list[float] = field(default_factory=list)  # scaled residual at each restart
    note: str = ""  # why it did not converge, when it did not

    def record(self) -> dict:
        """The --json record: hpcmac.hpl's fields, then the refinement's."""
        rec = super().record()
        d = asdict(self)
        for k in ("precision", "backend", "iterations", "restarts", "converged",
                  "time_factor_s", "time_refine_s", "history", "note"):
            rec[k] = d[k]
        rec["history"] = [_finite(v) for v in rec["history"]]
        return {k: _finite(v) if isinstance(v, float) else v for k, v in rec.items()}


def _finite(v):
    """JSON has no NaN/inf: such values become strings."""
    if v is None or v == v and abs(v) != float("inf"):
        return v
    return str(v)


def result_lines(res: MxPResult, threshold: float) -> str:
    """netlib's result lines plus the factorisation/refinement lines."""
    out = [
        f"{res.tv}{res.n:12d} {res.nb:5d} {res.p:5d} {res.q:5d} "
        f"{res.time_s:18.2f}    {res.gflops:19.4e}",
        f"HPL_pdgesv() start time {time.ctime(res.start)}\n",
        f"HPL_pdgesv() end time   {time.ctime(res.end)}\n",
    ]
    share = 100.0 * res.time_refine_s / res.time_s if res.time_s > 0 else 0.0
    out.append(f"LU {res.precision:<8} ({res.backend}) {res.time_factor_s:10.2f} s   "
               f"GMRES float64 {res.time_refine_s:8.2f} s ({share:4.1f}% of the time)")
    verdict = "converged" if res.converged else "NOT converged"
    out.append(f"GMRES iterations {res.iterations:4d}   cycles {res.restarts:3d}   {verdict}"
               + (f": {res.note}" if res.note else ""))
    out.append(RULE_DASH)
    out.append("||Ax-b||_oo/(eps*(||A||_oo*||x||_oo+||b||_oo)*N)= "
               f"{res.residual:16.8e} ...... {'PASSED' if res.passed else 'FAILED'}")
    if not res.passed:
        dots = [
            ("||Ax-b||_oo  . . . . . . . . . . . . . . . . . = ", res.resid0),
            ("||A||_oo . . . . . . . . . . . . . . . . . . . = ", res.norm_a_inf),
            ("||x||_oo . . . . . . . . . . . . . . . . . . . = ", res.norm_x_inf),
            ("||b||_oo . . . . . . . . . . . . . . . . . . . = ", res.norm_b_inf),
        ]
        out += [f"{label}{value:18.6f}" for label, value in dots]
    return "\n".join(out) + "\n"


def write_json(path: str, results: list[MxPResult]) -> None:
    """Replace ``path`` with the records (a JSON list, one object per run), atomically
    (as hpcmac.hpl's --json: a kill mid-write leaves the previous list whole)."""
    from hpcmac.io.outputs import write_atomic

    write_atomic(path, json.dumps([r.record() for r in results], indent=1) + "\n", what="--json")
