"""Where every part of the model goes: one :class:`Placement`, computed by one pure function.

:func:`place` takes the model (its config and :class:`ModelSizes`: the bytes of
each layer and shard, from the family's tensor spec and the checkpoint's
headers), the cluster (:class:`Cluster`: each rank's host and memory, the
hostfile's budgets, whether the links are fast) and the flags
(:class:`LayoutFlags`), and returns the layout (tensor groups x pipeline
stages, :func:`~hpcmac.llm.parallel.layout.choose_layout`), each stage's layers
``[start, end)`` (:mod:`~hpcmac.llm.parallel.plan`'s split), each rank's shard
(:func:`hpcmac.llm.model.spec.make_shards`), its bytes and budget, and why --
or raises one :class:`~hpcmac.errors.UsageError` line. Nothing here
communicates: the collective part (:mod:`~hpcmac.llm.parallel.runtime`) only
gathers the inputs and agrees on the result, so every rank holds the same value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpcmac.errors import UsageError
from hpcmac.llm.model.spec import Shard, full_shard, local_config, make_shards
from hpcmac.llm.parallel import plan as P
from hpcmac.llm.parallel.layout import Layout, choose_layout
from hpcmac.llm.parallel.plan import GIB, HostMemory, StageSpec


@dataclass(frozen=True)
class LayoutFlags:
    """The layout flags as given (global): ``--tp``, ``--pp``, ``--tp-split``, ``--split``."""

    tp: int | None = None
    pp: int | None = None
    tp_split: str | None = None
    split: str | None = None

    @classmethod
    def of(cls, args) -> LayoutFlags:
        return cls(getattr(args, "tp", None), getattr(args, "pp", None),
                   getattr(args, "tp_split", None), getattr(args, "split", None))


@dataclass(frozen=True)
class Cluster:
    """The job's ranks as the placement sees them (global).

    ``hosts``/``avail``: each rank's host name and the memory (bytes) it measured
    there; ``hostfile``: the hostfile's hosts, whose ``memory_gb`` sets budgets;
    ``transport``: the comm backend's name (``rdma`` counts as a fast link).
    """

    hosts: tuple[str, ...]
    avail: tuple[int, ...]
    hostfile: tuple[HostMemory, ...] | None = None
    transport: str = ""

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def fast_links(self) -> bool:
        """One host, or RDMA between the hosts."""
        return len(set(self.hosts)) == 1 or self.transport == "rdma"

    def budgets(self) -> list[float]:
        """Memory budget in bytes of each rank (:func:`~hpcmac.llm.parallel.plan.rank_budgets`)."""
        return P.rank_budgets(self.hosts, self.avail, self.hostfile)


class ModelSizes:
    """Bytes of the model's parts as loaded, from the checkpoint's headers (nothing read).

    Every count is :func:`hpcmac.llm.model.weights.stage_nbytes`, which walks the
    family's tensor spec (:func:`hpcmac.llm.model.arch.stage_tensors`); the
    checkpoint is opened once. A test may pass any object with these methods.
    """

    def __init__(self, model: str, quantize: int | None = None, group_size: int = 64):
        from hpcmac.llm.model.weights import open_checkpoint

        self.ckpt = open_checkpoint(model)
        self.quantize, self.group_size = quantize, group_size
        self._whole: tuple[list[int], int, int] | None = None

    def stage(self, start: int, end: int, first: bool, last: bool,
              shard: Shard | None = None) -> int:
        from hpcmac.llm.model.weights import stage_nbytes

        return stage_nbytes(self.ckpt, start, end, first, last, self.quantize,
                            self.group_size, shard)

    def whole(self) -> tuple[list[int], int, int]:
        """(bytes of each layer, of the embedding, of the final norm + head), unsharded."""
        if self._whole is None:
            self._whole = P.weight_bytes(self.ckpt, self.quantize, self.group_size)
        return self._whole


@dataclass(frozen=True)
class RankPlace:
    """One rank's part of a :class:`Placement` (global: any rank can read any other's)."""

    rank: int
    stage: int
    tp_rank: int
    host: str
    spec: StageSpec  # the stage's layers [start, end), embedding and head
    shard: Shard  # its heads, KV heads, FFN columns, vocabulary rows
    need: int  # bytes: weights + KV cache
    budget: float


@dataclass(frozen=True)
class Placement:
    """Global: the whole job's placement, the same value on every rank.

    ``tp`` ranks per tensor group x ``pp`` pipeline stages; world rank
    ``s * tp + t`` is tensor rank ``t`` of stage ``s``.
    """

    layout: Layout  # tp, pp, the --tp-split shares if given, and why this layout
    stages: tuple[StageSpec, ...]  # one per stage (its index in StageSpec.rank)
    shards: tuple[tuple[Shard, ...], ...]  # [stage][tensor rank]
    need: tuple[int, ...]  # bytes per world rank: weights + KV cache
    budgets: tuple[float, ...]  # bytes per world rank
    hosts: tuple[str, ...]  # host of each world rank
    how: str  # what set the layer split: "split", "memory" or "hostfile"
    shares: tuple[tuple[float, ...], ...]  # [stage][tensor rank]
    kv_tokens: int = 0  # the KV cache the bytes were counted for (slots x length)
    slots: int = 0  # the sequences whose fixed states (linear attention) were counted
    reserve: int = 0  # bytes world rank 0 holds besides its share (a draft model), in need[0]

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def why(self) -> str:
        return self.layout.why

    @property
    def size(self) -> int:
        return self.tp * self.pp

    def members(self, stage: int) -> list[int]:
        """World ranks of ``stage``'s tensor group, its leader first."""
        return [stage * self.tp + t for t in range(self.tp)]

    def rank(self, r: int) -> RankPlace:
        s, t = divmod(r, self.tp)
        return RankPlace(r, s, t, self.hosts[r], self.stages[s], self.shards[s][t],
                         self.need[r], self.budgets[r])

    def kv_token_bytes(self, cfg, r: int) -> int:
        """Bytes one token's KV takes on world rank ``r``: its stage's layers, its KV heads."""
        s, t = divmod(r, self.tp)
        st = self.stages[s]
        return _cache_bytes(cfg, st.start, st.end, 1, 0, self.shards[s][t])

    def state_bytes(self, cfg, r: int) -> int:
        """Bytes of one sequence's linear-attention states on world rank ``r`` (its
        stage's layers, its value heads; 0 for attention alone)."""
        s, t = divmod(r, self.tp)
        st = self.stages[s]
        return _cache_bytes(cfg, st.start, st.end, 0, 1, self.shards[s][t])

    def describe(self, why: bool = False) -> str:
        """The line generate and serve print (rank 0) for several ranks (``why``: a
        pipeline's line says why this layout too, as a tensor layout's always does)."""
        layers = [s.n_layers for s in self.stages]
        if self.tp == 1:
            line = f"pipeline: {self.pp} stages, layers {layers} (split by {self.how})"
            if why:
                line = f"{line}; {self.why}"
        else:
            heads = [sh.n_heads for sh in self.shards[0]]
            line = (f"layout: {self.layout.describe()} ({self.why}); layers {layers}, heads "
                    f"per tensor rank {'/'.join(map(str, heads))}")
        if self.reserve:
            line += f"; the draft model on rank 0: {self.reserve / GIB:.2f} GiB"
        return line

    def json(self) -> dict:
        """The JSON form (generate's ``layout``): the layout, the split, every rank."""
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "why": lay.why,
                "split": {"layers": [s.n_layers for s in self.stages], "how": self.how,
                          "tp_shares": [list(x) for x in self.shares]},
                "kv_tokens": self.kv_tokens, "slots": self.slots,
                "reserve_bytes": self.reserve,
                "ranks": [_rank_json(self.rank(r)) for r in range(self.size)]}


