"""LLM decode and prefill model: bytes streamed, fixed costs, all-reduces and hops.

A layout is ``tp`` ranks per stage times ``pp`` stages (pipeline: tp = 1;
tensor: pp = 1; hybrid: both > 1; ``star``: llama.cpp RPC's layer split, where
the main host talks to every other stage and back). Ranks go onto nodes by
slot, stage after stage, so a tensor group shares a node when it can. For one
decode step of ``B`` sequences, stage ``s`` costs

* its layers' weight bytes (routed experts: only those the B tokens pick,
  ``E (1 - (1 - k/E)^B)`` of E) plus, on the last stage, the head, split over
  the tensor group by the largest share of attention heads any rank holds,
  over the rank's memory bandwidth (each core at most what one core's decoder
  reaches alone, the node's ranks together at most its read bandwidth at that
  many cores); or the flops at the node's rate if that is longer (prefill);
* a fixed cost per layer of the runtime (kernel launches, Python): measured
  by ``calibrate``, unknown (0) for a table part;
* with tp > 1, two all-reduces of ``B x hidden`` activations per layer over the
  tensor group's link (ring or recursive doubling, the cheaper), plus the
  tensor runtime's own cost per all-reduce and per step as ``calibrate``
  measured it at 2 ranks (:mod:`hpcmac.plan.tensor_cost`; ``tp - 1`` times
  that, each rank posting a message to every other; 0 for a table part), and
  the streaming stretched by ``log2(tp)`` times the measured ``sync_frac``
  (the slowest rank sets each segment's pace);
* with pp > 1, one hop per stage boundary and one back to the first stage
  with the tokens (``star``: two hops per remote stage): the link's time, plus
  the pipeline runtime's own cost per hop as ``calibrate`` measured it
  (``hop_s``; 0 for a table part).

Single stream: the stages run in turn. B sequences: in the pipeline as ``pp``
micro-batches, the step takes the longer of one pass and ``pp`` times the
slowest stage. Time to first token: the prompt's flops (and attention's
``P^2`` term) at the node's matrix rate, the weights streamed once, the same
all-reduces and hops with ``P`` tokens. Pure: no I/O, no MPI.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hpcmac.errors import UsageError
from hpcmac.plan.cluster import Cluster
from hpcmac.plan.machines import Link
from hpcmac.plan.shape import ModelShape

LAYOUTS = ("pipeline", "tensor", "hybrid", "star")
#: share of a node's memory the weights and cache may take
USABLE = 0.9


@dataclass(frozen=True)
class LlmCase:
    """The workload and layout (global)."""

    tp: int = 1
    pp: int = 1
    star: bool = False
    batch: int = 1
    prompt: int = 512
    context: int = 2048
    act_bytes: int = 2     # bytes of one activation element on the wire (fp16; hpcmac numpy: 4)
    kv_bytes: int = 2      # bytes of one KV cache element

    @property
    def layout(self) -> str:
        if self.star:
            return "star"
        if self.tp > 1 and self.pp > 1:
            return "hybrid"
        return "tensor" if self.tp > 1 else "pipeline"


@dataclass(frozen=True)
class LlmPrediction:
    model: str
    layout: str
    tp: int
    pp: int
    batch: int
    decode_tok_s: float        # one sequence
    batch_tok_s: float         # B sequences together (aggregate)
    ttft_s: float              # time to first token of a ``prompt``-token prompt
    stream_s: float            # per token, single stream: weights over bandwidth
    fixed_s: float             # per token: runtime cost per layer
    allreduce_s: float         # per token: tensor-parallel all-reduces
    hops_s: float              # per token: pipeline hops
    layers: tuple[int, ...]    # layers per stage
    memory_gb: float           # the fullest rank's weights + KV cache
    fits: bool
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def split_layers(n: int, weights: list[float]) -> list[int]:
    """``n`` layers over stages in proportion to ``weights`` (largest remainders), each >= 1."""
    if len(weights) > n:
        raise UsageError(f"{len(weights)} pipeline stages for a model of {n} layers")
    total = sum(weights)
    raw = [n * w / total for w in weights]
    counts = [max(1, int(r)) for r in raw]
    while sum(counts) < n:
        i = max(range(len(raw)), key=lambda j: raw[j] - counts[j])
        counts[i] += 1
    while sum(counts) > n:
        i = max((j for j in range(len(counts)) if counts[j] > 1), key=lambda j: counts[j] - raw[j])
        counts[i] -= 1
    return counts


def _group_link(cluster: Cluster, where: list[int], ranks: list[int]) -> Link:
    if len({where[r] for r in ranks}) > 1:
        return cluster.link
    return cluster.local


def allreduce_s(link: Link, t: int, nbytes: float) -> float:
    """One all-reduce of ``nbytes`` over ``t`` ranks: ring or recursive doubling."""
    if t <= 1:
        return 0.0
    ring = 2 * (t - 1) * link.alpha_s + 2.0 * (t - 1) / t * nbytes / link.beta_bps
    doubling = math.ceil(math.log2(t)) * (link.alpha_s + nbytes / link.beta_bps)
    return min(ring, doubling)


def predict(cluster: Cluster, shape: ModelShape, case: LlmCase) -> LlmPrediction:
    """Predicted decode and prefill for ``shape`` on ``cluster`` in ``case``'s layout."""
    tp, pp, B = case.tp, case.pp, case.batch
    if tp < 1 or pp < 1 or B < 1:
        raise UsageError(f"tp, pp and batch must be >= 1, got {tp}, {pp}, {B}")
    if case.star and tp != 1:
        raise UsageError("the star layout (llama.cpp RPC) has no tensor groups: tp must be 1")
    nranks = tp * pp
    where = cluster.placement(nranks)
    per_node = [where.count(i) for i in range(len(cluster.nodes))]
    stages = [list(range(s * tp, (s + 1) * tp)) for s in range(pp)]
    node_of = [cluster.nodes[where[g[0]]] for g in stages]
    mem_rank = [n.rates.memory_gb * 1e9 / per_node[where[g[0]]] for n, g in zip(node_of, stages)]
    counts = split_layers(shape.n_layers, [m * tp for m in mem_rank])
    bounds = [sum(counts[:s]) for s in range(pp + 1)]
    share = math.ceil(shape.n_heads / tp) / shape.n_heads   # the fullest rank's part
    note = "" if shape.n_heads % tp == 0 else \
        f"{shape.n_heads} heads over {tp} ranks: uneven, the fullest holds {share:.1%}"

    def rank_rates(s: int, active_per_node: int) -> tuple[float, float]:
        """(bytes/s, flop/s) of one rank of stage s when ``active_per_node`` ranks work."""
        node = node_of[s]
        busy = max(1, min(node.rates.cores, active_per_node))
        bw = node.rates.read_bw_at(busy) / active_per_node
        flops = node.rates.matrix_flops(busy) / active_per_node
        return bw, flops

    def stage_time(s: int, b: int, tokens: int, active: int, prefill: bool) -> tuple:
        """(weights-or-flops s, fixed s, all-reduce s) of stage s for b sequences."""
        lo, hi = bounds[s], bounds[s + 1]
        bw, flops = rank_rates(s, active)
        nbytes = sum(shape.layer_bytes_read(i, tokens if prefill else b)
                     for i in range(lo, hi)) * share
        params = sum(shape.layers[i].dense + shape.layers[i].expert * shape.layers[i].k_active
                     for i in range(lo, hi)) * share
        fl = 2.0 * params * tokens
        if prefill:  # causal attention: P^2 / 2 scores and values per head
            fl += (hi - lo) * 2.0 * tokens * tokens * shape.n_heads * share \
                * (shape.kv_per_token_layer / max(1, 2 * shape.n_kv_heads))
        if s == pp - 1:
            nbytes += shape.head * shape.table_bits / 8 / tp
            fl += 2.0 * shape.head * b / tp   # logits of the last token of each sequence
        # the cache read: context tokens per sequence by attention, the fixed states of
        # linear attention
        if not prefill:
            nbytes += shape.cache_elements(lo, hi, b, case.context) * case.kv_bytes * share
        work = max(nbytes / bw, fl / flops)
        fixed = (hi - lo) * node_of[s].rates.layer_s
        link = _group_link(cluster, where, stages[s])
        ar = (hi - lo) * 2 * allreduce_s(link, tp, tokens * shape.hidden * case.act_bytes)
        if tp > 1:  # the tensor runtime's own costs, measured at 2 ranks (calibrate)
            rt = node_of[s].rates
            # each rank posts to, and adds the part of, every other rank
            ar += (tp - 1) * ((hi - lo) * 2 * rt.reduce_s + rt.tp_step_s)
            # the slowest of tp ranks sets each segment's pace: the expected maximum
            # of tp draws grows about as log2(tp) times that of two
            ar += work * rt.tp_sync_frac * math.log2(tp)
        return work, fixed, ar

    def hops(b: int) -> float:
        if pp == 1:
            return 0.0
        msg = b * shape.hidden * case.act_bytes
        t = 0.0
        for s in range(pp):
            nxt = (s + 1) % pp
            link = _group_link(cluster, where, [stages[s][0], stages[nxt][0]])
            # the runtime's own cost per hop (calibrate; 0 for a table part)
            rt = node_of[nxt].rates.hop_s
            if case.star:
                if s > 0:  # main host -> stage s -> main host
                    t += 2 * (link.time(msg) + rt)
            else:
                t += link.time(msg if nxt else 8.0 * b) + rt
        return t

    def active(s_all: bool) -> int:
        # ranks of one node working at once: a tensor group (stages in turn) or all of them
        return max(per_node) if s_all else max(
            sum(1 for r in g if where[r] == where[g[0]]) for g in stages)

    one = [stage_time(s, 1, 1, active(False), False) for s in range(pp)]
    stream = sum(w for w, _, _ in one)
    fixed = sum(f for _, f, _ in one)
    ar = sum(a for _, _, a in one)
    hop = hops(1)
    t1 = stream + fixed + ar + hop + node_of[0].rates.token_s
    if B == 1:
        tb = t1
    else:
        mb = math.ceil(B / pp)
        per = [sum(stage_time(s, mb, mb, active(pp > 1), False)) for s in range(pp)]
        per[0] += node_of[0].rates.token_s
        tb = max(sum(per) + hops(mb), pp * max(per)) if pp > 1 else per[0]
    pre = [sum(stage_time(s, 1, case.prompt, active(False), True)) for s in range(pp)]
    ttft = sum(pre) + hops(case.prompt)
    held = []
    for s in range(pp):
        lo, hi = bounds[s], bounds[s + 1]
        w = sum(shape.layer_bytes_held(i) for i in range(lo, hi)) * share
        if s == 0:
            w += shape.embed * shape.table_bits / 8 / tp
        if s == pp - 1 and not (shape.tied and pp == 1):
            w += shape.head * shape.table_bits / 8 / tp
        w += shape.cache_elements(lo, hi, B, case.context) * case.kv_bytes * share
        held.append(w)
    fits = all(h <= USABLE * m for h, m in zip(held, mem_rank))
    return LlmPrediction(
        model=shape.name, layout=case.layout, tp=tp, pp=pp, batch=B, decode_tok_s=1.0 / t1,
        batch_tok_s=B / tb, ttft_s=ttft, stream_s=stream, fixed_s=fixed, allreduce_s=ar,
        hops_s=hop, layers=tuple(counts), memory_gb=max(held) / 1e9, fits=fits, note=note)


def layouts(nranks: int, n_layers: int) -> list[tuple[int, int]]:
    """Every (tp, pp) with tp * pp = nranks and pp <= n_layers."""
    return [(t, nranks // t) for t in range(1, nranks + 1)
            if nranks % t == 0 and nranks // t <= n_layers]


def choose(cluster: Cluster, shape: ModelShape, batch: int = 1, prompt: int = 512,
           context: int = 2048, nranks: int | None = None, act_bytes: int = 2,
           kv_bytes: int = 2) -> list[LlmPrediction]:
    """Every layout for the cluster's ranks, fastest first for ``batch`` sequences
    (layouts that do not fit last)."""
    nranks = nranks or cluster.ranks
    out = [predict(cluster, shape, LlmCase(t, p, False, batch, prompt, context, act_bytes,
                                           kv_bytes))
           for t, p in layouts(nranks, shape.n_layers)]
    out.sort(key=lambda r: (not r.fits, -(r.batch_tok_s if batch > 1 else r.decode_tok_s)))
    return out
