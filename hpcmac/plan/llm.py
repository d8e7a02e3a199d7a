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

``backend="mlx"`` (a table part only): hpcmac's MLX backend on the GPU, with the
published step costs of :mod:`hpcmac.plan.mlx_cost` (kernels and command buffers a
layer, a cost per blocking host sync times the syncs the layout makes, counted by
:mod:`hpcmac.llm.parallel.host_syncs`, a CPU-GPU crossing per collective in the
graph) and the weights at the GPU's published bandwidth; every such prediction is
labelled "published, not measured here".

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
from hpcmac.llm.parallel import host_syncs
from hpcmac.plan import mlx_cost
from hpcmac.plan.cluster import Cluster
from hpcmac.plan.machines import MACHINES, Link
from hpcmac.plan.shape import ModelShape

LAYOUTS = ("pipeline", "tensor", "hybrid", "star")
#: ``LlmCase.backend``: "" the node's own figures (a calibration's CPU decoder, or the
#: table's peaks), "mlx" hpcmac's MLX backend on a table part's GPU
BACKENDS = ("", "mlx")
#: transports of the MLX backend's tensor groups: an MLX group (ring: TCP, rdma: JACCL)
#: or MPI (the numpy bridge)
MLX_TRANSPORTS = ("ring", "rdma", "mpi")
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
    backend: str = ""      # "" or "mlx" (BACKENDS)
    transport: str = ""    # mlx: ring, rdma or mpi; "" = rdma on an RDMA link, else ring
    fast_synch: bool = False   # mlx: MLX_METAL_FAST_SYNCH=1 (exo sets it; hpcmac does not)

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
    backend: str = ""          # "mlx": the MLX terms below are in the times above
    host_syncs: float = 0.0    # mlx: host syncs a token waits on (each rank of each stage)
    sync_s: float = 0.0        # mlx: per token, what those syncs cost
    figures: str = ""          # mlx: the published figures used, labelled as such
    sums: str = ""             # mlx, tp > 1: "in the graph" (an MLX group) or "numpy bridge"

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


def mlx_transport(cluster: Cluster, case: LlmCase) -> str:
    """The MLX backend's tensor-group transport for ``case``, checked against the link
    (one clear line when they do not agree)."""
    if case.backend not in BACKENDS:
        raise UsageError(f"backend must be '' or 'mlx', got {case.backend!r}")
    if case.backend != "mlx":
        if case.transport or case.fast_synch:
            raise UsageError("--transport and --mlx-fast-synch describe the MLX backend: "
                             "add --backend mlx")
        return ""
    if case.star:
        raise UsageError("--backend mlx: the star layout is llama.cpp RPC's, not an MLX "
                         "backend's; use --layout pipeline, tensor or hybrid")
    t = case.transport or ("rdma" if cluster.link.rdma else "ring")
    if t not in MLX_TRANSPORTS:
        raise UsageError(f"--transport must be one of {', '.join(MLX_TRANSPORTS)}, got {t!r}")
    if t == "rdma" and len(cluster.nodes) > 1 and not cluster.link.rdma:
        raise UsageError(f"--transport rdma (JACCL) needs an RDMA link; the link is "
                         f"{cluster.link.name}: use --link tb5-rdma or --transport ring")
    return t


