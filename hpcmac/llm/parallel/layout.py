"""The layout of a job: ``tp`` ranks per tensor group x ``pp`` pipeline stages.

:func:`choose_layout` is pure: the flags (``--tp``, ``--pp``, ``--tp-split``,
``--split``), the rank count, the number of sequences, whether the links are
fast and the model's head count decide, with one line saying why.
:func:`plan_layout` is collective: it gathers hosts and memory, splits the
layers over the stages and each stage's heads, columns and vocabulary over
its tensor ranks (by memory share, :func:`hpcmac.llm.model.spec.make_shards`),
and checks every rank's bytes fit its budget before any weights load.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from hpcmac.errors import UsageError
from hpcmac.llm.model.spec import Shard, make_shards
from hpcmac.llm.parallel import plan as P


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


@dataclass
class LayoutPlan:
    """Global: the layout, each stage's layers, each rank's shard, bytes and budget."""

    layout: Layout
    stages: list[P.StageSpec]  # one per stage (its index in StageSpec.rank)
    shards: list[list[Shard]]  # [stage][tensor rank]
    need: list[int]  # bytes per world rank: weights + KV cache
    budgets: list[float]
    hosts: list[str]
    how: str  # what set the layer split: "split", "memory" or "hostfile"
    shares: list[list[float]] = field(default_factory=list)  # [stage][tensor rank]

    def json(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "why": lay.why,
                "split": {"layers": [s.n_layers for s in self.stages], "how": self.how,
                          "tp_shares": self.shares},
                "ranks": [{"rank": s.rank * lay.tp + t, "stage": s.rank, "tp_rank": t,
                           "host": self.hosts[s.rank * lay.tp + t],
                           "layers": [s.start, s.end], **self.shards[s.rank][t].layout(),
                           "need_bytes": self.need[s.rank * lay.tp + t],
                           "budget_bytes": self.budgets[s.rank * lay.tp + t]}
                          for s in self.stages for t in range(lay.tp)]}


def plan_layout(group, model: str, cfg, layout: Layout, split: str | None,
                hostfile: str | None, kv_tokens: int, quantize: int | None = None,
                group_size: int = 64) -> LayoutPlan:
    """Collective: every rank's layers and shard, checked to fit, before loading anything.

    One rank per stage is :func:`hpcmac.llm.parallel.plan.plan_stages` unchanged.
    ``kv_tokens`` is the cache size in tokens (slots x length, global).
    """
    from hpcmac.llm.model.spec import full_shard

    tp = layout.tp
    if tp == 1:
        sp = P.plan_stages(group, model, cfg, split, hostfile, kv_tokens, quantize, group_size)
        return LayoutPlan(layout, sp.stages, [[full_shard(cfg)] for _ in sp.stages], sp.need,
                          sp.budgets, sp.hosts, sp.how, [[1.0] for _ in sp.stages])
    mem = group.allgather_obj((socket.gethostname(), P.available_memory()))
    hosts = [h for h, _ in mem]
    hf = P.agree(group, lambda: P.read_hostfile(hostfile), ranks="root") if hostfile else None
    budgets = P.rank_budgets(hosts, [a for _, a in mem], hf)

    def work():
        return _plan_tensor(model, cfg, layout, split, kv_tokens, quantize, group_size,
                            budgets, hosts, "hostfile" if hf else "memory")

    return P.agree(group, work, ranks="root")


def _plan_tensor(model, cfg, layout: Layout, split, kv_tokens, quantize, group_size,
                 budgets: Sequence[float], hosts: Sequence[str], how: str) -> LayoutPlan:
    from hpcmac.llm.model.cache import KVCache
    from hpcmac.llm.model.weights import open_checkpoint, stage_nbytes

    tp, pp = layout.tp, layout.pp
    P.check_ranks(cfg.n_layers, pp)
    stage_budget = [sum(budgets[s * tp:(s + 1) * tp]) for s in range(pp)]
    if pp == 1:
        counts = [cfg.n_layers]
    elif split:
        counts, how = P.parse_split(split, cfg.n_layers, pp), "split"
    else:
        layer_b, embed_b, head_b = P.weight_bytes(model, quantize, group_size)
        kv = KVCache.token_bytes(cfg) * kv_tokens
        counts = P.proportional_counts([b + kv for b in layer_b], embed_b, head_b,
                                       stage_budget)
    stages = P.stages_from_counts(counts)
    shares, shards = [], []
    for s in range(pp):
        if layout.shares:
            sh = list(layout.shares)
        elif how == "hostfile":
            sh = budgets[s * tp:(s + 1) * tp]
        else:  # measured: whole GiB, so ranks sharing a host get equal shares
            sh = [max(1.0, round(b / P.GIB)) for b in budgets[s * tp:(s + 1) * tp]]
        shares.append([float(x) for x in sh])
        shards.append(make_shards(cfg, sh))
    ckpt = open_checkpoint(model)
    need = []
    for st in stages:
        for t in range(tp):
            shard = shards[st.rank][t]
            kv = KVCache.token_bytes(replace(cfg, n_kv_heads=shard.n_kv_heads) if not cfg.mla
                                     else cfg)
            need.append(stage_nbytes(ckpt, st.start, st.end, st.first, st.last, quantize,
                                     group_size, shard) + kv * kv_tokens * st.n_layers)
    for r, (nb, b) in enumerate(zip(need, budgets)):
        if nb > b:
            st, t = stages[r // tp], r % tp
            sh = shards[st.rank][t]
            raise UsageError(
                f"rank {r} on {hosts[r]} (stage {st.rank}, tensor rank {t}: layers "
                f"[{st.start}, {st.end}), {sh.n_heads} of {cfg.n_heads} heads) needs "
                f"{nb / P.GIB:.2f} GiB but its memory budget is {b / P.GIB:.2f} GiB: add "
                "ranks or hosts, or give it a smaller share with --tp-split")
    return LayoutPlan(layout, stages, shards, need, list(budgets), list(hosts), how, shares)