def _rank_json(p: RankPlace) -> dict:
    sh = p.shard
    return {"rank": p.rank, "stage": p.stage, "tp_rank": p.tp_rank, "host": p.host,
            "layers": [p.spec.start, p.spec.end], **sh.layout(),
            "ranges": {"heads": list(sh.heads), "kv_heads": list(sh.kv_heads),
                       "ffn": list(sh.ffn), "expert_ffn": list(sh.expert_ffn),
                       "shared_ffn": list(sh.shared_ffn), "vocab": list(sh.vocab)},
            "need_bytes": p.need, "budget_bytes": p.budget}


def place(cfg, sizes: ModelSizes, cluster: Cluster, flags: LayoutFlags | None = None, *,
          kv_tokens: int, sequences: int = 1, slots: int | None = None,
          predicted: tuple[int, int, str] | None = None, reserve: int = 0) -> Placement:
    """The placement of ``cfg`` on ``cluster`` under ``flags`` (pure; global inputs).

    Parameters
    ----------
    cfg : the model's :class:`~hpcmac.llm.model.config.ModelConfig`.
    sizes : the bytes of its parts (:class:`ModelSizes`).
    cluster : the ranks' hosts, memory and hostfile budgets, and the transport.
    flags : ``--tp``, ``--pp``, ``--tp-split``, ``--split``.
    kv_tokens : KV cache tokens each rank holds per layer (slots x length).
    sequences : sequences the job decodes together (the default layout's rule).
    slots : the cache's sequence slots, each with its fixed linear-attention states
        (None: ``sequences``).
    predicted : (tp, pp, why) of :mod:`hpcmac.plan`'s fastest layout, if any.
    reserve : bytes world rank 0 holds besides its share (speculative decoding's draft
        model and its KV cache): taken from its budget before the layers are split, and
        counted in its need.

    Raises UsageError (one line) for a layout that cannot be or does not fit.
    """
    flags = flags or LayoutFlags()
    layout = choose_layout(cluster.size, cfg, tp=flags.tp, pp=flags.pp, tp_split=flags.tp_split,
                           split=flags.split, sequences=sequences,
                           fast_links=cluster.fast_links, predicted=predicted)
    how = "hostfile" if cluster.hostfile else "memory"
    cache = (kv_tokens, sequences if slots is None else slots)
    if layout.tp == 1:
        return _place_pipeline(cfg, sizes, cluster, layout, flags.split, cache, how, reserve)
    return _place_tensor(cfg, sizes, cluster, layout, flags.split, cache, how, reserve)


