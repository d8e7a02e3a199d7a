"""One runtime brings a rank up from a :class:`~.placement.Placement`, whoever asks.

``generate``, ``serve``, ``bench.llm_parallel`` and ``plan calibrate`` all go
through the same three steps (collective: every rank of the group calls each):

1. :func:`gather_cluster`: each rank's host and memory, and the hostfile (read
   once by the job, :func:`read_job_hostfile`) -> a :class:`~.placement.Cluster`;
2. :func:`agree_placement`: rank 0 computes :func:`~.placement.place` (pure) and
   every rank gets the same value, or the same one-line refusal;
3. :func:`bring_up`: the tensor and pipeline groups, this rank's stage loaded
   with its shard, and the waiting policy (the watchdog's ``timeout``) -> a
   :class:`Runtime`, whose :meth:`Runtime.run` generates (a batch, or serve's
   live requests) through the pipeline of tensor groups.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from hpcmac.comm.base import Group
from hpcmac.errors import UsageError
from hpcmac.llm.parallel.placement import Cluster, LayoutFlags, ModelSizes, Placement, place
from hpcmac.llm.parallel.plan import HostMemory, agree, available_memory
from hpcmac.llm.parallel.tensor import Groups, TensorGroup, follow, make_groups

HOSTFILE_ENV = "HPCMAC_HOSTFILE"


# -- the inputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class JobHostfile:
    """The job's hostfile, read and checked once (global once agreed): its path, its
    parsed JSON (``data``: the planner reads ``link`` and ``machine`` there) and its
    hosts' memory."""

    path: str
    data: Any
    hosts: tuple[HostMemory, ...]


def hostfile_path(flag: str | None) -> str | None:
    """``--hostfile``, else ``HPCMAC_HOSTFILE`` (set by ``hpcmac.launch``), else None."""
    return flag or os.environ.get(HOSTFILE_ENV) or None


def read_job_hostfile(path: str | None) -> JobHostfile | None:
    """The hostfile at ``path`` (one read per process, shared with what ``comm.init`` was
    handed: ``launch.hostfile.job_hostfile``; UsageError naming the file when it is bad)."""
    if not path:
        return None
    from hpcmac.launch.hostfile import job_hostfile_with_data

    hf, data = job_hostfile_with_data(path)
    return JobHostfile(str(path), data,
                       tuple(HostMemory(h.name, h.slots, h.memory_gb) for h in hf.hosts))


def gather_cluster(group: Group, hostfile: JobHostfile | None = None) -> Cluster:
    """Collective: every rank's host and available memory, and the hostfile's budgets."""
    mem = group.allgather_obj((socket.gethostname(), available_memory()))
    return Cluster(tuple(h for h, _ in mem), tuple(int(a) for _, a in mem),
                   hostfile.hosts if hostfile else None, getattr(group, "transport", "") or "")


def agree_placement(group: Group, cfg, model: str, cluster: Cluster,
                    flags: LayoutFlags | None = None, *, kv_tokens: int, sequences: int = 1,
                    slots: int | None = None,
                    predicted: tuple[int, int, str] | None = None, quantize: int | None = None,
                    group_size: int = 64, draft: str | None = None) -> Placement:
    """Collective: rank 0 places the model (:func:`~.placement.place`, reading the
    checkpoint's headers); every rank returns the same :class:`Placement` or raises the
    same UsageError, before any weights load. ``draft``: speculative decoding's draft
    model (a path; "ngram" or None hold nothing), whose weights and KV cache world rank 0
    holds besides its share (:func:`draft_bytes`)."""
    flags = flags or LayoutFlags()
    n = sequences if slots is None else slots
    return agree(group, lambda: place(cfg, ModelSizes(model, quantize, group_size), cluster,
                                      flags, kv_tokens=kv_tokens, sequences=sequences, slots=slots,
                                      predicted=predicted,
                                      reserve=draft_bytes(draft, kv_tokens, n)), ranks="root")


def draft_bytes(draft: str | None, kv_tokens: int, slots: int) -> int:
    """Bytes the drafter holds on world rank 0 (:func:`_drafter`): the draft model whole,
    as stored, and its cache of the target's ``slots`` x length (``kv_tokens``); 0 for
    the n-gram lookup or none. Read from the checkpoint's headers, nothing loaded."""
    if not draft or draft == "ngram":
        return 0
    from hpcmac.llm.model.cache import stage_cache_bytes
    from hpcmac.llm.model.config import load_config

    layers, embed, head = ModelSizes(draft).whole()
    dcfg = load_config(draft)
    return sum(layers) + embed + head + stage_cache_bytes(dcfg, 0, dcfg.n_layers, slots,
                                                          kv_tokens)


