"""Tensor parallelism: the ranks of a tensor group each hold a shard of every layer.

A job of ``tp x pp`` ranks is ``pp`` pipeline stages, each a tensor group of
``tp`` consecutive ranks (world rank ``s * tp + t``). Rank ``t = 0`` of a
group, its *leader*, takes part in the pipeline (:mod:`.pipeline`) as the
stage; before each step it sends the step (meta rows and token ids or hidden
states) to the other ranks of its group, its *followers*, and all of them run
their shards. The model sums partial results through :meth:`TensorGroup.allreduce`,
a plain callable (it never sees a ``Group``): twice per layer, once per
embedding. The head is vocabulary-parallel: for greedy steps each rank sends
its best (logit, id) per row to the leader (a max-loc), otherwise its slice of
the logits (a gather).

Messages (all through ``hpcmac.comm``, non-blocking, waited on by the
pipeline's :class:`~.link.Watchdog`, so a silent peer ends the job with its
rank and host named):

* all-reduce, tag ``TAG_SUM``: every rank sends its float32 partial to every
  other rank; each sums the parts in rank order, so every rank holds the same
  bits (greedy tokens and expert routing agree on every rank). When the whole
  group is on one x86-64 host, partials of up to 64 KB (decode) go through a
  shared mapping instead (:mod:`.shmsum`: same parts, same order, same bits).
  There the leader also rings the mapping's doorbell once it has posted each
  message below (header and payload), and a follower waits on it (a futex on
  Linux) before it receives them.
* leader -> followers, tag ``TAG_STEP``: ``int32[4] = (kind, n, T, mode)``,
  then for ``FWD`` the meta rows ``int32 (n, 5)`` and the token ids (int64,
  first stage) or hidden states (float32 ``(T, hidden)``); for ``CTRL`` a
  dict of ``n`` bytes in comm.wire's plain tagged format (never pickle): the slots
  freed and the prefix cache's block instructions;
  ``STOP`` ends the followers' loop; ``PING`` (a header alone) is an idle
  server's sign of life, so that the followers' watchdogs keep waiting.
  A step whose mode carries ``MASKED`` is followed by the sampled rows' packed
  grammar masks, int32 ``(k, ceil(vocab / 32))``: each rank masks its own
  vocabulary slice before its max-loc (constrained decoding, :mod:`hpcmac.llm.grammar`).
* followers -> leader, tag ``TAG_HEAD``: ``(k, 2)`` float64 (best logit, id)
  rows, or the ``(k, vocab slice)`` float32 logits.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hpcmac.comm.base import Group
from hpcmac.llm.parallel.link import Watchdog
from hpcmac.llm.parallel.tags import TAG_HEAD, TAG_STEP, TAG_SUM

FWD, CTRL, STOP, PING = 1, 2, 3, 4
GATHER, MAXLOC = 0, 1
MASKED = 4  # a step header's mode flag: the sampled rows' grammar masks follow
META = 5


@dataclass
class TensorStats:
    """One rank's all-reduce counters (local)."""

    reduces: int = 0
    sent_bytes: int = 0
    wait_s: float = 0.0  # wall time inside allreduce (communication and waiting)
    head_bytes: int = 0  # logits (or max-loc pairs) sent to the leader
    steps: int = 0
    #: decode steps' host syncs and bytes to the host, counted by this rank's backend
    host_syncs: int = 0
    host_bytes: int = 0


@dataclass
class Groups:
    """The sub-groups of a ``tp x pp`` job (local: each rank its own)."""

    world: Group
    tp: int
    pp: int
    tensor: Group  # the ranks of this rank's stage
    pipe: Group | None  # the stages' leaders (None on a follower)
    hosts: list[str] = field(default_factory=list)  # host of each world rank

    @property
    def stage(self) -> int:
        return self.world.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.world.rank % self.tp


