"""The layout of a job: ``tp`` ranks per tensor group x ``pp`` pipeline stages.

:func:`choose_layout` is pure: the flags (``--tp``, ``--pp``, ``--tp-split``,
``--split``), the rank count, the number of sequences, whether the links are
fast and the model's head count decide, with one line saying why. The layers,
shards and bytes of each rank are the placement's
(:func:`hpcmac.llm.parallel.placement.place`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcmac.errors import UsageError


@dataclass(frozen=True)
class Layout:
    """Global: ranks per tensor group, stages, the tensor shares if given, and why."""

    tp: int
    pp: int
    shares: tuple[float, ...] | None  # --tp-split (None: by memory)
    why: str

    def describe(self) -> str:
        if self.tp == 1 and self.pp == 1:
            return "one rank"
        if self.tp == 1:
            return f"pipeline {self.pp}"
        if self.pp == 1:
            return f"tensor {self.tp}"
        return f"pipeline {self.pp} x tensor {self.tp}"


def _positive(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} {value}: expected a positive number of ranks")


def parse_tp_split(text: str) -> tuple[float, ...]:
    """``--tp-split 2,1,1``: one positive share per tensor rank."""
    try:
        shares = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise UsageError(f"--tp-split {text!r}: expected comma-separated shares such as "
                         "2,1,1") from None
    if not shares or any(not s > 0 for s in shares):
        raise UsageError(f"--tp-split {text!r}: every share must be a positive number")
    return shares


def check_layout_flags(tp: int | None, pp: int | None, tp_split: str | None) -> None:
    """Local checks of the flags alone (every rank the same, before any collective)."""
    _positive("--tp", tp)
    _positive("--pp", pp)
    if tp_split is not None:
        parse_tp_split(tp_split)


def choose_layout(ranks: int, cfg, *, tp: int | None = None, pp: int | None = None,
                  tp_split: str | None = None, split: str | None = None,
                  sequences: int = 1, fast_links: bool = True,
                  predicted: tuple[int, int, str] | None = None) -> Layout:
    """The layout for ``ranks`` ranks (pure; global inputs, so every rank agrees).

    Flags win: ``--tp``/``--pp`` (their product must be the rank count),
    ``--tp-split`` (one share per tensor rank), ``--split`` (layers per stage:
    a pipeline). Without them: tensor parallel over every rank for a single
    sequence when the links are fast (one host, or RDMA), since it splits the
    bytes each token reads; a pipeline otherwise (several sequences keep the
    stages busy without a reduction per layer; slow links are crossed once per
    stage, not twice per layer). ``predicted`` = (tp, pp, why), when given, is the
    layout :mod:`hpcmac.plan` predicts fastest for this job, and replaces those rules.
    """
    shares = parse_tp_split(tp_split) if tp_split is not None else None
    if shares is not None and tp is not None and len(shares) != tp:
        raise UsageError(f"--tp-split {tp_split!r} has {len(shares)} shares but --tp is {tp}")
    if shares is not None and tp is None:
        tp = len(shares)
    tp_flag = f"--tp-split {tp_split}" if shares is not None and tp == len(shares) else "--tp"
    for flag, v in ((tp_flag, tp), ("--pp", pp)):
        if v is not None and ranks % v:
            divisors = ", ".join(str(d) for d in range(1, ranks + 1) if ranks % d == 0)
            what = flag if flag.startswith("--tp-split") else f"{flag} {v}"
            raise UsageError(f"{what}: {ranks} rank{'s' * (ranks != 1)} do not split into "
                             f"tensor groups of {v} (expected a group size of {divisors})"
                             if flag != "--pp" else
                             f"{what}: {ranks} rank{'s' * (ranks != 1)} do not split into "
                             f"{v} stages (expected a stage count of {divisors})")
    if tp is not None and pp is not None and tp * pp != ranks:
        raise UsageError(f"--tp {tp} x --pp {pp} = {tp * pp} ranks but the job has {ranks}")
    if tp is not None or pp is not None:
        tp = tp if tp is not None else ranks // pp
        pp = ranks // tp
        why = "as asked"
    elif split is not None:
        tp, pp, why = 1, ranks, "--split gives layers per stage"
    elif ranks == 1:
        tp, pp, why = 1, 1, "one rank"
    elif cfg.n_heads < ranks:
        tp, pp = 1, ranks
        why = f"{cfg.n_heads} attention heads cannot be shared by {ranks} tensor ranks"
    elif predicted is not None:
        tp, pp, why = predicted
    elif sequences > 1:
        tp, pp = 1, ranks
        why = (f"{sequences} sequences keep {ranks} stages busy without a reduction per "
               "layer")
    elif not fast_links:
        tp, pp = 1, ranks
        why = ("the hosts are joined by TCP: a pipeline crosses a link once per stage, "
               "tensor parallelism twice per layer")
    else:
        tp, pp = ranks, 1
        why = (f"one sequence over fast links: each token reads 1/{ranks} of the weights "
               "on each rank")
    if split is not None and tp > 1 and pp == 1:
        raise UsageError(f"--split {split!r} gives layers per pipeline stage but the layout "
                         f"is tensor {tp} with one stage (give --pp too)")
    if tp > 1 and cfg.n_heads < tp:
        raise UsageError(f"--tp {tp}: the model has {cfg.n_heads} attention heads, so at most "
                         f"{cfg.n_heads} ranks can share them")
    return Layout(tp, pp, shares, why)