def _cache_bytes(cfg, start: int, end: int, kv_tokens: int, slots: int,
                 shard: Shard | None = None) -> int:
    """Bytes of the cache of layers ``[start, end)`` on a rank holding ``shard`` (its KV
    and linear-attention heads): ``kv_tokens`` tokens over ``slots`` sequences, as the
    cache allocates them (:func:`hpcmac.llm.model.cache.stage_cache_bytes`)."""
    from hpcmac.llm.model.cache import stage_cache_bytes

    local = cfg if shard is None else local_config(cfg, shard)
    return stage_cache_bytes(local, start, end, slots, kv_tokens)


def _layer_cache(cfg, cache: tuple[int, int]) -> list[int]:
    """Each layer's cache bytes, the whole model on one rank."""
    return [_cache_bytes(cfg, i, i + 1, *cache) for i in range(cfg.n_layers)]


def _left(budgets: list[float], reserve: int) -> list[float]:
    """The budgets the model's share may take: rank 0's less its ``reserve``."""
    return [budgets[0] - reserve, *budgets[1:]]


def _check_reserve(need: Sequence[int], budgets: Sequence[float], hosts: Sequence[str],
                   reserve: int) -> None:
    """Raise UsageError when rank 0's share and its ``reserve`` do not fit together."""
    if reserve and need[0] > budgets[0]:
        raise UsageError(
            f"rank 0 on {hosts[0]} needs {need[0] / GIB:.2f} GiB, {reserve / GIB:.2f} of "
            f"them the draft model and its KV cache, but its memory budget is "
            f"{budgets[0] / GIB:.2f} GiB: use a smaller --draft-model, --draft ngram, or "
            "more ranks")