def agree_prefix_cache(group: Group, cfg, placement: Placement,
                       gb: float | None) -> tuple[int, int, int, str]:
    """Collective: (blocks, one block's bytes on the rank holding the most, the blocks a
    block's linear-attention states take besides (0: none), the line saying so) of the
    prefix cache under ``--prefix-cache-gb gb`` (:func:`~.prefix.capacity`,
    :func:`~.prefix.state_cost`), or every rank raises the same UsageError, before any
    weights load."""
    from hpcmac.llm.parallel import prefix

    def size():
        n, line = prefix.capacity(cfg, placement, gb)
        return (n, max(prefix.block_bytes(cfg, placement)),
                prefix.state_cost(cfg, placement), line)

    return agree(group, size, ranks="root")


def agree_draft(group: Group, draft: str | None, model: str, cfg) -> None:
    """Collective: speculative decoding can run: ``--draft-model``'s vocabulary is
    ``--model``'s (:func:`~hpcmac.llm.model.speculative.check_draft_model`) and neither
    model has linear-attention layers, read on rank 0 before any weights load; or the
    same one-line UsageError on every rank. ``draft``: the draft's path, "ngram" or None."""
    if draft:
        from hpcmac.llm.model.speculative import check_draft_model, check_rewinds

        def check():
            check_rewinds(model, cfg, "--model")
            if draft != "ngram":
                check_rewinds(draft, check_draft_model(draft, model, cfg), "--draft-model")

        agree(group, check, ranks="root")


# -- one rank, up --------------------------------------------------------------------------


@dataclass
class Runtime:
    """One rank of a job, brought up (local; the placement is global)."""

    placement: Placement
    groups: Groups  # the world, this rank's tensor group, the stages' leaders
    tensor: TensorGroup | None  # this stage's tensor group (None: one rank a stage)
    stage: Any  # the loaded stage (hpcmac.llm.model.stage.Stage) of this rank's shard
    hidden: int  # the model's hidden size
    timeout: float  # the waiting policy: seconds a rank waits on a silent peer
    drafter: Any = None  # speculative decoding's drafter (world rank 0 only)

    @property
    def world(self) -> Group:
        return self.groups.world

    @property
    def me(self):
        """This rank's :class:`~.placement.RankPlace`."""
        return self.placement.rank(self.world.rank)

    @property
    def spec(self):
        return self.placement.stages[self.groups.stage]

    def run(self, requests=None, threads: int | None = None, **kw):
        """Collective over the world: generate ``requests`` (world rank 0), or serve a
        live ``source=`` (``kw`` as :func:`~.pipeline.run_pipeline`'s). ``threads``: the
        BLAS threads of this rank while it runs (``--threads``; None: the library's own
        choice, which ``hpcmac-mpirun`` sets to the host's cores over its ranks)."""
        if self.drafter is not None:
            kw.setdefault("drafter", self.drafter)
        limits = None
        if threads is not None:
            from threadpoolctl import threadpool_limits

            limits = threadpool_limits(threads)
        try:
            return run_tensor_pipeline(self.groups, self.tensor, self.stage, self.spec,
                                       self.hidden, requests, timeout=self.timeout, **kw)
        finally:
            if limits is not None:
                limits.unregister()


def bring_up(group: Group, placement: Placement, model: str, cfg, *, backend: str = "numpy",
             quantize: int | None = None, group_size: int = 64,
             int8_activations: bool | None = None, timeout: float = 60.0,
             draft: str | None = None) -> Runtime:
    """Collective: this rank's groups, tensor group and stage, from ``placement``.

    ``model``, ``cfg``: the checkpoint and its config; ``backend``, ``quantize``,
    ``group_size``, ``int8_activations`` as ``load_stage``'s; ``timeout``: seconds a
    rank waits on a silent peer before ending the job (0: no watchdog); ``draft``:
    speculative decoding's drafter, "ngram" or a draft model's path (its vocabulary
    checked before, :func:`~hpcmac.llm.model.speculative.check_draft_model`),
    brought up on world rank 0, the first stage's leader, whose scheduler drafts.

    A load error on any rank is raised on every rank (:func:`~.plan.agree`).
    """
    from hpcmac.llm.model.stage import load_stage

    if group.size != placement.size:
        raise ValueError(f"bring_up: a placement of {placement.size} ranks on a group of "
                         f"{group.size}")
    tp = placement.tp
    groups = make_groups(group, tp, placement.hosts)
    spec = placement.stages[groups.stage]
    shard = placement.shards[groups.stage][groups.tp_rank]
    tg = None
    if tp > 1:
        members = placement.members(groups.stage)
        tg = TensorGroup(groups.tensor, [placement.hosts[r] for r in members], timeout,
                         ranks=members)
        tg.set_vocab_slices([sh.vocab[1] - sh.vocab[0]
                             for sh in placement.shards[groups.stage]])
    reduce = tensor_reduce(tg, backend, group) if tg else None
    stage = agree(group, lambda: load_stage(
        model, spec.start, spec.end, first=spec.first, last=spec.last, backend=backend,
        quantize=quantize, group_size=group_size, shard=shard if tp > 1 else None,
        reduce=reduce, int8_activations=int8_activations))
    drafter = agree(group, lambda: _drafter(draft, backend) if group.rank == 0 else None)
    return Runtime(placement, groups, tg, stage, cfg.residual_width, timeout, drafter)