def predict(cluster: Cluster, shape: ModelShape, case: LlmCase) -> LlmPrediction:
    """Predicted decode and prefill for ``shape`` on ``cluster`` in ``case``'s layout."""
    tp, pp, B = case.tp, case.pp, case.batch
    if tp < 1 or pp < 1 or B < 1:
        raise UsageError(f"tp, pp and batch must be >= 1, got {tp}, {pp}, {B}")
    if case.star and tp != 1:
        raise UsageError("the star layout (llama.cpp RPC) has no tensor groups: tp must be 1")
    transport = mlx_transport(cluster, case)
    mlx = mlx_cost.MLX if case.backend == "mlx" else None
    if mlx is not None:
        for n in cluster.nodes:
            if not n.rates.gpu_read_gbs:
                raise UsageError(
                    f"--backend mlx: node {n.name} has no published GPU figures (a "
                    "calibration measures hpcmac's CPU decoder, not a GPU): give --machine "
                    f"({', '.join(MACHINES)}) or a hostfile 'machine'")
    graph = host_syncs.graph_sums(tp, pp, transport)
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
        if mlx is not None:  # the node's one GPU, shared by its ranks
            return (node.rates.gpu_read_gbs * 1e9 / active_per_node,
                    node.rates.matrix_flops(1) / active_per_node)
        busy = max(1, min(node.rates.cores, active_per_node))
        bw = node.rates.read_bw_at(busy) / active_per_node
        flops = node.rates.matrix_flops(busy) / active_per_node
        return bw, flops

    def stage_syncs(s: int) -> int:
        return host_syncs.stage_syncs(bounds[s + 1] - bounds[s], s == 0, tp, graph)

    def stage_time(s: int, b: int, tokens: int, active: int, prefill: bool) -> tuple:
        """(weights-or-flops s, fixed s, all-reduce s, host syncs s) of stage s for b
        sequences."""
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
        sync = 0.0
        if mlx is not None:  # published MLX-on-Metal step costs (mlx_cost)
            fixed += mlx.step_fixed_s(hi - lo)
            if not host_syncs.pipelined(tp, pp):
                sync = stage_syncs(s) * mlx.host_sync_s
            if tp > 1:  # beside the layers': the embedding's sum (first stage) and the
                # head's max-loc (last), each a collective over the group
                edge = (s == 0) + (s == pp - 1)
                ar += edge * allreduce_s(link, tp, tokens * shape.hidden * case.act_bytes)
                if graph:  # no all_sum on Metal's GPU: each collective crosses to the CPU
                    ar += ((hi - lo) * 2 + edge) * mlx.crossing(case.fast_synch)
        if tp > 1:  # the tensor runtime's own costs, measured at 2 ranks (calibrate)
            rt = node_of[s].rates
            # each rank posts to, and adds the part of, every other rank
            ar += (tp - 1) * ((hi - lo) * 2 * rt.reduce_s + rt.tp_step_s)
            # the slowest of tp ranks sets each segment's pace: the expected maximum
            # of tp draws grows about as log2(tp) times that of two
            ar += work * rt.tp_sync_frac * math.log2(tp)
        return work, fixed, ar, sync

    def hops(b: int) -> float:
        if pp == 1:
            return 0.0
        msg = b * shape.link_width * case.act_bytes
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
    stream = sum(w for w, _, _, _ in one)
    fixed = sum(f for _, f, _, _ in one)
    ar = sum(a for _, _, a, _ in one)
    sync = sum(y for _, _, _, y in one)
    hop = hops(1)
    t1 = stream + fixed + ar + sync + hop + node_of[0].rates.token_s
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
    extra: dict = {}
    if mlx is not None:
        bw = sorted({f"{n.rates.name} {n.rates.gpu_read_gbs:g} GB/s {n.rates.gpu_read_source}"
                     for n in node_of})
        extra = dict(backend="mlx", host_syncs=float(sum(stage_syncs(s) for s in range(pp))),
                     sync_s=sync,
                     figures=f"{mlx.describe(case.fast_synch)}; GPU weights at {', '.join(bw)}",
                     sums=("in the graph" if graph else "numpy bridge") if tp > 1 else "")
    return LlmPrediction(
        model=shape.name, layout=case.layout, tp=tp, pp=pp, batch=B, decode_tok_s=1.0 / t1,
        batch_tok_s=B / tb, ttft_s=ttft, stream_s=stream, fixed_s=fixed, allreduce_s=ar,
        hops_s=hop, layers=tuple(counts), memory_gb=max(held) / 1e9, fits=fits, note=note,
        **extra)


def layouts(nranks: int, n_layers: int) -> list[tuple[int, int]]:
    """Every (tp, pp) with tp * pp = nranks and pp <= n_layers."""
    return [(t, nranks // t) for t in range(1, nranks + 1)
            if nranks % t == 0 and nranks // t <= n_layers]


def choose(cluster: Cluster, shape: ModelShape, batch: int = 1, prompt: int = 512,
           context: int = 2048, nranks: int | None = None, act_bytes: int = 2,
           kv_bytes: int = 2, **mlx) -> list[LlmPrediction]:
    """Every layout for the cluster's ranks, fastest first for ``batch`` sequences
    (layouts that do not fit last). ``mlx``: ``backend``, ``transport``, ``fast_synch``
    as :class:`LlmCase`'s."""
    nranks = nranks or cluster.ranks
    out = [predict(cluster, shape, LlmCase(t, p, False, batch, prompt, context, act_bytes,
                                           kv_bytes, **mlx))
           for t, p in layouts(nranks, shape.n_layers)]
    out.sort(key=lambda r: (not r.fits, -(r.batch_tok_s if batch > 1 else r.decode_tok_s)))
    return out