def _place_pipeline(cfg, sizes, cluster: Cluster, layout: Layout, split,
                    cache: tuple[int, int], how: str, reserve: int = 0) -> Placement:
    """One rank per stage: layers by memory (or ``--split``), each stage whole.
    ``cache``: (KV tokens, sequence slots)."""
    p = cluster.size
    P.check_ranks(cfg.n_layers, p)
    layer_b, embed_b, head_b = sizes.whole()
    budgets = cluster.budgets()
    per_layer = [b + c for b, c in zip(layer_b, _layer_cache(cfg, cache))]
    if split:
        counts, how = P.parse_split(split, cfg.n_layers, p), "split"
    else:
        counts = P.proportional_counts(per_layer, embed_b, head_b, _left(budgets, reserve))
    specs = P.stages_from_counts(counts)
    need = P.stage_bytes(counts, per_layer, embed_b, head_b)
    need[0] += reserve
    _check_reserve(need, budgets, cluster.hosts, reserve)
    P.check_fit(specs, need, budgets, list(cluster.hosts))
    whole = full_shard(cfg)
    return Placement(layout, tuple(specs), tuple((whole,) for _ in specs), tuple(need),
                     tuple(budgets), tuple(cluster.hosts), how, tuple((1.0,) for _ in specs),
                     *cache, reserve)


def _place_tensor(cfg, sizes, cluster: Cluster, layout: Layout, split,
                  cache: tuple[int, int], how: str, reserve: int = 0) -> Placement:
    """``pp`` stages of ``tp`` ranks: layers by each stage's memory, heads and columns by
    each rank's share. ``cache``: (KV tokens, sequence slots)."""
    tp, pp = layout.tp, layout.pp
    budgets = cluster.budgets()
    hosts = list(cluster.hosts)
    P.check_ranks(cfg.n_layers, pp)
    left = _left(budgets, reserve)
    stage_budget = [sum(left[s * tp:(s + 1) * tp]) for s in range(pp)]
    if pp == 1:
        counts = [cfg.n_layers]
    elif split:
        counts, how = P.parse_split(split, cfg.n_layers, pp), "split"
    else:
        layer_b, embed_b, head_b = sizes.whole()
        counts = P.proportional_counts([b + c for b, c in zip(layer_b, _layer_cache(cfg, cache))],
                                       embed_b, head_b, stage_budget)
    stages = P.stages_from_counts(counts)
    shares, shards = [], []
    for s in range(pp):
        mine = left[s * tp:(s + 1) * tp]
        if layout.shares:
            sh = list(layout.shares)
        elif how == "hostfile":
            sh = mine
        else:  # measured: whole GiB, so ranks sharing a host get equal shares
            sh = [max(1.0, round(b / GIB)) for b in mine]
        shares.append(tuple(float(x) for x in sh))
        shards.append(tuple(make_shards(cfg, sh)))
    need = []
    for st in stages:
        for t in range(tp):
            shard = shards[st.rank][t]
            need.append(sizes.stage(st.start, st.end, st.first, st.last, shard)
                        + _cache_bytes(cfg, st.start, st.end, *cache, shard))
    need[0] += reserve
    _check_reserve(need, budgets, hosts, reserve)
    for r, (nb, b) in enumerate(zip(need, budgets)):
        if nb > b:
            st, t = stages[r // tp], r % tp
            sh = shards[st.rank][t]
            raise UsageError(
                f"rank {r} on {hosts[r]} (stage {st.rank}, tensor rank {t}: layers "
                f"[{st.start}, {st.end}), {sh.n_heads} of {cfg.n_heads} heads) needs "
                f"{nb / GIB:.2f} GiB but its memory budget is {b / GIB:.2f} GiB: add "
                "ranks or hosts, or give it a smaller share with --tp-split")
    return Placement(layout, tuple(stages), tuple(shards), tuple(need), tuple(budgets),
                     tuple(hosts), how, tuple(shares), *cache, reserve)


def fixed(cfg, hosts: Sequence[str], tp: int, counts: Sequence[int],
          why: str = "as asked") -> Placement:
    """A placement given outright: ``tp`` equal tensor shares, ``counts`` layers per stage
    (benchmarks and calibration, which measure set layouts; no budgets checked)."""
    stages = P.stages_from_counts(list(counts))
    shards = tuple(tuple(make_shards(cfg, [1.0] * tp)) for _ in stages)
    n = tp * len(stages)
    return Placement(Layout(tp, len(stages), None, why), tuple(stages), shards,
                     (0,) * n, (0.0,) * n, tuple(hosts), "split",
                     tuple((1.0,) * tp for _ in stages))