def tensor_reduce(tg: TensorGroup, backend: str, world: Group):
    """The reduce callable the model gets: on MLX over an MLX group (``--transport ring``
    or ``rdma``, one tensor group of the whole job), the sums inside MLX's graph
    (:meth:`TensorGroup.graph_sum`); otherwise the numpy all-reduce (the host syncs
    either costs a token: :mod:`hpcmac.llm.parallel.host_syncs`). ``--backend mlx``
    over a transport that cannot carry MLX arrays falls back to the numpy bridge and
    says so once (world rank 0); ``HPCMAC_TRANSPORT_STRICT=1`` makes that an error (the
    same on every rank, before any weights load)."""
    if backend != "mlx":
        return tg.allreduce
    graph = tg.graph_sum()
    if graph is not None:
        return graph
    from hpcmac.comm.select import strict_from_env

    why = (f"the tensor group's transport ({getattr(tg.group, 'transport', '') or 'mpi'}) "
           "cannot carry MLX arrays")
    if getattr(world, "native", None) is not None:  # an MLX job whose tensor group is a split
        why = "MLX's groups cannot split (mlx#3205): a tensor group of a pipeline is MPI's"
    if strict_from_env():
        raise UsageError(f"--backend mlx: {why} (HPCMAC_TRANSPORT_STRICT=1; use --transport "
                         "ring or rdma with one tensor group, or unset it for the numpy bridge)")
    if world.rank == 0:
        from hpcmac.llm.parallel.host_syncs import BRIDGE_SYNCS_PER_LAYER

        print(f"note: --backend mlx: {why}; the tensor-parallel sums go through numpy "
              f"({BRIDGE_SYNCS_PER_LAYER} host syncs a layer; --transport ring or rdma keeps "
              "them in MLX's graph)", file=sys.stderr, flush=True)
    return tg.allreduce


def _drafter(draft: str | None, backend: str):
    """The drafter on world rank 0: the draft model whole, as stored (a quantized GGUF
    kept quantized; on the numpy backend with 8-bit activations, llama.cpp's way: a
    draft's rounding changes what it proposes, never the output; SmolLM2's Q4_1 drafting
    for its F32 form, 48 tokens, K 4, load average 13: 4.7 s drafting against 5.8 s,
    36 of 40 drafts accepted against 37 of 37), or the n-gram lookup."""
    from hpcmac.llm.model import speculative

    if draft is None:
        return None
    if draft == "ngram":
        return speculative.NgramDrafter()
    from hpcmac.llm.model.config import load_config
    from hpcmac.llm.model.stage import load_stage

    n = load_config(draft).n_layers
    return speculative.ModelDrafter(load_stage(draft, 0, n, backend=backend,
                                               int8_activations=backend == "numpy" or None))


def run_tensor_pipeline(groups: Groups, tg: TensorGroup | None, stage, spec, hidden: int,
                        requests, *, timeout: float = 60.0, **kw):
    """Collective over ``groups.world``: generate through ``pp`` stages of ``tp`` ranks.

    The leaders run :func:`~hpcmac.llm.parallel.pipeline.run_pipeline` among
    themselves (``requests`` on world rank 0; ``kw`` as there); the followers
    :func:`~hpcmac.llm.parallel.tensor.follow`. Returns the same ``PipelineResult``
    on every rank, with each tensor rank's all-reduce counters in ``result.tensor``.
    ``busy=`` (a :class:`~.busy.BusyBoard` on every rank, serve): each rank's busy time
    reaches rank 0's board while it runs (:mod:`.busy`).
    """
    import time

    from hpcmac.llm.parallel.busy import BusyCollector, BusyReporter, channel
    from hpcmac.llm.parallel.pipeline import run_pipeline

    tp, pp = groups.tp, groups.pp
    res = None
    busy = channel(groups.world, kw.pop("busy", None), time.perf_counter())
    if groups.pipe is not None:
        hosts = [groups.hosts[s * tp] for s in range(pp)]
        res = run_pipeline(groups.pipe, stage, spec, hidden, requests, timeout=timeout,
                           hosts=hosts, tensor=tg if tp > 1 else None,
                           ranks=[s * tp for s in range(pp)], on_step=busy, **kw)
    else:
        max_slots, max_len = tg.group.bcast_obj(None, 0)
        follow(tg, stage, spec.first, spec.last, hidden, max_slots, max_len,
               grace=1.0 + pp, on_step=busy)
    if isinstance(busy, BusyReporter):
        busy.final()
    if tp > 1:
        res = tg.group.bcast_obj(res, 0)
        stats = groups.world.allgather_obj(
            {"rank": groups.world.rank, "stage": groups.stage, "tp_rank": groups.tp_rank,
             **tg.stats.__dict__})
        res.tensor = stats
    if isinstance(busy, BusyReporter):
        busy.close()
    elif isinstance(busy, BusyCollector):
        busy.drain()
    return res