def make_groups(world: Group, tp: int, hosts: Sequence[str] | None = None) -> Groups:
    """Collective over ``world``: split it into tensor groups of ``tp`` consecutive ranks.

    With one stage the tensor group is the world itself (no split: a transport
    without sub-groups works); with one rank per stage the pipeline is the world.
    """
    p = world.size
    if p % tp:
        raise ValueError(f"make_groups: {p} ranks do not make tensor groups of {tp}")
    pp = p // tp
    hosts = list(hosts) if hosts is not None else world.allgather_obj(socket.gethostname())
    if tp == 1:
        from hpcmac.comm.local import LocalGroup

        return Groups(world, 1, pp, LocalGroup(), world, hosts)
    if pp == 1:
        from hpcmac.comm.local import LocalGroup

        tensor = world
        pipe = LocalGroup() if world.rank == 0 else None
    else:
        tensor = world.split(world.rank // tp, world.rank % tp)
        leaders = world.split(0 if world.rank % tp == 0 else 1, world.rank)
        pipe = leaders if world.rank % tp == 0 else None
    return Groups(world, tp, pp, tensor, pipe, hosts)


class GraphSum:
    """The tensor group's sum inside MLX's graph: ``mx.distributed.all_sum`` over the
    group's own MLX group (ring or JACCL), left unevaluated like any other op; the
    step's one evaluation runs it. The model calls it as it calls the numpy all-reduce
    (a callable, never a Group); :attr:`in_graph` tells the stage to hand it MLX
    arrays."""

    in_graph = True

    def __init__(self, native, size: int, stats: TensorStats):
        import mlx.core as mx

        self.mx, self.native, self.size, self.stats = mx, native, size, stats

    def __call__(self, a):
        self.stats.reduces += 1
        self.stats.sent_bytes += a.nbytes * (self.size - 1)
        return self.mx.distributed.all_sum(a, group=self.native)

    def maxloc(self, logits, v0: int):
        """Each row's best id over the group's vocabulary slices, in the graph: every
        rank's (best logit, id) gathered (``all_gather``), the larger logit winning and a
        tie keeping the lower id (the lower rank), as :meth:`TensorGroup.head` does.
        (k,) int32, the same on every rank. Ids ride as float32: exact below 2**24."""
        mx = self.mx
        f32 = mx.float32
        pair = mx.stack([mx.max(logits, axis=1),
                         mx.argmax(logits, axis=1).astype(f32) + float(v0)], axis=1)
        parts = mx.distributed.all_gather(pair[None], group=self.native)  # (size, k, 2)
        best = mx.argmax(parts[:, :, 0], axis=0)  # the first of equal maxima: lower rank
        ids = mx.take_along_axis(parts[:, :, 1], best[None], axis=0)[0]
        return ids.astype(mx.int32)


class TensorGroup:
    """One stage's tensor group: the all-reduce the model calls, and the leader's steps."""

    def __init__(self, group: Group, hosts: Sequence[str], timeout: float,
                 ranks: Sequence[int] | None = None):
        """Collective over ``group``. ``hosts``, ``ranks``: host and job rank of each
        rank of ``group`` (global; messages, and whether the group shares a host)."""
        from hpcmac.llm.parallel import shmsum

        self.group = group
        self.rank, self.size = group.rank, group.size
        self.wd = Watchdog(group, hosts, timeout, ranks=ranks)
        # a follower's wait for the next step (the leader's sampling and scheduling
        # between two tokens) is longer than an all-reduce's: its own waiting
        # statistics, so that its poll budget does not follow the short waits into
        # sleeping (and waking late) every token
        self.wd_step = Watchdog(group, hosts, timeout, ranks=ranks)
        self._slices: list[int] = []
        self._bufs: dict[tuple, dict[int, np.ndarray]] = {}
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.stats = TensorStats()
        self.shm = None
        if self.size > 1 and shmsum.eligible(list(hosts)[:self.size]):
            shm = shmsum.ShmSum(group)
            self.shm = shm if shm.ok else None
        self._shm_max = shmsum.MAX_BYTES
        #: the sums inside MLX's graph (:meth:`graph_sum`), once the stage uses them
        self.graph: GraphSum | None = None

    def graph_sum(self) -> GraphSum | None:
        """The in-graph sum over this group when its transport carries MLX arrays (an
        MLX group: ring or JACCL, the whole world), else None (MPI, or a sub-group of an
        MLX job: MLX's groups cannot split, mlx#3205, so those are MPI's)."""
        native = getattr(self.group, "native", None)
        if self.size == 1 or native is None:
            return None
        self.graph = GraphSum(native, self.size, self.stats)
        return self.graph

    def in_graph_head(self, mode: int, masks, topk: int) -> bool:
        """Whether this step's head is a max-loc inside the graph (:meth:`GraphSum.maxloc`):
        greedy, no grammar mask, no logprobs, the sums in the graph; the same answer on
        every rank of the group (they all know the step's mode)."""
        return self.graph is not None and mode == MAXLOC and masks is None and topk < 0

    # -- the model's reduction -------------------------------------------------------

    def allreduce(self, a: np.ndarray) -> np.ndarray:
        """Collective over the group: the sum of every rank's ``a`` (float32, same shape),
        added in rank order, so every rank gets the same bits."""
        if self.size == 1:
            return a
        t0 = time.perf_counter()
        a = np.ascontiguousarray(a, dtype=np.float32)
        st = self.stats
        if self.shm is not None and a.nbytes <= self._shm_max:
            out = self.shm.sum(a, self._wait_part)
            st.reduces += 1
            st.sent_bytes += a.nbytes * len(self.peers)
            st.wait_s += time.perf_counter() - t0
            return out
        bufs = self._bufs.get(a.shape)
        if bufs is None:  # receive buffers reused step after step (the sum is a new array)
            bufs = self._bufs[a.shape] = {r: np.empty_like(a) for r in self.peers}
        recvs = [(self.group.irecv(bufs[r], r, TAG_SUM), r) for r in self.peers]
        sends = [(self.group.isend(a, r, TAG_SUM), r) for r in self.peers]
        for req, r in recvs:
            self.wd.wait(req, r, "to send its part of an all-reduce")
        for req, r in sends:
            self.wd.wait(req, r, "to take its part of an all-reduce")
        parts = [a if r == self.rank else bufs[r] for r in range(self.size)]
        out = parts[0] + parts[1]
        for p in parts[2:]:
            out += p
        st.reduces += 1
        st.sent_bytes += a.nbytes * len(self.peers)
        st.wait_s += time.perf_counter() - t0
        return out

    def _wait_part(self, test, peer: int) -> None:
        self.wd.wait(test, peer, "to send its part of an all-reduce")

    # -- leader -> followers -----------------------------------------------------------

    def _send_all(self, bufs: Sequence[np.ndarray]) -> None:
        reqs = [(self.group.isend(b, r, TAG_STEP), r) for r in self.peers for b in bufs]
        if self.shm is not None:  # the followers' doorbell, once the sends are posted (a
            self.shm.ring()  # large one completes only when a follower has posted its receive)
        for req, r in reqs:
            self.wd.wait(req, r, "to take a step")

    def wait_step(self, grace: float) -> None:
        """A follower: return once the leader has sent its next step's messages (through
        the shared mapping's doorbell when the group has one; else the receive of the
        header waits)."""
        if self.shm is not None:
            self.wd_step.wait(self.shm.rung(), 0, "to send a step", grace=grace)

    def send_step(self, meta: np.ndarray, x: np.ndarray, mode: int,
                  masks: np.ndarray | None = None, topk: int = -1) -> None:
        """Leader: the followers run this step too (``x``: token ids or hidden states;
        ``masks``: the sampled rows' packed grammar masks, for a masked max-loc; ``topk``:
        a max-loc that also gives logprobs, the top ``topk``)."""
        if self.size == 1:
            return
        self.stats.steps += 1
        mode |= (MASKED if masks is not None else 0) | ((topk + 1) << 8)
        hdr = np.array([FWD, meta.shape[0], x.shape[0], mode], dtype=np.int32)
        bufs = [hdr, np.ascontiguousarray(meta, dtype=np.int32), np.ascontiguousarray(x)]
        if masks is not None:
            bufs.append(np.ascontiguousarray(masks, dtype=np.int32))
        self._send_all(bufs)

    def send_ctrl(self, ctrl: dict) -> None:
        """Leader: sequences leaving (their cache slots are freed on every rank) and the
        prefix cache's block instructions (each rank copies its own heads)."""
        if self.size == 1 or not (ctrl.get("free") or ctrl.get("kv")):
            return
        from hpcmac.comm import wire

        free = [(int(i), int(slot)) for i, slot in ctrl.get("free", ())]
        kv = [[int(v) for v in op] for op in ctrl.get("kv", ())]
        payload = np.frombuffer(wire.encode({"free": free, "kv": kv}), dtype=np.uint8).copy()
        self._send_all([np.array([CTRL, payload.size, 0, 0], dtype=np.int32), payload])

    def send_ping(self) -> None:
        """Leader, serving and idle: the followers' watchdogs learn the leader is alive."""
        if self.size > 1:
            self._send_all([np.array([PING, 0, 0, 0], dtype=np.int32)])

    def send_stop(self) -> None:
        if self.size > 1:
            self._send_all([np.array([STOP, 0, 0, 0], dtype=np.int32)])

    def _recv(self, buf: np.ndarray, tag: int, src: int, what: str,
              grace: float = 0.0, wd: Watchdog | None = None) -> np.ndarray:
        req = self.group.irecv(buf, src, tag)
        (wd or self.wd).wait(req, src, what, grace=grace)
        return buf

    # -- the head ------------------------------------------------------------------------

    def head(self, logits: np.ndarray, v0: int, mode: int,
             masks: np.ndarray | None = None, topk: int = -1):
        """Collective over the group: combine the vocabulary slices of the logits.

        ``logits``: (k, slice) float32 of this rank's rows ``[v0, v0 + slice)``.
        ``masks``: ``MAXLOC`` only, the rows' packed grammar masks (k, W) over the whole
        vocabulary (every rank holds the same): each rank masks its own slice before
        its max-loc. ``topk`` >= 0 (``MAXLOC``): logprobs too, from the slices alone: each
        rank adds its slice's log-sum-exp and its ``topk`` best (logit, id) of the raw
        logits; the leader's log-sum-exp of those is the whole vocabulary's, and the
        best ``topk`` of the ranks' bests are the whole's. Returns on the leader:
        ``MAXLOC``: (k,) int64 greedy token ids, with ``topk`` also (k, 1 + 2 topk)
        float64 (the chosen token's logprob, the top logprobs, their ids);
        ``GATHER``: (k, vocab) float32 logits. None on the followers.
        """
        k = logits.shape[0]
        if mode == MAXLOC:
            raw = logits
            if masks is not None:
                from hpcmac.llm.grammar import apply_mask

                logits = apply_mask(np.array(logits, dtype=np.float32), masks, v0)
            kk = min(max(topk, 0), raw.shape[1])
            mine = np.full((k, 3 + 2 * max(topk, 0) if topk >= 0 else 2), -np.inf)
            if k:
                best = np.argmax(logits, axis=1)
                mine[:, 0] = logits[np.arange(k), best]
                mine[:, 1] = best + v0
            if k and topk >= 0:
                x = raw.astype(np.float64)
                m = x.max(axis=1, keepdims=True)
                mine[:, 2] = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
                if kk:
                    top = np.argsort(-x, axis=1, kind="stable")[:, :kk]
                    mine[:, 3:3 + kk] = np.take_along_axis(x, top, axis=1)
                    mine[:, 3 + topk:3 + topk + kk] = top + v0
        else:
            mine = np.ascontiguousarray(logits, dtype=np.float32)
        if self.rank != 0:
            req = self.group.isend(mine, 0, TAG_HEAD)
            self.wd.wait(req, 0, "to take the logits")
            self.stats.head_bytes += mine.nbytes
            return None
        parts = [mine]
        for r in self.peers:
            n = mine.shape[1] if mode == MAXLOC else int(self._slices[r])
            buf = np.empty((k, n), dtype=np.float64 if mode == MAXLOC else np.float32)
            parts.append(self._recv(buf, TAG_HEAD, r, "to send its logits"))
        if mode == GATHER:
            return np.concatenate(parts, axis=1)
        out = parts[0][:, :2].copy()
        for p in parts[1:]:  # a strictly larger logit wins: ties keep the lower id
            better = p[:, 0] > out[:, 0]
            out[better] = p[better, :2]
        ids = out[:, 1].astype(np.int64)
        if topk < 0:
            return ids
        return ids, _combine_logprobs(parts, out[:, 0], topk)

    def set_vocab_slices(self, slices: Sequence[int]) -> None:
        """Every rank's vocabulary slice size (global), for the leader's gathers."""
        self._slices = list(slices)


def _combine_logprobs(parts: list[np.ndarray], best: np.ndarray, topk: int) -> np.ndarray:
    """(k, 1 + 2 topk): the chosen logprob, top logprobs and ids, from each rank's
    (best, id, log-sum-exp, topk logits, topk ids) rows (see :meth:`TensorGroup.head`)."""
    lse = np.logaddexp.reduce(np.stack([p[:, 2] for p in parts]), axis=0)  # (k,)
    vals = np.concatenate([p[:, 3:3 + topk] for p in parts], axis=1)
    ids = np.concatenate([p[:, 3 + topk:3 + 2 * topk] for p in parts], axis=1)
    order = np.lexsort((ids, -vals), axis=1)[:, :topk] if topk else \
        np.empty((len(best), 0), dtype=np.int64)
    out = np.empty((len(best), 1 + 2 * topk))
    out[:, 0] = best - lse
    out[:, 1:1 + topk] = np.take_along_axis(vals, order, axis=1) - lse[:, None]
    out[:, 1 + topk:] = np.take_along_axis(ids, order, axis=1)
    return out


def step_phase(meta: np.ndarray) -> str:
    """Decode: every row one token, or one token and its drafts (all rows scored)."""
    return "decode" if bool(np.all((meta[:, 2] == 1) | (meta[:, 2] == meta[:, 4]))) \
        else "prefill"


def logit_rows(meta: np.ndarray) -> np.ndarray:
    """The packed rows whose logits a step needs: the last ``sample`` rows of each
    sequence's tokens (meta column 4: 0 none, 1 its last token, 1 + k with k draft
    tokens, speculative decoding)."""
    ends = np.cumsum(meta[:, 2])
    return np.concatenate([np.arange(e - int(s), e) for e, s in zip(ends, meta[:, 4])]
                          + [np.empty(0, np.int64)]).astype(np.int64)


def follow(tg: TensorGroup, stage, first: bool, last: bool, hidden: int, max_slots: int,
           max_len: int, grace: float, on_step=None) -> None:
    """A follower: run the leader's steps on this rank's shard until ``STOP``.

    ``grace``: extra seconds a step may be late (a leader waits on the pipeline too).
    ``on_step``: called between steps with the busy and CPU seconds of its steps so far
    (serve's busy reports, :mod:`~hpcmac.llm.parallel.busy`).
    """
    from hpcmac.llm.model.stage import Batch

    cache = stage.new_cache(max_slots, max_len)
    v0 = stage.vocab[0]
    busy_s = cpu_s = 0.0
    while True:
        if on_step is not None:
            on_step(busy_s, cpu_s)
        tg.wait_step(grace)
        hdr = tg._recv(np.empty(4, dtype=np.int32), TAG_STEP, 0, "to send a step", grace,
                       wd=tg.wd_step)
        kind, n, T, mode = (int(v) for v in hdr)
        masked, topk, mode = bool(mode & MASKED), (mode >> 8) - 1, mode & 3
        if kind == STOP:
            return
        if kind == PING:
            continue
        if kind == CTRL:
            from hpcmac.comm import wire

            data = tg._recv(np.empty(n, dtype=np.uint8), TAG_STEP, 0, "to send a step")
            try:
                msg = wire.decode(data.tobytes())
                slots = [int(slot) for _, slot in msg["free"]]
                kv = [[int(v) for v in op] for op in msg.get("kv", [])]
            except (ValueError, TypeError, KeyError) as exc:
                raise RuntimeError(f"malformed tensor-group control message: {exc}") from None
            cache.apply(kv, slots)  # with the frees, as the leader does
            continue
        meta = tg._recv(np.empty((n, META), dtype=np.int32), TAG_STEP, 0, "to send a step")
        if first:
            x = tg._recv(np.empty(T, dtype=np.int64), TAG_STEP, 0, "to send a step")
        else:
            x = tg._recv(np.empty((T, hidden), dtype=np.float32), TAG_STEP, 0,
                         "to send a step")
        masks = None
        if masked:  # one packed row per sampled row, over the whole vocabulary
            k = int(meta[:, 4].sum())  # 1 + its drafts per sampled sequence
            masks = tg._recv(np.empty((k, (sum(tg._slices) + 31) // 32), dtype=np.int32),
                             TAG_STEP, 0, "to send a step")
        t0, c0 = time.perf_counter(), time.process_time()
        be = stage.backend
        s0, b0 = be.syncs, be.host_bytes
        lengths = [int(v) for v in meta[:, 2]]
        batch = Batch(slots=[int(v) for v in meta[:, 1]], lengths=lengths,
                      positions=[int(v) for v in meta[:, 3]])
        h = stage.embed(x) if first else x
        lazy = last and be.name == "mlx"  # its one sync: the head's (or the step's)
        h = stage.forward(h, batch, cache, lazy=lazy)
        if last:
            rows = logit_rows(meta)
            wait = stage.cache_arrays(cache)
            if len(rows):
                lg = stage.logits(h[be.index(rows)] if lazy else h[rows], lazy=lazy)
                if lazy and tg.in_graph_head(mode, masks, topk):  # the leader reads the ids
                    be.eval(tg.graph.maxloc(lg, v0), *wait)
                else:
                    tg.head(be.host(lg, *wait) if lazy else np.asarray(lg, dtype=np.float32),
                            v0, mode, masks, topk)
            elif lazy:
                be.eval(h, *wait)
        if step_phase(meta) == "decode":
            tg.stats.host_syncs += be.syncs - s0
            tg.stats.host_bytes += be.host_bytes - b0
        busy_s += time.perf_counter() - t0
        cpu_s += time.process_time() - c0

